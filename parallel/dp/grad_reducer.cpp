#include "parallel/dp/grad_reducer.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <deque>

namespace tessel::parallel::dp {
namespace {

struct ReadyHook : torch::autograd::PostAccumulateGradHook {
  explicit ReadyHook(std::function<void(const torch::autograd::Variable&)> f) : fn(std::move(f)) {}
  void operator()(const torch::autograd::Variable& v) override { fn(v); }
  std::function<void(const torch::autograd::Variable&)> fn;
};

}  // namespace

GradReducer::GradReducer(const Mesh& mesh, const std::vector<optim::NamedParam>& params,
                         optim::FlatAdamW& opt, bool keep_gathered)
    : mesh_(mesh),
      opt_(opt),
      reduce_(mesh.dp_cp().size() > 1 || opt.sharding().grads),
      fold_(opt.low_precision() && !opt.sharding().grads),
      once_(reduces_once(opt.sharding(), mesh.layout().pp, keep_gathered, opt.low_precision())),
      wait_(observe::time_on_device(mesh.device(), mesh.dp_cp().is_nccl())) {
  const auto& layout = opt.layout();
  // Each chunk's slots are one contiguous range (the model registers them so).
  std::map<std::string, const optim::NamedParam*> by_name;
  int64_t chunks = 0;
  for (const auto& p : params) {
    by_name[p.name] = &p;
    chunks = std::max(chunks, p.chunk + 1);
  }
  chunk_range_.assign(static_cast<size_t>(chunks), {-1, -1});
  final_.assign(static_cast<size_t>(chunks), false);
  for (const auto& s : layout.slots()) {
    auto& [b, e] = chunk_range_[static_cast<size_t>(by_name.at(s.name)->chunk)];
    if (b < 0) b = s.offset;
    TORCH_CHECK(e < 0 || e <= s.offset,
                "gradient reducer: the parameters of a pipeline chunk are "
                "not contiguous in the flat buffer (at ",
                s.name, ")");
    e = s.offset + s.numel;
  }
  state_.resize(layout.buckets().size());
  table_.assign(layout.buckets().size(), false);
  for (const auto& s : layout.slots())
    if (s.name == "embed.weight") table_[static_cast<size_t>(s.bucket)] = true;
  if (!reduce_ && !fold_) return;
  for (const auto& s : layout.slots()) {
    auto p = by_name.at(s.name)->tensor;
    if (fold_) folded_.emplace_back(p, &s);
    const auto index = static_cast<size_t>(s.bucket);
    const Slot* slot = &s;
    torch::autograd::impl::set_post_acc_grad_hooks(
        p, std::make_unique<ReadyHook>([this, index, slot](const torch::autograd::Variable& v) {
          on_grad_ready(index, *slot, v);
        }));
    hooked_.push_back(p);
  }
}

GradReducer::~GradReducer() {
  for (auto& p : hooked_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void GradReducer::begin_backward(int64_t chunk, bool final) {
  final_[static_cast<size_t>(chunk)] = final;  // bucket counts start at 0 (finish() resets them)
}

void GradReducer::on_grad_ready(size_t index, const Slot& slot,
                                const torch::autograd::Variable& p) {
  const auto& layout = opt_.layout();
  const auto& b = layout.buckets()[index];
  auto& st = state_[index];
  auto& group = mesh_.zero_shards(b.expert);  // the data group, or ZeRO's shard group of it
  if (opt_.sharding().grads) {
    if (once_ && !final_[static_cast<size_t>(b.chunk)]) return;  // accumulates in the parameter
    TORCH_CHECK(!st.summed, "gradient reducer: bucket ", index,
                " got a gradient after its sum over the ZeRO replicas started (hybrid sharding)");
    // Take the gradient out of the parameter (fp32) and drop it: only the bucket buffer holds it.
    torch::NoGradGuard no_grad;
    if (st.ready == 0 && st.buffer.defined()) {
      // Filled again while its last reduction is in flight: a tied token table whose head and
      // embedding sit in two chunks of one rank (zbv) gets one gradient from each chunk's
      // backward, each reduced as it comes (the table has a bucket of its own).
      drain(index);
      in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), index));
    }
    if (!st.buffer.defined()) {
      st.buffer = torch::zeros({b.end - b.begin}, p.grad().options().dtype(torch::kFloat32));
      live_bucket_bytes_ += st.buffer.numel() * 4;
      peak_bucket_bytes_ = std::max(peak_bucket_bytes_, live_bucket_bytes_);
    }
    st.buffer.narrow(0, slot.offset - b.begin, slot.numel).copy_(p.grad().flatten());
    const_cast<torch::autograd::Variable&>(p).mutable_grad() = torch::Tensor();
    if (++st.ready < b.params) return;
    st.ready = 0, st.reduced = true;
    // In place: this rank's piece of the buffer receives the sum (the buffer is dropped once
    // drained, so Gloo may all-reduce it whole).
    const int64_t piece = layout.piece_numel(b);
    st.piece = st.buffer.narrow(0, b.shard_rank * piece, piece);
    st.work = group.reduce_scatter(st.piece, st.buffer, c10d::ReduceOp::SUM,
                                   /*scratch_input=*/true);
    if (on_bucket_done) on_bucket_done(index);
    // Bound the transient gradient memory: with more than kInFlight buckets reducing, the
    // oldest is waited for and folded into the shard (it has had the others' time to finish).
    in_flight_.push_back(index);
    while (in_flight_.size() > kInFlight) {
      drain(in_flight_.front());
      in_flight_.pop_front();
    }
    return;
  }
  if (fold_) {  // bf16/fp16: into the fp32 gradient at once, the 16-bit one dropped
    torch::NoGradGuard no_grad;
    opt_.fold_grad(slot, const_cast<torch::autograd::Variable&>(p).mutable_grad());
  }
  if (!reduce_ || !final_[static_cast<size_t>(b.chunk)]) return;
  if (++st.ready < b.params) return;
  // Complete (its gradients folded in as they came): reduce.
  auto whole = opt_.grad().narrow(0, b.begin, b.end - b.begin);
  if (!opt_.sharding().state) {
    st.work = group.all_reduce(whole);
    return;
  }
  // In place (output = input + rank·count): NCCL natively; Gloo all-reduces the bucket itself, not
  // a copy (the other ranks' pieces of this rank's gradient are not read again this step).
  st.piece = opt_.grad().narrow(0, layout.piece_flat(b), layout.piece_numel(b));
  st.work = group.reduce_scatter(st.piece, whole, c10d::ReduceOp::SUM, /*scratch_input=*/true);
}

void GradReducer::check_complete(size_t i) const {
  const auto& b = opt_.layout().buckets()[i];
  const auto& st = state_[i];
  if (opt_.sharding().grads ? st.ready != 0 || !st.reduced : st.ready != b.params)
    throw std::runtime_error(
        fmt::format("data parallel: bucket {} got {} of its {} gradients in backward; a parameter "
                    "took no part in the loss",
                    i, opt_.sharding().grads && st.ready == 0 ? 0 : st.ready, b.params));
}

void GradReducer::drain(size_t i) {
  const auto& b = opt_.layout().buckets()[i];
  auto& st = state_[i];
  wait_.start();
  st.work.wait();
  wait_.stop();
  if (opt_.sharding().grads) {
    opt_.grad_shard().narrow(0, b.shard_offset, opt_.layout().piece_numel(b)).add_(st.piece);
    live_bucket_bytes_ -= st.buffer.numel() * 4;
    st.buffer = torch::Tensor();
    st.piece = torch::Tensor();
    // The step's last reduce-scatter of the bucket: its piece is complete.
    if (final_[static_cast<size_t>(b.chunk)] && !table_[i]) sum_over_replicas(i);
  } else if (opt_.sharding().state_only()) {
    st.piece = torch::Tensor();  // a view of the gradient, reduced in place
  }
}

void GradReducer::end_backward(int64_t chunk, bool final) {
  if (opt_.sharding().grads) {
    if (once_ && !final) return;
    for (size_t i = 0; i < state_.size(); ++i)
      if (opt_.layout().buckets()[i].chunk == chunk) check_complete(i);
    // Every bucket of this chunk still reducing (the others' buckets belong to other chunks'
    // backwards, which interleave under pipelining).
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      if (opt_.layout().buckets()[*it].chunk != chunk) {
        ++it;
        continue;
      }
      drain(*it);
      it = in_flight_.erase(it);
    }
    for (size_t i = 0; i < state_.size(); ++i)
      if (opt_.layout().buckets()[i].chunk == chunk) state_[i].reduced = false;
    return;
  }
  // bf16/fp16: a gradient that reached a parameter without its hook (a second lane's, added
  // by parallel/pp/pairs.cpp) is folded now.
  const auto [begin, end] = chunk_range_[static_cast<size_t>(chunk)];
  torch::NoGradGuard no_grad;
  for (auto& [p, slot] : folded_)
    if (slot->offset >= begin && slot->offset < end && p.grad().defined())
      opt_.fold_grad(*slot, p.mutable_grad());
}

void GradReducer::finish() {
  if (reduce_ && !opt_.sharding().grads)
    for (size_t i = 0; i < state_.size(); ++i) {
      check_complete(i);
      drain(i);
      state_[i].ready = 0;
      sum_over_replicas(i);
    }
  std::fill(final_.begin(), final_.end(), false);
  for (size_t i = 0; i < state_.size(); ++i) sum_over_replicas(i);        // those not started yet
  if (!mesh_.zero_replicas(false) && !mesh_.zero_replicas(true)) return;  // no hybrid sharding
  wait_.start();
  for (auto& st : state_)
    if (st.summed) st.replica.wait();
  wait_.stop();
  for (auto& st : state_) st.summed = false, st.replica_piece = torch::Tensor();
}

void GradReducer::sum_over_replicas(size_t i) {
  const auto& layout = opt_.layout();
  const auto& b = layout.buckets()[i];
  auto* replicas = mesh_.zero_replicas(b.expert);
  auto& st = state_[i];
  if (!replicas || replicas->size() < 2 || st.summed) return;
  st.summed = true;
  st.replica_piece = opt_.sharding().state_only()
                         ? opt_.grad().narrow(0, layout.piece_flat(b), layout.piece_numel(b))
                         : opt_.grad_shard().narrow(0, b.shard_offset, layout.piece_numel(b));
  st.replica = replicas->all_reduce(st.replica_piece);
}

void GradReducer::abandon_step() {
  std::fill(final_.begin(), final_.end(), false);
  for (auto& st : state_) st = BucketState{};
  in_flight_.clear();
  live_bucket_bytes_ = 0;
}

}  // namespace tessel::parallel::dp
