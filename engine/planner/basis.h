// The planner's estimates share these (planner.cpp: memory and time; traffic.cpp: each group's
// bytes per step): what every stage's estimate uses, computed once per plan.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/plan/config.h"
#include "engine/planner/documents.h"
#include "engine/planner/planner.h"
#include "models/layers.h"
#include "models/shape.h"
#include "parallel/cp/bytes.h"
#include "parallel/dp/grad_reducer.h"
#include "parallel/mesh.h"
#include "parallel/pp/schedule.h"

namespace tessel::planner {

// Activation bytes per token per transformer block, in elements of the compute dtype, as this
// implementation's autograd keeps them: `replicated`·h (the residual stream, norms' inputs and
// outputs: divided by tp only under sequence parallelism) + (`attn`·h + `kv`·kv_dim +
// `ffn`·ffn_hidden) / tp. `outside`·h per token for the embedding output and the final norm. Each
// figure is a part's own declaration (models/layers.h, models/mlp.h: activation_model adds them),
// measured there on CPU fp32 with the counting allocator (core/observe/counters.h) from single-
// process and tp=2 runs; the other layouts (sp, cp, pp, ZeRO) are predictions that the parity
// table's rows check (tests/dist/parity.py check_planner).
struct ActivationModel {
  double replicated, attn, kv, ffn, outside;
};

struct PlanBasis {
  models::ModelShape m;
  models::DecoderOptions parts;  // the parts m's architecture builds (models::features)
  c10::ScalarType dtype;
  double w;                // bytes per element of the compute dtype
  bool sp;                 // sequence parallelism in effect
  int64_t mbs;             // micro-batches per step
  int64_t lanes;           // micro-batches at once without pipelining (2: pairs_microbatches)
  int64_t threads;         // threads a rank computes with
  double tok;              // tokens of one micro-batch on one rank (cp splits the sequence)
  double h, tp, kvd;       // hidden size, tensor-parallel size, keys' (and values') width
  double vocab_local;      // the head's rows on one tp rank
  bool cpu;                // the plan runs on CPUs (else GPUs)
  bool own_kernels;        // Tessel's fused CPU kernels run (activation_model)
  bool fp8 = false;        // training.fp8: the blocks' linear layers in float8 (their casts)
  double short_attention;  // bytes per token its short-sequence attention holds in a block
  ActivationModel a;
  parallel::pp::Simulation sim;  // the plan's pipeline schedule (gpipe when pp = 1)
  double per_layer;              // one micro-batch's saved activations in one block, bytes
  double act_row;                // one activation between stages, bytes
  plan::Sharding sharding;       // what ZeRO shards (parallel.zero)
  int64_t data_ranks, pp;
  // ZeRO's split (plan::zero_split): the ranks a bucket is sharded over (the experts' too) and
  // the shard groups holding the same pieces (hybrid sharding; 1 otherwise).
  plan::ZeroSplit split;
  bool keep_gathered;        // ZeRO-3: units gathered once per step (parallel.zero3.keep_gathered)
  double block;              // one layer's parameters on one tp rank
  double per_moe_layer = 0;  // per_layer for an MoE layer (its experts instead of the MLP)
  DocumentFigures docs;      // data.document_mask: attention kept, documents per sample
};

struct Traffic {  // one group's bytes on one rank per step, by how a ring moves them
  double all_reduce = 0, gather_scatter = 0, p2p = 0;
  double replica = 0;  // hybrid sharding: all-reduced over the replicas, not the shard group
  double ops = 0;      // collectives and transfers issued (each pays the profile's latency)
  double bytes() const { return all_reduce + gather_scatter + p2p + replica; }
  // Seconds those bytes but `replica` take: at the link's `gbps`, or the profile's own figure
  // for all-gathers and reduce-scatters, and for send/receive, where it has one.
  double wire(int64_t n, double gbps, const DeviceProfile& d) const {
    const double f = n > 1 ? static_cast<double>(n - 1) / static_cast<double>(n) : 0.0;
    auto at = [gbps](double rate) { return (rate > 0 ? rate : gbps) * 1e9; };
    return 2 * f * all_reduce / at(0) + f * gather_scatter / at(d.gather_gbps) +
           p2p / at(d.p2p_gbps);
  }
};

// MoE layers among a stage's chunks.
int64_t moe_layers_in(const models::ModelShape& m, const models::StagePart& part);
// The expert parameters a rank of the stage holds (E/ep experts of each MoE layer).
double expert_params(const models::ModelShape& m, const models::StagePart& part, int64_t ep);
// Ranks of one all-to-all of context parallelism: cp (alltoall), the group size (hybrid), else 1.
int64_t alltoall_ranks(const plan::Config& c, const plan::Layout& l);
// One rank's attention in one layer and micro-batch, as the cp methods declare their bytes for.
parallel::cp::AttentionSize attention_size(const plan::Config& c, const plan::Layout& l,
                                           const PlanBasis& b);
// ZeRO-2 inside a pipeline, or ZeRO-3 kept gathered, with fp32 weights: micro-batches accumulate
// in the parameters and each chunk reduce-scatters once per step (parallel/dp/grad_reducer.h).
inline bool reduce_once(const PlanBasis& b) {
  return parallel::dp::reduces_once(b.sharding, b.pp, b.keep_gathered,
                                    b.dtype != c10::ScalarType::Float);
}

// Activation bytes per token per block (ActivationModel) as this implementation keeps them, by
// architecture, recomputation and kernels (memory.cpp).
ActivationModel activation_model(const models::DecoderOptions& o, plan::Recompute recompute,
                                 bool own_kernels, bool cpu, double w);
// Sequence parallelism's all-gathered inputs the projections save, per token, in elements, above
// the activation model (memory.cpp).
double sp_gathered_floats(plan::Recompute recompute, double h, double tp, bool sp);
// ZeRO-3 without kept units inside a pipeline, the rank's units played over its timeline
// (gathers.cpp): `held`, the bytes gathered at each slot's peak; `gathers`, how often each unit
// (kRoot, or a layer) is gathered in the step. `root`: the root unit's bytes.
struct UnitReplay {
  static constexpr int64_t kRoot = std::numeric_limits<int64_t>::min();
  std::vector<double> held;
  std::map<int64_t, double> gathers;
};
UnitReplay replay_units(const std::vector<parallel::pp::Simulation::Slot>& timeline,
                        const PlanBasis& b, const plan::Layout& l, const models::StagePart& part,
                        double root);
// The stage's parameters outside its blocks (the root unit's), on one rank.
double root_parameters(const PlanBasis& b, const plan::Layout& l, const models::StagePart& part);
// ZeRO-3 without kept units inside a pipeline: how often pipeline rank `stage` gathers its root
// unit and each of its blocks (by layer) in a step, as parallel/dp/zero3.h plays over the rank's
// schedule (memory.cpp).
struct ZeroGathers {
  double root = 0;
  std::map<int64_t, double> blocks;
};
ZeroGathers zero3_gathers(const plan::Layout& l, const PlanBasis& b, int64_t stage,
                          const models::StagePart& part);
// One stage's bytes: its parameters' state between steps and what a step adds at its peak
// (memory.cpp).
RankEstimate stage_memory(const plan::Config& c, const plan::Layout& l, const PlanBasis& b,
                          int64_t stage, const models::StagePart& part);

// Communication per step of one rank of a stage: the collectives this implementation issues, by
// group (comm.h's byte count).
std::map<std::string, Traffic> stage_traffic(const plan::Config& c, const plan::Layout& l,
                                             const PlanBasis& b, const RankEstimate& r,
                                             const models::StagePart& part);

}  // namespace tessel::planner
