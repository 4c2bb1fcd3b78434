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
  // Each chunk's slots are one contiguous range (the model registers them so).
  const auto chunks = static_cast<size_t>(model->chunks());
  chunk_range_.assign(chunks, {-1, -1});
  final_.assign(chunks, false);
  for (const auto& s : opt.slots()) {
    auto& [b, e] = chunk_range_[static_cast<size_t>(model->specs().at(s.name).chunk)];
    if (b < 0) b = s.offset;
    TORCH_CHECK(e < 0 || e == s.offset,
                "gradient reducer: the parameters of a pipeline chunk are "
                "not contiguous in the flat buffer (at ",
                s.name, ")");
    e = s.offset + s.numel;
  }
  if (!reduce_) return;
  const int64_t cap =
      std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20) / 4));  // fp32 elements
  auto params = model->named_parameters();
  for (const auto& s : opt.slots()) {
    const int64_t chunk = model->specs().at(s.name).chunk;
    if (buckets_.empty() || buckets_.back().end - buckets_.back().begin >= cap ||
        buckets_.back().chunk != chunk)
      buckets_.push_back({s.offset, s.offset, 0, chunk});
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

void GradReducer::begin_backward(int64_t chunk, bool final) {
  final_[static_cast<size_t>(chunk)] = final;  // bucket counts start at 0 (finish() resets them)
}

void GradReducer::on_grad_ready(size_t index) {
  auto& b = buckets_[index];
  if (!final_[static_cast<size_t>(b.chunk)]) return;
  if (++b.ready < b.params) return;
  // Complete: fold this micro-batch's bf16 gradients in (fp32 accumulation), then sum over dp×cp.
  opt_.fold_microbatch(b.begin, b.end);
  auto slice = opt_.grad().narrow(0, b.begin, b.end - b.begin);
  b.work = mesh_.dp_cp().all_reduce(slice);
}

void GradReducer::end_backward(int64_t chunk, bool final) {
  if (reduce_ && final) return;  // its buckets folded themselves before reducing
  const auto [begin, end] = chunk_range_[static_cast<size_t>(chunk)];
  opt_.fold_microbatch(begin, end);
}

double GradReducer::finish() {
  std::fill(final_.begin(), final_.end(), false);
  if (!reduce_) return 0.0;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    if (b.ready != b.params)
      throw std::runtime_error(fmt::format(
          "data parallel: bucket {} got {} of its {} gradients in backward; a parameter "
          "took no part in the loss",
          i, b.ready, b.params));
    b.work.wait();
    b.ready = 0;
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace tessel::parallel::dp
