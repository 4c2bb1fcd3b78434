// The parallelize step: from the plan and the mesh to this rank's training state, one call per
// parallelism in the order they apply. The model holds this rank's part (tensor-parallel shards,
// its pipeline stages, context-parallel attention, its experts; recomputation as the plan says);
// the optimizer's flat buffers hold this rank's ZeRO pieces; a resumed run's state is loaded into
// them; the data-parallel synchronisation is attached last (ZeRO-3 frees the whole weights it
// shards). The Trainer runs steps over what this returns; the pipeline's schedule is the
// Trainer's (its executor runs training and evaluation).
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "core/optim/loss_scale.h"
#include "core/optim/optim.h"
#include "core/plan/config.h"
#include "engine/checkpoint/checkpoint.h"
#include "models/registry.h"
#include "parallel/dp/grad_sync.h"
#include "parallel/mesh.h"

namespace tessel::run {

struct TrainState {
  models::Decoder model{nullptr};
  std::unique_ptr<optim::FlatAdamW> opt;
  std::unique_ptr<optim::LossScaler> scaler;
  std::unique_ptr<parallel::dp::GradSync> sync;
  // Views of the reduced gradient this rank holds (its ZeRO pieces): parameters whose gradient
  // is summed over tp, and a tied token table on the first or last stage (summed over both).
  std::vector<torch::Tensor> tp_summed_grads, embedding_grads;
  std::string resumed_from;                   // the checkpoint folder; empty when starting afresh
  checkpoint::CheckpointState resumed{0, 0};  // its step and data position
};

TrainState parallelize(const plan::Config& c, parallel::Mesh& mesh, const torch::Device& device,
                       torch::ScalarType dtype);

}  // namespace tessel::run
