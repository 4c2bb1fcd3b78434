// Megatron-style tensor-parallel layers (Shoeybi et al. 2019, arXiv:1909.08053; sequence
// parallelism: Korthikanti et al. 2022, arXiv:2205.05198), in the LibTorch module idiom. Each
// holds its shard of a global parameter; `shard` says which, so initialisation, checkpoints and
// export work on the global tensor. Communication goes through parallel/autograd_comm.h.
//
// Shapes (t = tensor-parallel size, s = sequence, SP = sequence parallelism):
//   ColumnParallelLinear  x [b, s, in] (SP: [b, s/t, in]) -> [b, s, out/t];  W [out/t, in]
//   RowParallelLinear     x [b, s, in/t] -> [b, s, out] (SP: [b, s/t, out]); W [out, in/t]
//   VocabParallelEmbedding tokens [b, s] -> [b, s, h] (SP: [b, s/t, h]);    W [Vp/t, h]
// Vp is the vocabulary padded to a multiple of t; padded rows are never looked up and padded
// logits never count (vocab_parallel_cross_entropy masks them).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <functional>

#include "core/kernels/fp8.h"
#include "core/plan/choices.h"
#include "parallel/comm.h"

namespace tessel::parallel::tp {

/// Which slice of the global parameter a rank holds: `parts` equal chunks along `dim`, chunk
/// `index`. parts == 1: the whole (replicated) tensor.
struct Shard {
  int64_t dim = 0, parts = 1, index = 0;
  /// This rank's slice of a global tensor.
  torch::Tensor of(const torch::Tensor& global) const;
};

/// How one parameter sits over the model-parallel groups, declared by the layer that makes it (as
/// Megatron sets its tensor-parallel attributes at creation): the slice this rank holds and, for
/// a replicated one, whether each rank's gradient is only partial (summed over tp).
struct Placement {
  Shard shard;                // parts 1: the whole tensor
  int64_t true_rows = 0;      // > 0: dim 0 is a vocabulary padded past this many rows
  bool partial_grad = false;  // replicated, but each tp rank's gradient is partial
  bool expert = false;        // stacked experts: `shard` splits dim 0 over the ep group, not tp
};
/// A layer that declares its parameters' placements, by the names it registered them under. The
/// model's parameters that no layer declares are replicated (models/layers.cpp build_specs).
class Placed {
 public:
  virtual ~Placed() = default;
  virtual std::vector<std::pair<std::string, Placement>> placements() const = 0;
};

/// Vocabulary padded up to a multiple of the tensor-parallel size.
inline int64_t padded_vocab(int64_t vocab, int64_t tp) { return (vocab + tp - 1) / tp * tp; }
/// First row of tp rank `rank`'s slice [start, start + Vp/t) of the padded vocabulary.
inline int64_t vocab_slice_start(int64_t vocab, int64_t tp, int64_t rank) {
  return padded_vocab(vocab, tp) / tp * rank;
}

/// What a device's matmul [m, k] x [k, n] (the first operand transposed when `a_transposed`)
/// allocates at its peak, output included, in bytes: a device profile's measure (--dry-run's, of
/// oneDNN's bf16/fp16 workspaces on a CPU), or null: its [m, n] output alone.
using MatmulBytes = std::function<double(int64_t m, int64_t k, int64_t n, bool a_transposed)>;
inline double matmul_bytes(const MatmulBytes& measured, int64_t m, int64_t k, int64_t n,
                           bool a_transposed, double w) {
  return measured ? measured(m, k, n, a_transposed)
                  : w * static_cast<double>(m) * static_cast<double>(n);
}

/// A linear layer's float8 scaling (training.fp8): its recipe, and each amax completed over the
/// group that splits its axis. `tokens`: the group splitting a micro-batch's tokens (context
/// parallelism), null for none; the layer adds its own tensor-parallel axis.
kernels::fp8::Spec fp8_spec(plan::Fp8 recipe, Group* tokens, Group* in, Group* out);
/// The plan's recipe as the kernels name it.
kernels::fp8::Recipe fp8_recipe(plan::Fp8 recipe);

/// Input of a column-parallel region: x [b, s, h] replicated (copy_to: all-reduce in backward),
/// or with SP x [b, s/t, h] all-gathered along the sequence (reduce-scatter in backward).
torch::Tensor enter(Group& tp, const torch::Tensor& x, bool sequence_parallel);

class ColumnParallelLinearImpl : public torch::nn::Module, public Placed {
 public:
  /// `true_out` > 0: `out` is a vocabulary padded past that many rows (the head).
  ColumnParallelLinearImpl(Group& tp, int64_t in, int64_t out, bool bias, bool sequence_parallel,
                           int64_t true_out = 0);
  torch::Tensor forward(const torch::Tensor& x);
  /// The same on an input that already went through enter() (several layers share one gather);
  /// without its bias when `add_bias` is false (the caller adds it: a fused bias and activation).
  torch::Tensor forward_entered(const torch::Tensor& x_full, bool add_bias = true);
  torch::Tensor weight, bias;
  Shard weight_shard() const { return {0, tp_->size(), tp_->rank()}; }
  /// Zero-bubble pipelines: its weight gradient may wait for W (parallel/pp/weight_grad.h).
  bool defer_weight_grad = true;
  /// training.fp8: its matmuls in float8 (its output features split over tp); `tokens` as fp8_spec.
  void set_fp8(plan::Fp8 recipe, Group* tokens) { fp8_ = fp8_spec(recipe, tokens, nullptr, tp_); }
  /// weight and bias split along the output features.
  std::vector<std::pair<std::string, Placement>> placements() const override;
  /// Sequence parallelism: elements per token and unit of its input's width it keeps for its
  /// weight's gradient beyond the input's own shard (1/tp of the sequence, which the part before
  /// keeps): the rest of the all-gathered input. Layers sharing one input (q/k/v, gate/up) keep
  /// it once.
  static double gathered_kept_per_in(double tp, bool sp) { return sp ? 1.0 - 1.0 / tp : 0.0; }

 private:
  Group* tp_;
  bool sp_;
  int64_t true_out_;
  kernels::fp8::Spec fp8_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module, public Placed {
 public:
  RowParallelLinearImpl(Group& tp, int64_t in, int64_t out, bool bias, bool sequence_parallel);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;  // bias is replicated: added once, after the reduction
  Shard weight_shard() const { return {1, tp_->size(), tp_->rank()}; }
  /// training.fp8: its matmuls in float8 (its input features split over tp); `tokens` as fp8_spec.
  void set_fp8(plan::Fp8 recipe, Group* tokens) { fp8_ = fp8_spec(recipe, tokens, tp_, nullptr); }
  /// weight split along the input features; bias replicated.
  std::vector<std::pair<std::string, Placement>> placements() const override;
  /// Bytes its backward holds at once over `tokens` rows, its input `in_local` wide on this rank
  /// and its output `out` wide, elements `w` bytes wide (measured with the counting allocator, CPU
  /// fp32, 2026-11-28): `input` the input's gradient (a zero-bubble B; under sequence parallelism
  /// beside the all-gathered output gradient), `weight` the weight's gradient (a W), `both` an
  /// ordinary backward, which makes the input's gradient and then the weight's beside it (a
  /// matmul's workspace is gone once it returns). `matmul`: the device's matmul bytes.
  struct BackwardBytes {
    double input, weight, both;
  };
  /// `fp8` (training.fp8): each matmul also holds the output gradient's cast (its fp8 copy) and
  /// the cast of its other operand being made (kernels::fp8::cast_bytes).
  static BackwardBytes backward_bytes(double tokens, double in_local, double out, double w, bool sp,
                                      const MatmulBytes& matmul, bool fp8 = false) {
    const auto t = static_cast<int64_t>(tokens), i = static_cast<int64_t>(in_local),
               o = static_cast<int64_t>(out);
    const double gathered = sp ? w * tokens * out : 0.0;
    const double g8 = fp8 ? tokens * out : 0.0;
    const double input = matmul_bytes(matmul, t, o, i, false, w) + g8 +
                         (fp8 ? kernels::fp8::cast_bytes(out * in_local, w) : 0.0);
    const double weight = matmul_bytes(matmul, o, t, i, true, w) + g8 +
                          (fp8 ? kernels::fp8::cast_bytes(tokens * in_local, w) : 0.0);
    return {input + gathered, weight, std::max(input, w * tokens * in_local + weight) + gathered};
  }

 private:
  Group* tp_;
  bool sp_;
  kernels::fp8::Spec fp8_;
};
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module, public Placed {
 public:
  VocabParallelEmbeddingImpl(Group& tp, int64_t vocab, int64_t dim, bool sequence_parallel);
  torch::Tensor forward(const torch::Tensor& tokens);
  torch::Tensor weight;  // [Vp/t, dim]: global rows [vocab_start, vocab_start + Vp/t)
  int64_t vocab_start() const { return start_; }
  Shard weight_shard() const { return {0, tp_->size(), tp_->rank()}; }
  /// weight split along the (padded) vocabulary.
  std::vector<std::pair<std::string, Placement>> placements() const override;

 private:
  Group* tp_;
  bool sp_;
  int64_t start_, rows_, vocab_;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Per-token cross-entropy [N] from this rank's vocabulary slice of the logits [N, Vp/t]
/// (columns [vocab_start, vocab_start + Vp/t) of the padded vocabulary) and targets [N] (global
/// ids < vocab). Columns at or past `vocab` are padding and never count. The full vocabulary's
/// logits are never gathered: only [N]-sized maxima and sums cross the group.
/// What both cross-entropies (above, and parallel/tp/head_loss.h) take from this rank's logits
/// [N, V/t] (any float dtype): `logp` [N, V/t], the fp32 log-softmax over this rank's columns
/// (padding columns -inf), made in one fused pass; `shift` [N], this slice's log-sum-exp less the
/// whole vocabulary's (log p = logp + shift; empty with one rank); `loss` [N], -log p(target), the
/// same on every rank; where this rank holds the target ([N, 1] local column, [N] mask). Three
/// [N]-sized all-reduces with several ranks, none with one. `overwrite`: the logits are the
/// caller's to overwrite (fp32 ones then become the log-softmax with no copy).
struct LogSoftmax {
  torch::Tensor logp, shift, loss, local_target, mine;
};
LogSoftmax vocab_parallel_log_softmax(Group& tp, const torch::Tensor& logits,
                                      const torch::Tensor& targets, int64_t vocab_start,
                                      int64_t vocab, bool overwrite = false);
/// softmax - one-hot target, times `scale` per row ([N]; undefined: 1), in `dtype` (padding
/// columns 0). Consumes `s.logp`: the gradient is made in its buffer, which is returned when the
/// dtype is fp32.
torch::Tensor softmax_minus_target(LogSoftmax& s, const torch::Tensor& scale,
                                   torch::ScalarType dtype);

torch::Tensor vocab_parallel_cross_entropy(Group& tp, const torch::Tensor& logits,
                                           const torch::Tensor& targets, int64_t vocab_start,
                                           int64_t vocab);

}  // namespace tessel::parallel::tp
