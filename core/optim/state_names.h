// The names the optimizer's state takes in checkpoints (safetensors keys beside the model's own
// global parameter names), declared once: the checkpoint writer and reader, the loss scaler,
// exports and weight loading all spell them from here.
#pragma once

#include <array>
#include <string>

namespace tessel::optim {

/// Every optimizer entry starts with this; anything else in a checkpoint is a model weight.
inline const std::string kStatePrefix = "optim.";
/// Per parameter, followed by its global name, in FlatAdamW::load_slot's kind order: the fp32
/// master weights (0), AdamW's first (1) and second (2) moments.
inline const std::array<std::string, 3> kSlotPrefixes = {"optim.master.", "optim.exp_avg.",
                                                         "optim.exp_avg_sq."};
inline const std::string kStepName = "optim.step";  // AdamW's step count (a scalar)
// fp16 dynamic loss scaling (core/optim/loss_scale.h).
inline const std::string kLossScaleName = "optim.loss_scale";
inline const std::string kGrowthTrackerName = "optim.loss_scale_growth_tracker";
inline const std::string kSkippedStepsName = "optim.skipped_steps";

inline bool is_optimizer_state(const std::string& name) { return name.rfind(kStatePrefix, 0) == 0; }

}  // namespace tessel::optim
