#include "parallel/tp/layers.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>

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
                                                   bool with_bias, bool sp, int64_t true_out)
    : tp_(&tp), sp_(sp), true_out_(true_out) {
  const int64_t local = chunk(out, tp, "output features");
  weight = register_parameter("weight", torch::empty({local, in}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({local}));
}

std::vector<std::pair<std::string, Placement>> ColumnParallelLinearImpl::placements() const {
  std::vector<std::pair<std::string, Placement>> p{{"weight", {weight_shard(), true_out_}}};
  if (bias.defined()) p.push_back({"bias", {weight_shard(), true_out_}});
  return p;
}

kernels::fp8::Recipe fp8_recipe(plan::Fp8 recipe) {
  return recipe == plan::Fp8::kTensorwise ? kernels::fp8::Recipe::kTensorwise
         : recipe == plan::Fp8::kRowwise  ? kernels::fp8::Recipe::kRowwise
                                          : kernels::fp8::Recipe::kOff;
}

kernels::fp8::Spec fp8_spec(plan::Fp8 recipe, Group* tokens, Group* in, Group* out) {
  auto max_over = [](Group* g) -> kernels::fp8::Reduce {
    if (!g || g->size() == 1) return nullptr;
    return [g](torch::Tensor& amax) { g->all_reduce(amax, c10d::ReduceOp::MAX).wait(); };
  };
  return {fp8_recipe(recipe), max_over(tokens), max_over(in), max_over(out)};
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  return forward_entered(enter(*tp_, x, sp_));
}

torch::Tensor ColumnParallelLinearImpl::forward_entered(const torch::Tensor& x_full,
                                                        bool add_bias) {
  return pp::linear(x_full, weight, add_bias ? bias : torch::Tensor(), defer_weight_grad, &fp8_);
}

RowParallelLinearImpl::RowParallelLinearImpl(Group& tp, int64_t in, int64_t out, bool with_bias,
                                             bool sp)
    : tp_(&tp), sp_(sp) {
  const int64_t local = chunk(in, tp, "input features");
  weight = register_parameter("weight", torch::empty({out, local}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({out}));
}

std::vector<std::pair<std::string, Placement>> RowParallelLinearImpl::placements() const {
  return {{"weight", {weight_shard()}}};
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  auto y = leave_row(*tp_, pp::linear(x, weight, {}, true, &fp8_), sp_);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(Group& tp, int64_t vocab, int64_t dim,
                                                       bool sp)
    : tp_(&tp), sp_(sp), vocab_(vocab) {
  rows_ = padded_vocab(vocab, tp.size()) / tp.size();
  start_ = vocab_slice_start(vocab, tp.size(), tp.rank());
  weight = register_parameter("weight", torch::empty({rows_, dim}));
}

std::vector<std::pair<std::string, Placement>> VocabParallelEmbeddingImpl::placements() const {
  return {{"weight", {weight_shard(), vocab_}}};
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

// The statistics cross the group as [N] vectors (vocab_parallel_log_softmax). Backward is local:
// softmax minus the one-hot target (if this rank holds it), made in the log-softmax's buffer.
// Memory: one fp32 [N, V/tp] buffer besides the input, kept from forward to backward.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, int64_t group, int64_t vocab_start,
                               int64_t vocab) {
    auto s = vocab_parallel_log_softmax(unpack_group(group), logits, targets, vocab_start, vocab);
    ctx->save_for_backward({s.logp, s.shift, s.local_target, s.mine});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return s.loss;  // [N]
  }

  // Runs once per forward (no retain_graph): the saved log-softmax becomes the gradient in place.
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    LogSoftmax s{saved[0], saved[1], {}, saved[2], saved[3]};
    auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {softmax_minus_target(s, grad[0], dtype), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

LogSoftmax vocab_parallel_log_softmax(Group& g, const torch::Tensor& logits,
                                      const torch::Tensor& targets, int64_t vocab_start,
                                      int64_t vocab, bool overwrite) {
  const int64_t n = logits.size(0), vl = logits.size(1);
  // Padding columns (the last ones of the last slice) are never part of the softmax: they are
  // -inf in the buffer, so its log-softmax and gradient need no narrowing (gradient exactly 0).
  const int64_t real = std::clamp<int64_t>(vocab - vocab_start, 0, vl);
  const auto f32 = logits.options().dtype(torch::kFloat32);
  const float inf = std::numeric_limits<float>::infinity();
  LogSoftmax s;
  // The fp32 log-softmax of this rank's columns: an fp32 copy (unless the caller hands over fp32
  // logits to overwrite), made the log-softmax in place by LibTorch's fused kernel. CUDA's kernel
  // converts on the fly from fp16 only, not bf16, so the copy comes first on every device and
  // dtype. (The kernels read each element before writing it, in place too: equal bitwise to out of
  // place on CPU and on an H200, bench/RESULTS.md.)
  const bool in_place =
      overwrite && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32;
  s.logp = in_place ? logits : logits.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  if (real < vl) s.logp.narrow(1, real, vl - real).fill_(-inf);
  // With several ranks, this slice's largest logit, before the buffer becomes the log-softmax.
  torch::Tensor x_max;
  if (g.size() > 1 && real > 0) x_max = std::get<0>(s.logp.max(1));
  if (real > 0) at::_log_softmax_out(s.logp, s.logp, 1, /*half_to_float=*/false);
  s.mine = (targets >= vocab_start) & (targets < vocab_start + real);
  s.local_target = (targets - vocab_start).masked_fill(~s.mine, 0).unsqueeze(1);
  auto target_logp =
      real > 0 ? s.logp.gather(1, s.local_target).squeeze(1) : torch::zeros({n}, f32);
  if (g.size() == 1) {  // the whole vocabulary is here: log p = logp
    s.shift = torch::zeros({0}, f32);
    s.loss = target_logp.neg();
    return s;
  }
  // This slice's log-sum-exp: its max less the log-softmax's largest value (-log of its sum).
  auto lse = real > 0 ? x_max - std::get<0>(s.logp.max(1)) : torch::full({n}, -inf, f32);
  // The whole vocabulary's: the slices' largest, plus the log of their exponentials' sum.
  auto global = lse.clone();
  g.all_reduce(global, c10d::ReduceOp::MAX).wait();
  auto sum = (lse - global).exp_();
  g.all_reduce(sum).wait();
  global.add_(sum.log_());
  s.shift = lse.sub_(global);  // log p = logp + shift on this rank's columns
  // -log p(target) = -(target's logp + shift), from the rank holding it.
  s.loss = (target_logp + s.shift).neg_().masked_fill_(~s.mine, 0);
  g.all_reduce(s.loss).wait();
  return s;
}

torch::Tensor softmax_minus_target(LogSoftmax& s, const torch::Tensor& scale,
                                   torch::ScalarType dtype) {
  auto p = s.logp;
  if (s.shift.numel() > 0) p.add_(s.shift.unsqueeze(1));
  p.exp_();  // padding columns: exp(-inf) = 0
  p.scatter_add_(1, s.local_target, -s.mine.to(p.scalar_type()).unsqueeze(1));
  if (dtype == p.scalar_type() && !scale.defined()) return p;
  auto out = dtype == p.scalar_type() ? p : torch::empty(p.sizes(), p.options().dtype(dtype));
  if (!scale.defined()) {
    out.copy_(p);  // cast in the copy
  } else if (p.is_cuda() || out.scalar_type() == p.scalar_type()) {
    torch::mul_out(out, p, scale.to(p.scalar_type()).unsqueeze(1));  // scaled and cast in one pass
  } else {  // LibTorch's CPU kernels cast to another dtype through an fp32 temporary of p's size
    p.mul_(scale.to(p.scalar_type()).unsqueeze(1));
    out.copy_(p);
  }
  return out;
}

torch::Tensor vocab_parallel_cross_entropy(Group& tp, const torch::Tensor& logits,
                                           const torch::Tensor& targets, int64_t vocab_start,
                                           int64_t vocab) {
  return VocabParallelCrossEntropy::apply(logits, targets, pack_group(tp), vocab_start, vocab);
}

}  // namespace tessel::parallel::tp
