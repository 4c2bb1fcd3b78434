#include "engine/run/model_step.h"

#include <algorithm>

#include "models/moe.h"

namespace tessel::run {

std::unique_ptr<ModelStep> ModelStep::make(const plan::Config& c, models::Decoder model,
                                           const parallel::Mesh& mesh,
                                           const torch::Device& device) {
  if (!model->moe_state()) return nullptr;
  return std::unique_ptr<ModelStep>(new ModelStep(c, std::move(model), mesh, device));
}

ModelStep::ModelStep(const plan::Config& c, models::Decoder model, const parallel::Mesh& mesh,
                     const torch::Device& device)
    : c_(c), model_(std::move(model)), mesh_(mesh), device_(device) {}

void ModelStep::begin(double scale, const optim::LossScaler& scaler) {
  auto* moe = model_->moe_state();
  // The balance loss's gradient scale (the loss sum's factor, fp16's scale included), and fresh
  // figures for the step.
  model_->reset_moe_stats();
  moe->seq_len = c_.training.seq_len;
  moe->loss_factor =
      torch::full({}, scale, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
  if (scaler.dynamic()) moe->loss_factor = moe->loss_factor * scaler.scale();
}

void ModelStep::after_update() {
  auto* st = model_->moe_state();
  st->loss_factor.reset();  // the step's backward is done: nothing more is a training forward
  if (c_.model.moe.bias_update_rate == 0) return;
  // Every layer's choices over the global batch (a layer's on its own stage, zeros elsewhere):
  // every rank holding a layer moves its bias alike.
  auto counts = st->counts.clone();
  mesh_.world_group().all_reduce(counts).wait();
  model_->update_moe_bias(counts);
}

observe::MoeFigures ModelStep::figures() const {
  observe::MoeFigures f;
  auto* st = model_->moe_state();
  if (!st->counts.defined()) return f;
  // Each MoE layer lives on one pipeline stage; its choices are counted on every data (and cp,
  // and SP tp) rank, its balance loss once per sequence: sums over the world.
  auto all = torch::cat({st->counts.flatten(), st->aux, st->dropped});
  mesh_.world_group().all_reduce(all).wait();
  all = all.cpu().to(torch::kFloat64);
  const int64_t layers = st->aux.numel(), experts = st->counts.size(1);
  auto counts = all.narrow(0, 0, layers * experts).view({layers, experts});
  const double choices = counts.sum().item<double>();
  const double dropped_all = all.narrow(0, layers * experts + layers, layers).sum().item<double>();
  f.on = true;
  f.aux_loss = all.narrow(0, layers * experts, layers).sum().item<double>() /
               static_cast<double>(c_.training.global_batch);
  auto per_layer = counts.sum(1, true);
  f.load_max = (counts.amax(1, true) * experts / per_layer.clamp_min(1)).max().item<double>();
  f.dropped = dropped_all / std::max(1.0, choices + dropped_all);
  auto total = counts.sum(0);
  f.tokens_per_expert.assign(total.data_ptr<double>(), total.data_ptr<double>() + experts);
  return f;
}

}  // namespace tessel::run
