// Data parallelism's one seam with the training step: DDP, ZeRO-1/2 and ZeRO-3 (each over the data
// group, an MoE layer's experts over the expert data group) behind one interface, which the
// Trainer calls in the order of a step without knowing the stage:
//   begin_step -> forward/backward (block_hooks; begin/end_backward around each chunk's
//   backward) -> finish_backward -> [clip, vote] -> before_optimizer -> step -> after_optimizer.
// make_grad_sync picks the implementation from parallel.zero; each owns its GradReducer (the
// gradients) and, for ZeRO-1/2, the WeightGather that rebuilds the weights from the updated
// pieces, or, for ZeRO-3, the UnitGatherer that gathers each unit where it is used.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/block_hooks.h"
#include "parallel/dp/grad_reducer.h"
#include "parallel/dp/zero3.h"

namespace tessel::parallel::dp {

class GradSync {
 public:
  virtual ~GradSync() = default;
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  /// What the model's blocks call around their forward and backward (ZeRO-1/2: wait for the
  /// unit's weights; ZeRO-3: gather and free them); null for DDP.
  virtual BlockHooks* block_hooks() { return nullptr; }
  /// Before the step's first forward (ZeRO-1/2: the gathers of the whole weights from the last
  /// update's pieces start, each waited for by the forward that uses it).
  virtual void begin_step() {}
  /// Around each backward of pipeline chunk `chunk`; `final`: its last of the step.
  void begin_backward(int64_t chunk, bool final) { reducer_->begin_backward(chunk, final); }
  void end_backward(int64_t chunk, bool final) { reducer_->end_backward(chunk, final); }
  /// After the step's last backward: every reduction has landed in the optimizer's gradient.
  void finish_backward() { reducer_->finish(); }
  /// Before the optimizer step (ZeRO-1/2: every gather has landed: the step overwrites the
  /// pieces they read).
  virtual void before_optimizer() {}
  /// After the optimizer step (ZeRO-1/2: the weights are due from the new pieces; ZeRO-3: the
  /// units kept gathered are freed).
  virtual void after_optimizer() {}
  /// The whole weights readable on this rank (before evaluation, a checkpoint, the end).
  virtual void weights_ready() {}
  /// A step left half-run by a failed CUDA graph capture: nothing of it is waited for.
  void abandon_step() { reducer_->abandon_step(); }
  /// Milliseconds this rank waited on the data group's communication since the last call.
  virtual double take_wait_ms() { return reducer_->take_wait_ms(); }

  /// The factor of this rank's squared gradients in the global norm's sum over every rank. DDP:
  /// data ranks hold equal gradients, so data rank 0 adds its squares and the others none (with
  /// expert parallelism each adds its own: the optimizer counts each parameter's replicas). ZeRO:
  /// each rank holds its own pieces and adds them; under hybrid sharding each shard group holds
  /// all of them, so each of a piece's R replicas adds 1/R (in fp64).
  double norm_share() const { return norm_share_; }

  const GradReducer& reducer() const { return *reducer_; }
  /// ZeRO-3's gatherer (its unit sizes and gathered peak, for the report); null otherwise.
  virtual const UnitGatherer* unit_gatherer() const { return nullptr; }

 protected:
  GradSync() = default;
  std::unique_ptr<GradReducer> reducer_;
  double norm_share_ = 1;
};

/// The data-parallel synchronisation for `params` (those `opt` took over) of the ZeRO stage its
/// flat layout shards by (optim::FlatAdamW::sharding). `keep_gathered`:
/// parallel.zero3.keep_gathered. `device_timed`: ZeRO-1/2 time their gathers' waits with device
/// events (core/observe/timing.h).
std::unique_ptr<GradSync> make_grad_sync(Mesh& mesh, const std::vector<optim::NamedParam>& params,
                                         optim::FlatAdamW& opt, bool keep_gathered,
                                         bool device_timed);

}  // namespace tessel::parallel::dp
