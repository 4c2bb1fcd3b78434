// What a model's own layers need around each training step, apart from forward and backward:
// for mixture-of-experts layers (models/moe.h) the balance loss's gradient scale and fresh
// statistics before the step, the expert-choice bias update after it (model.moe.bias_update_rate)
// and the logged figures. The Trainer calls these three at their places in every step and knows
// nothing of what a model does in them; a model with none of these layers makes no ModelStep.
#pragma once

#include <torch/types.h>

#include <memory>

#include "core/observe/metrics.h"
#include "core/optim/loss_scale.h"
#include "core/plan/config.h"
#include "models/layers.h"
#include "parallel/mesh.h"

namespace tessel::run {

class ModelStep {
 public:
  /// Null when `model` has no layer that needs a step's hooks.
  static std::unique_ptr<ModelStep> make(const plan::Config& c, models::Decoder model,
                                         const parallel::Mesh& mesh, const torch::Device& device);
  /// Before the step's forwards: `scale` is the loss rule's factor (1 / scored tokens); under a
  /// dynamic fp16 scale the balance loss's gradient is scaled as the main loss's is.
  void begin(double scale, const optim::LossScaler& scaler);
  /// After the optimizer's update (the step's backward is done).
  void after_update();
  /// The logged step's figures over every rank (a world all-reduce: every rank calls it).
  observe::MoeFigures figures() const;

 private:
  ModelStep(const plan::Config& c, models::Decoder model, const parallel::Mesh& mesh,
            const torch::Device& device);
  const plan::Config& c_;
  models::Decoder model_;
  const parallel::Mesh& mesh_;
  torch::Device device_;
};

}  // namespace tessel::run
