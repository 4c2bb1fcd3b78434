// AdamW over flat buffers laid out by optim::FlatLayout (global names, reverse
// registration order, buckets; under ZeRO each bucket padded and split into one piece per data
// rank). What each rank holds, by ZeRO stage (N: the flat buffer; S: this rank's shard, N/dp):
//   stage     model weights      gradients (fp32)      master (fp32)        AdamW moments
//   0         [N]                [N]                   [N] (fp32: = weights) [N] x2
//   1         [N]                [N], reduce-scattered  [S] (fp32: pieces of the weights) [S] x2
//   2         [N]                [S] (+ one bucket in flight)  as 1         [S] x2
//   3         [S] (+ gathered units)  [S]              [S] (fp32: = weights) [S] x2
// bf16/fp16 runs keep the model's weights (and, at stages 0-1, per-micro-batch gradients) in the
// low-precision dtype; gradients accumulate in fp32 and the fp32 master is rounded into the
// weights after each step. One fused AdamW call per weight-decay group runs over views of this
// rank's pieces of each parameter.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/optim/flat_layout.h"
#include "core/plan/config.h"

namespace tessel::optim {

/// Learning rate at optimizer step `step` (1-based): linear warmup lr·step/warmup, then cosine,
/// linear or constant from lr (at step = warmup) to min_lr (at the last step).
double lr_at(const plan::TrainingConfig& t, int64_t step);

/// Whether a parameter is exempt from weight decay (its name matches a no_decay glob).
bool exempt_from_decay(const std::string& name, const std::vector<std::string>& globs);

/// A parameter handed to the optimizer, by global name, in the model's registration order: the
/// tensor (re-seated as a view of the flat buffers), the pipeline chunk whose backward produces
/// its gradient, and how many model-parallel ranks hold the same values (the global norm counts
/// them once). models::named_params gives a model's.
struct NamedParam {
  std::string name;
  torch::Tensor tensor;
  int64_t chunk = 0, replicas = 1;
  bool expert = false;  // an MoE layer's experts (reduced over the expert data group)
};

/// The flat layout of parameters given in registration order: reversed, roughly the order backward
/// produces gradients in, so that gradient buckets (contiguous ranges) fill one after another.
optim::FlatLayout layout_of(std::vector<optim::ParamEntry> registered,
                            const optim::LayoutOptions& o);
optim::FlatLayout layout_of(const std::vector<NamedParam>& params, const optim::LayoutOptions& o);
/// The plan's layout options for a rank: buckets of parallel.ddp.bucket_mb, ZeRO over the data
/// group (`data_ranks`, this rank `data_rank`) and the experts' over the expert data group, the
/// tied token table in a bucket of its own where a pipeline holds it twice under ZeRO.
optim::LayoutOptions layout_options(const plan::Config& c, int64_t data_ranks, int64_t data_rank,
                                    int64_t expert_ranks, int64_t expert_rank, int64_t pp);

/// This rank's part of one parameter's optimizer state: `numel` elements starting at element
/// `param_offset` of the flattened (tensor-parallel local) parameter. 1-D views.
struct StatePiece {
  std::string name;
  int64_t param_offset, numel;
  torch::Tensor weight, master, exp_avg, exp_avg_sq;  // weight: model dtype (ZeRO-3: the shard)
};

/// Bytes this rank keeps for the run, by kind (persistent buffers; ZeRO-3's gathered units and
/// ZeRO-2/3's in-flight gradient buckets are counted by parallel::dp).
struct StateBytes {
  int64_t params = 0, grads = 0, optimizer = 0;
};

/// What FlatAdamW will keep for `numel` parameters (the table above), from the plan alone, for
/// `--dry-run`: the alignment padding (under optim::kAlignElements per parameter, and per piece of
/// each bucket) is left out.
StateBytes planned_state_bytes(int64_t numel, const plan::Sharding& sharding, int64_t data_ranks,
                               torch::ScalarType dtype);

class FlatAdamW {
 public:
  /// Takes over `params` (already on their device and in the run's dtype): they become views of
  /// the flat weight buffer (ZeRO-3: of their unit's gather buffer).
  FlatAdamW(const std::vector<NamedParam>& params, const plan::TrainingConfig& t,
            optim::FlatLayout layout);
  /// One process, no ZeRO, one bucket.
  FlatAdamW(const std::vector<NamedParam>& params, const plan::TrainingConfig& t);

  /// Stages 0-1, bf16/fp16: adds a micro-batch's gradient of `slot`'s parameter (its .grad, in
  /// the model's dtype) into the fp32 gradient and drops it (`grad` left undefined), as
  /// Megatron's main_grad: the gradient is held once, in fp32 (4 bytes per parameter, not 6).
  void fold_grad(const optim::Slot& slot, torch::Tensor& grad);
  /// Global L2 norm of this rank's reduced gradient (before clipping), clipped to max_norm in
  /// place when > 0. `sum_over_shards` sums the squared norm over ranks that hold other parts;
  /// `unscale` (fp16) multiplies the gradient first. Returns a device scalar: no host sync.
  torch::Tensor clip_grad_norm(double max_norm,
                               const std::function<void(torch::Tensor&)>& sum_over_shards = {},
                               const torch::Tensor& unscale = {});
  /// One AdamW step at learning rate `lr`, then clears the gradients. `found_inf` (fp32 scalar
  /// on the device, 0 or 1): 1 skips the update and the step count, without a host sync.
  void step(double lr, const torch::Tensor& found_inf = {});
  /// The same with the learning rate in a scalar tensor: read on the host when it is a CPU tensor
  /// (the double path above, bitwise); on CUDA a float32 device scalar the fused kernel reads,
  /// so that a captured step (training.cuda_graph) takes each step's rate from it.
  void step(const torch::Tensor& lr, const torch::Tensor& found_inf = {});

  /// Resume, one tensor at a time: this rank's (tensor-parallel local) slice of parameter
  /// `name`'s master weights (kind 0), first moment (1) or second moment (2), any shape with the
  /// parameter's element count; copied into this rank's pieces at once.
  void load_slot(int kind, const std::string& name, const torch::Tensor& local,
                 const std::string& source);
  /// After every load_slot: checks that each parameter got all three, sets the step count and
  /// refreshes the weights.
  void finish_load(const torch::Tensor& step, const std::string& source);

  const optim::FlatLayout& layout() const { return layout_; }
  const plan::Sharding& sharding() const { return layout_.sharding(); }
  int64_t numel() const;  // parameters of this rank's model (tensor-parallel local), no padding
  /// This rank's pieces of every parameter (the whole parameter without ZeRO), in slot order.
  const std::vector<StatePiece>& pieces() const { return pieces_; }
  /// The parts of `slot`'s reduced gradient this rank holds (for sums over tp or the embedding
  /// group, which must happen on the reduced gradient).
  std::vector<torch::Tensor> grad_views(const optim::Slot& slot) const;
  /// This rank's whole piece of `slot`'s bucket of the reduced gradient, alignment padding (zeros)
  /// included: for a slot alone in its bucket (the tied token table under ZeRO with pipelining),
  /// the same element count on every rank of the data group.
  torch::Tensor grad_bucket_piece(const optim::Slot& slot) const;
  torch::Tensor step_count() const { return step_count_; }
  StateBytes bytes() const;
  /// Of bytes(), what the alignment padding (optim::kAlignElements) adds: bytes() less what
  /// planned_state_bytes gives for this rank's parameters without it (the experts' over their own
  /// data group), which --dry-run predicts from the plan alone.
  StateBytes alignment_padding() const;
  /// An upper bound on alignment_padding(), any part: every slot adds under kAlignElements to
  /// each buffer, every bucket under kAlignElements per shard rank, at most 12 bytes an element.
  int64_t alignment_padding_bound() const;

  // Buffers for parallel::dp (undefined where the stage does not keep them).
  torch::Tensor weights() const { return params_; }         // [N] model dtype, stages 0-2
  torch::Tensor grad() const { return grad_; }              // [N] fp32, stages 0-1
  torch::Tensor grad_shard() const { return grad_shard_; }  // [S] fp32, stages 2-3
  torch::Tensor master_shard() const { return master_; }    // [S] fp32 (stage 0: [N])
  torch::Tensor weight_shard() const { return shard16_; }   // [S] model dtype, stage 3 bf16/fp16
  const std::vector<torch::Tensor>& unit_buffers() const { return units_; }  // stage 3, per bucket
  bool low_precision() const { return low_precision_; }
  bool master_is_weights() const { return !master_.defined(); }

 private:
  torch::Tensor master_view(const optim::Piece& p) const;
  torch::Tensor grad_view(const optim::Piece& p) const;
  void refresh_weights();  // low-precision weights (or the stage-3 weight shard) from the master
  // Construction steps, in order.
  void allocate_buffers(const torch::Tensor& front);  // front: dtype and device of the params
  void seat_param(const optim::Slot& slot, torch::Tensor p);
  void add_piece(const std::string& name, const optim::Piece& piece, const torch::Tensor& values,
                 bool decay);
  std::vector<int64_t> build_grad_pieces();  // returns each piece's offset in shard coordinates
  void build_replicated_spans(const std::map<std::string, const NamedParam*>& params,
                              const std::vector<int64_t>& at);

  plan::TrainingConfig t_;
  optim::FlatLayout layout_;
  bool low_precision_;
  torch::ScalarType dtype_ = torch::kFloat32;  // the model's (the weights') dtype
  torch::Tensor params_, grad_, grad_shard_, master_, shard16_;
  torch::Tensor exp_avg_, exp_avg_sq_, step_count_;
  std::vector<torch::Tensor> units_;
  std::vector<StatePiece> pieces_;
  std::vector<torch::Tensor> grad_pieces_;  // the reduced gradient this rank holds
  std::map<std::string, int> loaded_;       // resume: which of the three each slot got (bits)
  // Views of it that belong to parameters replicated over r tensor-parallel ranks, grouped by
  // 1 - 1/r: their squares count 1/r in the global norm, so that much is taken off again.
  std::vector<std::pair<double, std::vector<torch::Tensor>>> replicated_spans_;
  struct DecayGroup {
    bool decay;
    std::vector<torch::Tensor> w, g, m, v, steps;  // views of the flat buffers, per piece
  };
  std::vector<DecayGroup> groups_;
};

}  // namespace tessel::optim
