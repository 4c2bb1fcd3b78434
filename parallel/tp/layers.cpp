#include "parallel/tp/layers.h"

#include <torch/torch.h>

#include "parallel/autograd_comm.h"
#include "parallel/pp/weight_grad.h"

namespace tessel::parallel::tp {
namespace {

torch::Tensor leave_row(Group& g, const torch::Tensor& partial, bool sp) {
  return sp ? sequence_scatter(g, partial, 1) : reduce_from(g, partial);
}

int64_t chunk(int64_t n, const Group& g, const char* what) {
  TORCH_CHECK(n % g.size() == 0, what, " (", n, ") is not divisible by the tensor-parallel size (",
              g.size(), ")");
  return n / g.size();
}

}  // namespace

torch::Tensor enter(Group& g, const torch::Tensor& x, bool sp) {
  return sp ? sequence_gather(g, x, 1) : copy_to(g, x);  // [b, s, in] on every rank
}

torch::Tensor Shard::of(const torch::Tensor& global) const {
  if (parts == 1) return global;
  return global.chunk(parts, dim)[static_cast<size_t>(index)].contiguous();
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(Group& tp, int64_t in, int64_t out,
                                                   bool with_bias, bool sp)
    : tp_(&tp), sp_(sp) {
  const int64_t local = chunk(out, tp, "output features");
  weight = register_parameter("weight", torch::empty({local, in}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({local}));
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  return forward_entered(enter(*tp_, x, sp_));
}

torch::Tensor ColumnParallelLinearImpl::forward_entered(const torch::Tensor& x_full,
                                                        bool add_bias) {
  return pp::linear(x_full, weight, add_bias ? bias : torch::Tensor(), defer_weight_grad);
}

RowParallelLinearImpl::RowParallelLinearImpl(Group& tp, int64_t in, int64_t out, bool with_bias,
                                             bool sp)
    : tp_(&tp), sp_(sp) {
  const int64_t local = chunk(in, tp, "input features");
  weight = register_parameter("weight", torch::empty({out, local}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({out}));
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  auto y = leave_row(*tp_, pp::linear(x, weight), sp_);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(Group& tp, int64_t vocab, int64_t dim,
                                                       bool sp)
    : tp_(&tp), sp_(sp) {
  rows_ = padded_vocab(vocab, tp.size()) / tp.size();
  start_ = vocab_slice_start(vocab, tp.size(), tp.rank());
  weight = register_parameter("weight", torch::empty({rows_, dim}));
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& tokens) {
  if (tp_->size() == 1) return torch::embedding(weight, tokens);  // every row is this rank's
  // Tokens outside this rank's rows look up row 0 and are zeroed; the sum over the group then
  // holds every token's row exactly once. (Out-of-range ids are refused by the data layer, the
  // same at every tensor-parallel size, before they reach the model.)
  auto outside = (tokens < start_) | (tokens >= start_ + rows_);
  auto local = (tokens - start_).masked_fill(outside, 0);
  auto e = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return leave_row(*tp_, e, sp_);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Softmax statistics cross the group as [N] vectors: the max, the sum of exponentials and the
// target's logit. Backward is local: softmax minus the one-hot target (if this rank holds it).
// Memory: one fp32 [N, V/tp] buffer (the logits' fp32 copy, turned into the softmax in place and
// kept for backward, which turns it into the gradient in place) besides the input.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits_in,
                               const torch::Tensor& targets, int64_t group, int64_t vocab_start,
                               int64_t vocab) {
    Group& g = unpack_group(group);
    // A copy even when the logits are fp32 already: they are the head's output, not ours to edit.
    auto w = logits_in.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);  // [N, Vl]
    auto s = vocab_parallel_softmax_stats(g, w, targets, vocab_start, vocab);
    w.div_(s.sum.unsqueeze(1));  // softmax
    ctx->save_for_backward({w, s.local_target, s.mine});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits_in.scalar_type());
    return s.sum.log() - s.target_logit;  // [N]
  }

  // Runs once per forward (no retain_graph): the saved softmax becomes the gradient in place.
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    auto g = saved[0], local_t = saved[1], mine = saved[2];
    g.scatter_add_(1, local_t, -mine.to(g.scalar_type()).unsqueeze(1));  // local_t: [N, 1]
    g.mul_(grad[0].unsqueeze(1));
    auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

SoftmaxStats vocab_parallel_softmax_stats(Group& g, torch::Tensor& w, const torch::Tensor& targets,
                                          int64_t vocab_start, int64_t vocab) {
  const int64_t vl = w.size(1);
  if (vocab_start + vl > vocab)  // padding columns (the last ones): never part of the softmax
    w.narrow(1, vocab - vocab_start, vocab_start + vl - vocab)
        .fill_(-std::numeric_limits<float>::infinity());
  auto max = std::get<0>(w.max(1));  // [N]
  g.all_reduce(max, c10d::ReduceOp::MAX).wait();
  SoftmaxStats s;
  s.mine = (targets >= vocab_start) & (targets < vocab_start + vl);
  s.local_target = (targets - vocab_start).masked_fill(~s.mine, 0).unsqueeze(1);
  s.target_logit = (w.gather(1, s.local_target).squeeze(1) - max).masked_fill(~s.mine, 0);
  g.all_reduce(s.target_logit).wait();
  w.sub_(max.unsqueeze(1)).exp_();
  s.sum = w.sum(1);
  g.all_reduce(s.sum).wait();
  return s;
}

torch::Tensor vocab_parallel_cross_entropy(Group& tp, const torch::Tensor& logits,
                                           const torch::Tensor& targets, int64_t vocab_start,
                                           int64_t vocab) {
  return VocabParallelCrossEntropy::apply(logits, targets, pack_group(tp), vocab_start, vocab);
}

}  // namespace tessel::parallel::tp
