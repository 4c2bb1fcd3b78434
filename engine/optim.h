// AdamW over flat buffers. Parameters are laid out once, by global name, decay group first:
//   master [N] fp32   the weights AdamW updates (fp32 runs: the model's parameters are views of it)
//   grad   [N] fp32   gradients accumulate here over micro-batches
//   exp_avg, exp_avg_sq [N] fp32
// bf16 runs keep the model's parameters and their per-micro-batch gradients in flat bf16 buffers:
// each micro-batch's bf16 gradient is added into the fp32 `grad` (fp32 accumulation), and after
// the step the fp32 master is copied back into the bf16 weights. Slots are laid out in reverse
// registration order (the order backward fills them, so gradient buckets are contiguous ranges);
// one fused AdamW call per weight-decay group runs over views of the slots; ZeRO will shard the
// same flat buffers.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/config.h"
#include "models/layers.h"

namespace tessel {

/// Learning rate at optimizer step `step` (1-based): linear warmup lr·step/warmup, then cosine,
/// linear or constant from lr (at step = warmup) to min_lr (at the last step).
double lr_at(const TrainingConfig& t, int64_t step);

/// Whether a parameter is exempt from weight decay (its name matches a no_decay glob).
bool exempt_from_decay(const std::string& name, const std::vector<std::string>& globs);

struct ParamSlot {
  std::string name;
  int64_t offset, numel;
  bool decay;
};

class FlatAdamW {
 public:
  /// Takes over `model`'s parameters (already on their device and in the run's dtype).
  FlatAdamW(models::Decoder& model, const TrainingConfig& t);

  /// bf16 only: adds this micro-batch's gradients of the flat range [begin, end) (a gradient
  /// bucket or a pipeline chunk) into the fp32 accumulator and clears them.
  void fold_microbatch(int64_t begin, int64_t end);
  /// Global L2 norm of the gradient (before clipping), clipped to max_norm in place when > 0.
  /// `sum_over_shards` sums the squared norm over ranks that hold other parts of the model.
  /// Returns the norm as a device scalar: no host synchronisation.
  torch::Tensor clip_grad_norm(double max_norm,
                               const std::function<void(torch::Tensor&)>& sum_over_shards = {});
  /// One AdamW step at learning rate `lr`, then clears the gradients.
  void step(double lr);

  /// Restores master weights, moments and the step count by parameter name (a checkpoint), then
  /// refreshes the model's weights from the master copy.
  void load_state(const std::map<std::string, torch::Tensor>& master,
                  const std::map<std::string, torch::Tensor>& exp_avg,
                  const std::map<std::string, torch::Tensor>& exp_avg_sq, const torch::Tensor& step,
                  const std::string& source);

  const std::vector<ParamSlot>& slots() const { return slots_; }
  int64_t numel() const { return n_; }
  torch::Tensor master() const { return master_; }
  torch::Tensor grad() const { return grad_; }
  torch::Tensor exp_avg() const { return exp_avg_; }
  torch::Tensor exp_avg_sq() const { return exp_avg_sq_; }
  torch::Tensor step_count() const { return step_count_; }

 private:
  TrainingConfig t_;
  std::vector<ParamSlot> slots_;
  int64_t n_ = 0;
  bool low_precision_;
  torch::Tensor master_, grad_, exp_avg_, exp_avg_sq_, step_count_;
  torch::Tensor params16_, grads16_;  // bf16 runs only
  torch::Tensor norm_weight_;
  struct DecayGroup {
    bool decay;
    std::vector<torch::Tensor> w, g, m, v, steps;  // views of the flat buffers, per parameter
  };
  std::vector<DecayGroup> groups_;  // 1/replicas per element, when some parameters are replicated
};

}  // namespace tessel
