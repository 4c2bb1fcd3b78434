// A block's feed-forward form: what runs between its column-parallel projections (up, and a gated
// form's gate) and down, declared with what the planner and --dry-run's CPU profile need of it.
// Each form is one file (models/mlp_*.cpp) and one case of mlp_form (mlp.cpp); its value in
// plan::Mlp (core/plan/choices.h) is the plan's model.mlp and what a model's features name
// (models/registry.h: DecoderOptions::mlp). Nothing in engine/ names a form: the planner asks the
// form of the plan's model.
#pragma once

#include <torch/types.h>

#include "core/plan/choices.h"
#include "parallel/tp/layers.h"

namespace tessel::models {

class MlpForm {
 public:
  virtual ~MlpForm() = default;
  /// Whether it has a gate projection beside up: its column-parallel hidden x ffn matrices are
  /// then two (each keeps an ffn-wide output whose gradient its weight's gradient reads).
  virtual bool gated() const = 0;
  /// down's input from `x`, the block's input entered into the tensor-parallel region
  /// (tp::enter): the projections and the activation, by Tessel's CPU kernels where they apply
  /// (`own_kernels`) or LibTorch's.
  virtual torch::Tensor hidden(const torch::Tensor& x, parallel::tp::ColumnParallelLinearImpl& up,
                               parallel::tp::ColumnParallelLinearImpl* gate,
                               bool own_kernels) const = 0;
  /// Elements its forward keeps for backward per token and unit of this rank's ffn width (the
  /// ffn term of the planner's activation model), with Tessel's kernels or LibTorch's; measured
  /// with the counting allocator (core/observe/counters.h), the date and machine beside each.
  virtual double kept_per_ffn(bool own_kernels) const = 0;
  /// Elements per token and unit of ffn width its activation's backward holds at once beyond
  /// what down's backward holds (the planner's working set): 0 where it is one pass from down's
  /// input gradient to its own result.
  virtual double backward_extra_per_ffn(bool own_kernels) const = 0;
  /// One forward and backward of its activation as the layer runs it, over [rows, ffn] operands:
  /// `up` (and `gate`), `grad` the output's gradient, `bias` up's. What --dry-run's CPU profile
  /// times per element (engine/planner/cpu_profile.cpp).
  virtual void activation_pass(bool own_kernels, const torch::Tensor& up, const torch::Tensor& gate,
                               const torch::Tensor& grad, const torch::Tensor& bias) const = 0;
};

/// The form of `kind` (one instance each, for the program's life); kAuto is the architecture's
/// to resolve (resolved_mlp), never a form.
const MlpForm& mlp_form(plan::Mlp kind);
/// model.mlp as a model builds it: `kind`, or the architecture's own form `arch_default` for auto.
inline plan::Mlp resolved_mlp(plan::Mlp kind, plan::Mlp arch_default) {
  return kind == plan::Mlp::kAuto ? arch_default : kind;
}

// Each form's file defines its instance.
const MlpForm& gelu_tanh_mlp();
const MlpForm& swiglu_mlp();
const MlpForm& relu2_mlp();

}  // namespace tessel::models
