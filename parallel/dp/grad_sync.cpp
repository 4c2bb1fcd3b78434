#include "parallel/dp/grad_sync.h"

#include "parallel/dp/weight_gather.h"

namespace tessel::parallel::dp {
namespace {

// ZeRO: each rank adds the squares of its own pieces; under hybrid sharding each of a piece's R
// replicas (the shard groups) adds 1/R.
double piece_share(const Mesh& mesh) {
  const auto* replicas = mesh.zero_replicas(false);
  return replicas ? 1.0 / static_cast<double>(replicas->size()) : 1.0;
}

// DDP: the reducer alone (buckets all-reduced as backward completes them).
class Ddp final : public GradSync {
 public:
  Ddp(Mesh& mesh, const std::vector<optim::NamedParam>& params, optim::FlatAdamW& opt) {
    reducer_ = std::make_unique<GradReducer>(mesh, params, opt);
    norm_share_ = mesh.layout().ep > 1 || mesh.dp_cp().rank() == 0 ? 1.0 : 0.0;
  }
};

// (Under hybrid sharding every ZeRO collective runs over this rank's shard group:
// Mesh::zero_shards.) ZeRO-1/2: gradients reduce-scattered into this rank's pieces; after the
// update each rank's piece of the weights is gathered back, from the next step's start, unit by
// unit.
class WeightPieces final : public GradSync {
 public:
  WeightPieces(Mesh& mesh, const std::vector<optim::NamedParam>& params, optim::FlatAdamW& opt,
               bool device_timed)
      : wait_(device_timed) {
    reducer_ = std::make_unique<GradReducer>(mesh, params, opt);
    norm_share_ = piece_share(mesh);
    weights_ =
        std::make_unique<WeightGather>(mesh.zero_shards(false), mesh.zero_shards(true), opt, wait_);
  }
  BlockHooks* block_hooks() override { return weights_.get(); }
  void begin_step() override { weights_->start_all(); }
  void before_optimizer() override { weights_->wait_all(); }
  void after_optimizer() override { weights_->updated(); }
  void weights_ready() override { weights_->wait_all(); }
  double take_wait_ms() override { return reducer_->take_wait_ms() + wait_.take_ms(); }

 private:
  observe::SpanTimer wait_;  // the forward's waits for its units' gathers
  std::unique_ptr<WeightGather> weights_;
};

// ZeRO-3: each unit's weights gathered where it is used (and freed after, unless kept for the
// step); a unit's gradients reduce-scattered once its bucket is complete.
class Units final : public GradSync {
 public:
  Units(Mesh& mesh, const std::vector<optim::NamedParam>& params, optim::FlatAdamW& opt,
        bool keep) {
    reducer_ = std::make_unique<GradReducer>(mesh, params, opt, keep);
    norm_share_ = piece_share(mesh);
    units_ = std::make_unique<UnitGatherer>(mesh.zero_shards(false).side(),
                                            mesh.zero_shards(true).side(), opt, keep);
    reducer_->on_bucket_done = [g = units_.get()](size_t b) { g->bucket_done(b); };
  }
  BlockHooks* block_hooks() override { return units_.get(); }
  void after_optimizer() override { units_->release_all(); }
  double take_wait_ms() override { return reducer_->take_wait_ms() + units_->take_wait_ms(); }
  const UnitGatherer* unit_gatherer() const override { return units_.get(); }

 private:
  std::unique_ptr<UnitGatherer> units_;
};

}  // namespace

std::unique_ptr<GradSync> make_grad_sync(Mesh& mesh, const std::vector<optim::NamedParam>& params,
                                         optim::FlatAdamW& opt, bool keep_gathered,
                                         bool device_timed) {
  const auto& z = opt.sharding();
  if (z.weights) return std::make_unique<Units>(mesh, params, opt, keep_gathered);
  if (z.state) return std::make_unique<WeightPieces>(mesh, params, opt, device_timed);
  return std::make_unique<Ddp>(mesh, params, opt);
}

}  // namespace tessel::parallel::dp
