#include "engine/run/parallelize.h"

#include <spdlog/spdlog.h>

#include "core/observe/timing.h"
#include "engine/run/build.h"
#include "models/from_plan.h"

namespace tessel::run {
namespace {

// Data parallelism's flat buffers: ZeRO shards over the data group (dp×cp), an MoE layer's
// experts over the expert data group, or under hybrid sharding over this rank's shard group of
// each; a tied table under pp gets a bucket of its own, so the first and last stage hold the
// same piece of it and can sum its gradient.
std::unique_ptr<optim::FlatAdamW> make_optimizer(const plan::Config& c, parallel::Mesh& mesh,
                                                 std::vector<optim::NamedParam>& params) {
  const auto& l = mesh.layout();
  auto& data_group = mesh.dp_cp();
  auto& experts = mesh.expert_data();  // data_group when ep is 1
  // Under expert parallelism data ranks hold different experts, so every rank adds its squares to
  // the gradient norm: a tensor held by r data ranks counts 1/r on each.
  if (l.ep > 1 && !plan::sharding(c).state)
    for (auto& p : params) p.replicas *= (p.expert ? experts : data_group).size();
  auto& shards = mesh.zero_shards(false);
  auto& expert_shards = mesh.zero_shards(true);
  return std::make_unique<optim::FlatAdamW>(
      params, c.training,
      optim::layout_of(params,
                       optim::layout_options(c, shards.size(), shards.rank(), expert_shards.size(),
                                             expert_shards.rank(), l.pp)));
}

// The gradients summed outside data parallelism after backward: tp-replicated parameters' and a
// tied table's held on two stages (under ZeRO its whole aligned piece, a bucket of its own).
void replicated_grads(const plan::Config& c, const plan::Layout& l, TrainState& s) {
  const bool table_copies = parallel::table_on_two_stages(c, l);
  for (const auto& slot : s.opt->layout().slots()) {
    auto views = slot.name == "embed.weight" && table_copies && plan::sharding(c).state
                     ? std::vector<torch::Tensor>{s.opt->grad_bucket_piece(slot)}
                     : s.opt->grad_views(slot);
    auto& into = slot.name == "embed.weight" ? s.embedding_grads : s.tp_summed_grads;
    if ((slot.name == "embed.weight" && table_copies) ||
        (l.tp > 1 && s.model->specs().at(slot.name).tp_grad_sum))
      into.insert(into.end(), views.begin(), views.end());
  }
}

}  // namespace

TrainState parallelize(const plan::Config& c, parallel::Mesh& mesh, const torch::Device& device,
                       torch::ScalarType dtype) {
  const auto& l = mesh.layout();
  TrainState s;
  // Tensor parallelism, this rank's pipeline stages, context parallelism and its experts: each
  // layer is built holding this rank's part of the same global model.
  s.model = make_model(c, device, dtype, &mesh.group(parallel::GroupKind::kTp),
                       models::stage_part(c, l.pp, mesh.coord().pp),
                       &mesh.group(parallel::GroupKind::kCp), &mesh.ep());
  // Data parallelism's state: the flat optimizer over this rank's pieces, the fp16 loss scale.
  auto params = models::named_params(s.model);
  s.opt = make_optimizer(c, mesh, params);
  s.scaler = std::make_unique<optim::LossScaler>(c.training, device);
  // A resumed run's state, into the pieces this layout holds (whatever layout saved it).
  if (auto dir = checkpoint::checkpoint_to_resume(c); !dir.empty()) {
    s.resumed = checkpoint::load_checkpoint(dir, s.model, *s.opt, s.scaler.get());
    s.resumed_from = dir;
    spdlog::info("resumed from {} (step {}, {} samples consumed)", dir, s.resumed.step,
                 s.resumed.consumed_samples);
  }
  replicated_grads(c, l, s);
  // Data parallelism's synchronisation, last: ZeRO-3 frees the whole weights it shards.
  s.sync = parallel::dp::make_grad_sync(mesh, params, *s.opt, c.parallel.zero3_keep_gathered,
                                        observe::time_on_device(device, mesh.dp_cp().is_nccl()));
  if (auto* hooks = s.sync->block_hooks()) s.model->set_hooks(hooks);
  return s;
}

}  // namespace tessel::run
