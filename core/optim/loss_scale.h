// fp16 dynamic loss scaling (the rules of torch.amp.GradScaler) and the non-finite guard of
// every dtype. Each step's found_inf flag comes from the global gradient norm (already summed
// over every rank, so all ranks agree) and stays on the device: AdamW skips the update when it
// is set, without a host sync. fp16 then backs its scale off and counts the skipped step; other
// dtypes remember the first non-finite step, and the trainer stops at its next host sync (a log
// line or a checkpoint) naming it, before anything of that step is saved.
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/config.h"

namespace tessel::optim {

class LossScaler {
 public:
  LossScaler(const plan::TrainingConfig& t, const torch::Device& device);
  bool dynamic() const { return dynamic_; }  // fp16
  /// What the loss is multiplied by before backward (fp32 device scalar; 1 without fp16).
  const torch::Tensor& scale() const { return scale_; }
  /// What the gradients are multiplied by before clipping (undefined without fp16).
  torch::Tensor unscale() const { return dynamic_ ? scale_.reciprocal() : torch::Tensor(); }
  /// After the gradient norm of step `step` (an int64 scalar on the scale's device, so that a
  /// captured step reads it there: training.cuda_graph): returns found_inf (fp32 0/1 device
  /// scalar) and updates the scale (fp16) or the first non-finite step (others).
  torch::Tensor update(const torch::Tensor& grad_norm, const torch::Tensor& step);

  // Host reads (log and checkpoint steps only).
  double scale_value() const;
  int64_t skipped_steps() const;
  int64_t first_non_finite_step() const;  // 0: none

  /// State that a resumed fp16 run needs to continue bitwise: scale, growth tracker, skipped.
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  void load_state(const std::map<std::string, torch::Tensor>& by_name);

 private:
  plan::TrainingConfig t_;
  bool dynamic_;
  torch::Tensor scale_, growth_tracker_, skipped_, bad_step_;
};

}  // namespace tessel::optim
