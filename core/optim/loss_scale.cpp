#include "core/optim/loss_scale.h"

#include <ATen/ops/_amp_update_scale.h>
#include <torch/torch.h>

#include "core/optim/state_names.h"

namespace tessel::optim {

LossScaler::LossScaler(const plan::TrainingConfig& t, const torch::Device& device)
    : t_(t), dynamic_(t.dtype == plan::Dtype::kFp16) {
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  scale_ = torch::full({}, dynamic_ ? t.loss_scale.initial : 1.0, f32);
  growth_tracker_ = torch::zeros({}, f32.dtype(torch::kInt32));
  skipped_ = torch::zeros({}, f32.dtype(torch::kInt64));
  bad_step_ = torch::zeros({}, f32.dtype(torch::kInt64));
}

torch::Tensor LossScaler::update(const torch::Tensor& grad_norm, const torch::Tensor& step) {
  auto found = torch::isfinite(grad_norm).logical_not().to(torch::kFloat32);
  if (dynamic_) {
    const auto& s = t_.loss_scale;
    at::_amp_update_scale_(scale_, growth_tracker_, found, s.growth_factor, s.backoff_factor,
                           s.growth_interval);
    scale_.clamp_min_(s.min_scale);
    skipped_.add_(found.to(torch::kInt64));
  } else {
    bad_step_.copy_(torch::where((found > 0).logical_and(bad_step_ == 0), step, bad_step_));
  }
  return found;
}

double LossScaler::scale_value() const { return scale_.item<double>(); }
int64_t LossScaler::skipped_steps() const { return skipped_.item<int64_t>(); }
int64_t LossScaler::first_non_finite_step() const { return bad_step_.item<int64_t>(); }

std::vector<std::pair<std::string, torch::Tensor>> LossScaler::state() const {
  if (!dynamic_) return {};
  return {{optim::kLossScaleName, scale_},
          {optim::kGrowthTrackerName, growth_tracker_},
          {optim::kSkippedStepsName, skipped_}};
}

void LossScaler::load_state(const std::map<std::string, torch::Tensor>& by_name) {
  if (!dynamic_) return;
  // A checkpoint of another dtype carries no scale: the run starts from the plan's initial one.
  auto take = [&](const std::string& name, torch::Tensor& into) {
    if (auto it = by_name.find(name); it != by_name.end()) into.copy_(it->second);
  };
  take(optim::kLossScaleName, scale_);
  take(optim::kGrowthTrackerName, growth_tracker_);
  take(optim::kSkippedStepsName, skipped_);
}

}  // namespace tessel::optim
