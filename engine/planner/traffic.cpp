#include <algorithm>
#include <cmath>
#include <optional>

#include "core/optim/flat_layout.h"
#include "engine/planner/basis.h"
#include "models/registry.h"
#include "parallel/cp/bytes.h"
#include "parallel/dp/bytes.h"

namespace tessel::planner {

int64_t moe_layers_in(const models::ModelShape& m, const models::StagePart& part) {
  int64_t n = 0;
  for (const auto& [first, end] : part.chunks)
    for (int64_t i = first; i < end; ++i) n += m.moe.is_moe(i) ? 1 : 0;
  return n;
}

double expert_params(const models::ModelShape& m, const models::StagePart& part, int64_t ep) {
  return static_cast<double>(models::expert_parameters_on_rank(m, part, ep));
}

// Ranks of one all-to-all of context parallelism: cp (alltoall), the group size (hybrid), else 1.
int64_t alltoall_ranks(const plan::Config& c, const plan::Layout& l) {
  return parallel::cp::alltoall_ranks(c.parallel.context_method, l.cp,
                                      c.parallel.context_alltoall_size);
}

// One rank's attention in one layer and micro-batch (basis.h).
parallel::cp::AttentionSize attention_size(const plan::Config& c, const plan::Layout& l,
                                           const PlanBasis& b) {
  const auto& t = c.training;
  const auto& m = b.m;
  parallel::cp::AttentionSize a;
  a.cp = l.cp;
  a.alltoall = alltoall_ranks(c, l);
  a.sequence = static_cast<double>(t.micro_batch * t.seq_len);
  a.tokens = b.tok;
  a.kv_width = b.kvd / b.tp;
  a.heads = m.heads / l.tp;
  a.kv_heads = std::max<int64_t>(1, m.kv_heads / l.tp);
  a.head_dim = m.head_dim();
  a.elem = b.w;
  a.recompute_full = t.recompute == plan::Recompute::kFull;
  return a;
}

namespace {

// Adds to `g` the MoE balance loss's sums over a group that splits each sequence (tp under SP,
// cp): per MoE layer and micro-batch, two all-reduces of [micro_batch, experts] fp32 (the choices
// and the scores), in every forward, and again where recomputation reruns the layer's forward
// with the loss attached (aux_loss_coef > 0).
void add_aux_loss_traffic(Traffic& g, const plan::Config& c, const PlanBasis& b,
                          double moe_layers) {
  const auto& t = c.training;
  const double reruns = t.recompute != plan::Recompute::kNone && b.m.moe.aux_loss_coef > 0 ? 1 : 0;
  const double sums = static_cast<double>(b.mbs) * moe_layers * 2 * (1 + reruns);
  g.all_reduce += sums * static_cast<double>(t.micro_batch * b.m.moe.experts) * 4;
  g.ops += sums;
}

// training.fp8's amax all-reduces per step on one rank of the stage: its blocks' declarations
// (BlockImpl::fp8_reduces), a recomputation's reruns among them.
models::Fp8Reduces fp8_reduces(const plan::Config& c, const PlanBasis& b,
                               const models::StagePart& part) {
  using models::BlockImpl;
  models::Fp8Reduces f;
  const auto recipe = parallel::tp::fp8_recipe(c.training.fp8);
  if (recipe == kernels::fp8::Recipe::kOff) return f;
  for (const auto& [first, end] : part.chunks)
    for (int64_t i = first; i < end; ++i) {
      f += BlockImpl::fp8_reduces(b.parts, i, b.tok, b.tp, recipe);
      f += BlockImpl::fp8_rerun_reduces(b.parts, i, b.tok, b.tp, recipe, c.training.recompute);
    }
  return f;
}

// Adds `r`, one micro-batch's amax all-reduces over a group, to its traffic for the step.
void add_fp8_traffic(Traffic& g, const kernels::fp8::AxisReduces& r, double micro_batches) {
  g.all_reduce += micro_batches * 4 * (r.forward.elements + r.backward.elements);
  g.ops += micro_batches * (r.forward.calls + r.backward.calls);
}

// Adds tensor parallelism's bytes per step on one rank of the stage to `g`.
void add_tp_traffic(Traffic& g, const plan::Config& c, const plan::Layout& l, const PlanBasis& b,
                    const RankEstimate& r, const models::StagePart& part) {
  const auto& t = c.training;
  const auto& m = b.m;
  const bool sp = b.sp;
  const double mb = static_cast<double>(b.mbs), tok = b.tok, h = b.h, w = b.w, kvd = b.kvd;
  // A tp region (attention, a dense MLP) issues one all-reduce forward and one backward, or under
  // SP an all-gather and a reduce-scatter each way; recomputation reruns the forward's: selective
  // the MLP's, full the whole block's. An MoE layer's experts and router are replicated over tp
  // (they see every token of the rank, or under SP its slice of the sequence): only its shared
  // experts, an MLP split over tp, communicate there. Plus the embedding (first stage) and the
  // head's input (last), and the loss's three [tokens] fp32 all-reduces (the slices' largest
  // log-sum-exp, the sum of their exponentials, the target's loss).
  const double ends = (part.first ? 1 : 0) + (part.last ? 1 : 0);
  const double row = tok * h * w;
  const double u = sp ? 2 : 1;
  const double full = t.recompute == plan::Recompute::kFull ? 1 : 0,
               selective = t.recompute == plan::Recompute::kSelective ? 1 : 0;
  const double layers = static_cast<double>(r.layers);
  const double moe = static_cast<double>(moe_layers_in(m, part));
  const double mlps = layers - moe + (m.moe.shared > 0 ? moe : 0);
  const double per_mb = u * ((2 + full) * layers + (2 + full + selective) * mlps + ends);
  (sp ? g.gather_scatter : g.all_reduce) += mb * per_mb * row;
  g.ops += mb * per_mb;
  if (part.last) g.all_reduce += mb * 3 * tok * 4, g.ops += mb * 3;
  if (sp) add_aux_loss_traffic(g, c, b, moe);
  // Replicated parameters whose gradient each tp rank holds part of: summed once per step.
  double replicated = 0;
  const double experts = sp ? expert_params(m, part, l.ep) : 0.0;
  // Under SP each tp rank sees a slice of the sequence, so its norms, biases, MoE routers and
  // experts, and gpt2's position table (first stage) are among them.
  if (sp)
    replicated +=
        static_cast<double>(models::BlockImpl::replicated_parameters(b.parts, m.hidden)) * layers +
        (part.last ? static_cast<double>(models::NormImpl::parameters(b.parts, m.hidden)) : 0) +
        (part.first && b.parts.learned_pos ? static_cast<double>(m.max_seq_len) * h : 0) + experts +
        moe * static_cast<double>(m.moe.experts) * h;
  if (m.kv_heads < l.tp) replicated += 2 * h * kvd * r.layers;
  // Under ZeRO each data rank sums only the gradients it owns (its shard of the flat buffer, the
  // experts' over their own data group): where the replicated ones fall decides each rank's
  // bytes, 1/data ranks of them on average, which is what this predicts.
  if (b.sharding.state && b.data_ranks > 1)
    replicated = (replicated - experts) / static_cast<double>(b.split.shards) +
                 experts / static_cast<double>(b.split.expert_shards);
  g.all_reduce += 4 * replicated;
  if (replicated > 0) g.ops += 1;
}

// Adds context parallelism's bytes per step to `g`: what the plan's method declares for one
// attention layer and micro-batch (parallel/cp/bytes.h), over the rank's.
void add_cp_traffic(Traffic& g, const plan::Config& c, const plan::Layout& l, const PlanBasis& b,
                    const RankEstimate& r) {
  const auto a = attention_size(c, l, b);
  const auto per = parallel::cp::layer_bytes(c.parallel.context_method, a);
  const double times = static_cast<double>(b.mbs) * static_cast<double>(r.layers);
  g.gather_scatter += times * per.gather_scatter;
  g.p2p += times * per.p2p;
  g.ops += times * per.ops;
}

// Adds the data-parallel (dp×cp) group's bytes per step to `d`: gradients reduced, and under
// ZeRO weights gathered.
// The stage's blocks as ZeRO-3 gathers them over one data group: the parameters of every block
// on this rank (under expert parallelism only the experts', over the experts' data group, and all
// but the experts', over dp×cp), the last block's (its backward follows its forward: not gathered
// again), and how many.
struct Blocks {
  double params = 0, last = 0, count = 0;
  std::map<int64_t, double> by_layer;  // each block's parameters in the group
};
Blocks stage_blocks(const PlanBasis& b, const plan::Layout& l, const models::StagePart& part,
                    bool experts) {
  const auto& m = b.m;
  Blocks k;
  int64_t last = -1;
  for (const auto& [first, end] : part.chunks)
    for (int64_t i = first; i < end; ++i) {
      const double e =
          l.ep > 1 && m.moe.is_moe(i)
              ? static_cast<double>(m.moe.experts / l.ep * 3 * m.moe.ffn_hidden * m.hidden)
              : 0.0;
      const double p =
          experts ? e : static_cast<double>(models::block_parameters(m, l.tp, i, l.ep)) - e;
      if (p == 0) continue;
      k.params += p, k.count += 1, k.by_layer[i] = p;
      if (i > last) last = i, k.last = p;
    }
  return k;
}

// Adds the bytes per step of a data group (dp×cp, or the experts' own) to `d`: gradients reduced,
// and under ZeRO weights gathered; `n` parameters, in `blocks` (and the rest at the stage's ends),
// sharded over `shards` ranks (hybrid sharding: each piece summed over the replicas once a step).
// `gathers`: ZeRO-3 in a pipeline, how often the rank gathers each unit (zero3_gathers).
void add_data_traffic(Traffic& d, const plan::Config& c, const PlanBasis& b, double n,
                      const Blocks& blocks, int64_t shards, const ZeroGathers* gathers) {
  parallel::dp::SyncSize s;
  s.params = n;
  s.buckets = std::ceil(4 * n / std::max(1.0, c.parallel.ddp_bucket_mb * (1 << 20)));
  s.micro_batches = static_cast<double>(b.mbs);
  s.elem = b.w;
  s.shards = shards;
  s.replicated = b.split.replicas > 1;
  s.reduces_once = reduce_once(b);
  s.keep_gathered = b.keep_gathered;
  if (b.sharding.weights && !b.keep_gathered) {
    // Without pipelining every unit gathered for forward and every block but the last again
    // for backward, per micro-batch; in a pipeline as the rank's schedule gathers them.
    s.units = blocks.count + 1;
    s.gathered = s.micro_batches * (n + blocks.params - blocks.last);
    if (gathers) {
      s.gathered = gathers->root * (n - blocks.params);
      for (const auto& [layer, p] : blocks.by_layer)
        if (auto it = gathers->blocks.find(layer); it != gathers->blocks.end())
          s.gathered += it->second * p;
    }
  }
  const auto got = parallel::dp::step_bytes(b.sharding, s);
  d.all_reduce += got.all_reduce;
  d.gather_scatter += got.gather_scatter;
  d.replica += got.replica;
  d.ops += got.ops;
}

// The data groups' bytes: dp×cp, and under expert parallelism the experts' own (edp_cp), over
// which their gradients go.
void add_data_groups(std::map<std::string, Traffic>& g, const plan::Config& c,
                     const plan::Layout& l, const PlanBasis& b, const RankEstimate& r,
                     const models::StagePart& part) {
  const double experts = l.ep > 1 ? expert_params(b.m, part, l.ep) : 0.0;
  std::optional<ZeroGathers> gathers;
  if (b.sharding.weights && !b.keep_gathered && l.pp > 1)
    gathers = zero3_gathers(l, b, r.stage, part);
  const ZeroGathers* played = gathers ? &*gathers : nullptr;
  if (b.data_ranks > 1)
    add_data_traffic(g["dp_cp"], c, b, static_cast<double>(r.params) - experts,
                     stage_blocks(b, l, part, false), b.split.shards, played);
  if (experts > 0 && b.data_ranks / l.ep > 1)
    add_data_traffic(g["edp_cp"], c, b, experts, stage_blocks(b, l, part, true),
                     b.split.expert_shards, played);
}

}  // namespace

std::map<std::string, Traffic> stage_traffic(const plan::Config& c, const plan::Layout& l,
                                             const PlanBasis& b, const RankEstimate& r,
                                             const models::StagePart& part) {
  std::map<std::string, Traffic> g;
  const double mb = static_cast<double>(b.mbs);
  const double own_chunks =
      static_cast<double>(std::max<int64_t>(1, static_cast<int64_t>(part.chunks.size())));
  const auto fp8 = fp8_reduces(c, b, part);
  if (l.tp > 1) {
    add_tp_traffic(g["tp"], c, l, b, r, part);
    add_fp8_traffic(g["tp"], fp8.tp, mb);
  }
  if (l.cp > 1) {
    add_cp_traffic(g["cp"], c, l, b, r);
    add_fp8_traffic(g["cp"], fp8.cp, mb);
    add_aux_loss_traffic(g["cp"], c, b, static_cast<double>(moe_layers_in(b.m, part)));
  }
  if (l.pp > 1) {  // activations forward, gradients backward, at every chunk boundary
    // zbv: the V turns on pipeline rank pp − 1 (stages pp − 1 and pp), a hand-over, not a send.
    const bool v = plan::schedule_shape(c.parallel.pipeline_schedule).v_shape;
    const double turn = v && r.stage == l.pp - 1 ? 1 : 0;
    const double sends_fwd = own_chunks - (part.last ? 1 : 0) - turn;
    const double sends_bwd = own_chunks - (part.first ? 1 : 0) - turn;
    g["pp"].p2p += mb * (sends_fwd + sends_bwd) * b.act_row;
    g["pp"].ops += mb * (sends_fwd + sends_bwd);
  }
  add_data_groups(g, c, l, b, r, part);
  // zbv: one rank holds the first and the last stage, whose tied token table gets a gradient from
  // each chunk's backward; ZeRO-2/3 reduce each as it comes (parallel/dp/grad_reducer.cpp): twice
  // per micro-batch where the gradients are reduced per micro-batch.
  if (b.data_ranks > 1 && b.sharding.grads && !reduce_once(b) && l.pp > 1 && b.m.tied() &&
      part.first && part.last)
    g["dp_cp"].gather_scatter += mb * 4 * b.vocab_local * b.h, g["dp_cp"].ops += mb;
  if (l.ep > 1 && r.layers > 0) {
    // Each MoE layer's dispatch and combine forward and backward: all-to-alls of this rank's
    // token choices (every choice counted, its own included: dropless), recomputation rerunning
    // the forward's pair; and the forward's exchange of counts (int64 per expert).
    const double moe = static_cast<double>(moe_layers_in(b.m, part));
    const double reruns = c.training.recompute == plan::Recompute::kNone ? 0 : 1;
    const double rows = b.tok / (b.sp ? b.tp : 1.0) * static_cast<double>(b.m.moe.top_k);
    g["ep"].gather_scatter += mb * moe *
                              ((4 + 2 * reruns) * rows * b.h * b.w +
                               (1 + reruns) * 8 * static_cast<double>(b.m.moe.experts));
    g["ep"].ops += mb * moe * 3 * (2 + reruns);
  }
  if (l.pp > 1 && b.m.tied() && part.first != part.last) {  // zbv: one rank holds both
    // The token table's fp32 gradient (this tp rank's rows, the vocabulary padded to tp); under
    // ZeRO the table is a bucket of its own, padded to kAlignElements per data rank and sharded
    // over them, and each rank sums its whole piece.
    const double table = b.vocab_local * b.h;
    const double piece = static_cast<double>(optim::kAlignElements * b.split.shards);
    const double held = b.sharding.state
                            ? std::ceil(table / piece) * piece / static_cast<double>(b.split.shards)
                            : table;
    g["embedding"].all_reduce += 4 * held;
    g["embedding"].ops += 1;
  }
  return g;
}
}  // namespace tessel::planner
