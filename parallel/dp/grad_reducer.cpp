#include "parallel/dp/grad_reducer.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <chrono>

namespace tessel::parallel::dp {
namespace {

struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  explicit ReadyHook(std::function<void()> f) : fn(std::move(f)) {}
  void operator()(const torch::autograd::Variable&) override { fn(); }
  std::function<void()> fn;
};

}  // namespace

GradReducer::GradReducer(const Mesh& mesh, models::Decoder& model, FlatAdamW& opt, double bucket_mb)
    : mesh_(mesh), opt_(opt), reduce_(mesh.dp_cp().size() > 1) {
  if (!reduce_) return;
  const int64_t cap =
      std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20) / 4));  // fp32 elements
  auto params = model->named_parameters();
  for (const auto& s : opt.slots()) {
    if (buckets_.empty() || buckets_.back().end - buckets_.back().begin >= cap)
      buckets_.push_back({s.offset, s.offset, 0});
    auto& b = buckets_.back();
    b.end = s.offset + s.numel;
    ++b.params;
    const size_t index = buckets_.size() - 1;
    auto& p = params[s.name];
    torch::autograd::impl::set_post_acc_grad_hooks(
        p, std::make_unique<ReadyHook>([this, index] { on_grad_ready(index); }));
    hooked_.push_back(p);
  }
}

GradReducer::~GradReducer() {
  for (auto& p : hooked_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void GradReducer::begin_microbatch(bool final) {
  final_ = final;
  for (auto& b : buckets_) b.ready = 0;
}

void GradReducer::on_grad_ready(size_t index) {
  if (!final_) return;
  auto& b = buckets_[index];
  if (++b.ready < b.params) return;
  // Complete: fold this micro-batch's bf16 gradients in (fp32 accumulation), then sum over dp×cp.
  opt_.fold_microbatch(b.begin, b.end);
  auto slice = opt_.grad().narrow(0, b.begin, b.end - b.begin);
  b.work = mesh_.dp_cp().all_reduce(slice);
}

double GradReducer::end_microbatch() {
  if (!reduce_ || !final_) {
    opt_.accumulate_microbatch();
    return 0.0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    if (b.ready != b.params)
      throw std::runtime_error(fmt::format(
          "data parallel: bucket {} got {} of its {} gradients in backward; a parameter "
          "took no part in the loss",
          i, b.ready, b.params));
    b.work.wait();
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace tessel::parallel::dp
