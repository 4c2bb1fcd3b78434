// The planner's memory model (basis.h): what a step adds at its peak on each stage (saved
// activations by architecture and recomputation, a pipeline rank's walk of its schedule, the head
// and loss, ZeRO's gathered units and buckets, the gradient norm) beside its state between steps.
#include <algorithm>
#include <cmath>
#include <optional>

#include "core/optim/optim.h"
#include "engine/planner/basis.h"
#include "engine/planner/cpu_profile.h"
#include "models/recompute.h"
#include "models/registry.h"
#include "parallel/pp/schedule.h"
#include "parallel/tp/head_loss.h"

namespace tessel::planner {
namespace {

// ZeRO-3's gathered units at a stage's peak, added to its activations (its gradient buckets are
// in the walk of backward: walk). `units_at_peak` >= 0: a pipeline rank's, which held_peak
// played over its schedule (replay_units) and counted already.
void add_gathered(RankEstimate& r, const plan::Config& c, const plan::Layout& l, const PlanBasis& b,
                  const models::StagePart& part, double units_at_peak) {
  if (!b.sharding.weights) return;
  if (units_at_peak >= 0) {
    r.gathered = units_at_peak;
    return;
  }
  if (b.keep_gathered) {  // the stage's whole weights, for the whole step
    r.gathered = b.w * static_cast<double>(r.params);
  } else {
    // Without pipelining, at the peak, the root unit and blocks: without recomputation the peak is
    // where backward begins (the last block gathered); with it, the saved activations are smaller
    // and the peak moves into backward, where the block being differentiated and its prefetched
    // neighbour are gathered at once (2 blocks, measured once Gloo's all-gather stopped staging
    // its output, 2026-11-27; 3 before). A block as this rank holds it (an MoE layer: E/ep
    // experts).
    double blocks = 0, largest = 0;
    for (const auto& [begin, end] : part.chunks)
      for (int64_t i = begin; i < end; ++i) {
        const auto n = static_cast<double>(models::block_parameters(b.m, l.tp, i, l.ep));
        blocks += n;
        largest = std::max(largest, n);
      }
    const double gathered_blocks = std::min<double>(
        static_cast<double>(r.layers), c.training.recompute == plan::Recompute::kNone ? 1.0 : 2.0);
    r.gathered = b.w * (static_cast<double>(r.params) - blocks + gathered_blocks * largest);
  }
  r.activations += r.gathered;
}

// One stage's bytes: its parameters' state between steps and what a step adds at its peak.
// The device's matmul bytes where they differ from the output's: a CPU's bf16/fp16 matmuls go
// through oneDNN, whose workspaces depend on the CPU (cpu_matmul_bytes); null elsewhere.
parallel::tp::MatmulBytes device_matmul(const PlanBasis& b) {
  if (!b.cpu || b.w >= 4) return nullptr;
  return [dtype = b.dtype, threads = b.threads](int64_t m, int64_t k, int64_t n, bool t) {
    return cpu_matmul_bytes(m, k, n, dtype, t, threads);
  };
}

// The last stage's head and loss (parallel/tp/head_loss.h declares them).
parallel::tp::HeadLossBytes head_bytes(const plan::TrainingConfig& t, const PlanBasis& b) {
  if (!t.lean_logits) return parallel::tp::whole_logits_bytes(b.tok, b.vocab_local, b.w);
  const double chunk =
      std::min(b.tok, static_cast<double>(t.lean_logits_chunk > 0
                                              ? t.lean_logits_chunk
                                              : parallel::tp::default_head_chunk_rows(
                                                    static_cast<int64_t>(b.vocab_local), !b.cpu)));
  return parallel::tp::fused_head_bytes(b.tok, b.vocab_local, b.h, b.w, chunk, device_matmul(b));
}

// The activations of one block (full recomputation) or one MLP (selective) that backward reruns.
double rerun_bytes(const plan::Config& c, const PlanBasis& b) {
  const auto& m = b.m;
  const auto none = activation_model(b.parts, plan::Recompute::kNone, b.own_kernels, b.cpu, b.w);
  const double floats =
      c.training.recompute == plan::Recompute::kFull
          ? none.replicated * b.h / (b.sp ? b.tp : 1.0) +
                (none.attn * b.h + none.kv * b.kvd + none.ffn * m.ffn_hidden) / b.tp
          : none.ffn * m.ffn_hidden / b.tp;
  const double gathered = sp_gathered_floats(plan::Recompute::kNone, b.h, b.tp, b.sp) -
                          sp_gathered_floats(c.training.recompute, b.h, b.tp, b.sp);
  return b.w * b.tok * (floats + gathered);
}

// A chunk's parameters in the order its gradient passes hand them their gradients (the flat
// layout's, from the plan's parameter list), each with its gradient bucket
// (parallel/dp/grad_reducer.h): its elements, its bucket's index and fp32 buffer.
struct Slot {
  double params;
  size_t bucket;
  double bucket_bytes;
  std::string name;
};
std::vector<Slot> chunk_slots(const optim::FlatLayout& layout, int64_t chunk) {
  std::vector<Slot> out;
  for (const auto& s : layout.slots()) {
    const auto& bucket = layout.buckets()[static_cast<size_t>(s.bucket)];
    if (bucket.chunk != chunk) continue;
    out.push_back({static_cast<double>(s.numel), static_cast<size_t>(s.bucket),
                   4.0 * static_cast<double>(bucket.end - bucket.begin), s.name});
  }
  return out;
}

// A gradient pass walked parameter by parameter, `held[s]` being what the pass still holds of
// its micro-batch (and works on) when parameter s gets its gradient: ZeRO-2/3 hold the fp32
// buffer of its bucket (allocated whole at the bucket's first parameter) and of the two buckets
// before it, still reducing. Where the gradients accumulate in the parameters (reduce_once), the
// chunk's first pass makes them (4 bytes each, held to its last), a middle pass adds to them, and
// the last copies them into the buckets, dropping each parameter's as it goes. `plain`: the
// pass's peak without them (chunk_bytes).
parallel::pp::GradPass walk(const std::vector<Slot>& slots, const std::vector<double>& held,
                            bool once, double plain) {
  parallel::pp::GradPass g{plain, plain, plain, plain};
  std::vector<double> buffers;  // the buckets opened so far, in order
  double before = 0;            // elements of the parameters before this one
  for (size_t i = 0; i < slots.size(); ++i) {
    if (i == 0 || slots[i].bucket != slots[i - 1].bucket) buffers.push_back(slots[i].bucket_bytes);
    double live = 0;
    for (size_t j = buffers.size() >= 3 ? buffers.size() - 3 : 0; j < buffers.size(); ++j)
      live += buffers[j];
    g.during = std::max(g.during, held[i] + live);
    if (once) {
      g.during_first = std::max(g.during_first, held[i] + 4 * (before + slots[i].params));
      g.during_last = std::max(g.during_last, held[i] + live - 4 * before);
    }
    before += slots[i].params;
  }
  return g;
}

// What a chunk's backward still holds when each parameter gets its gradient: the blocks after
// its own are differentiated (their activations freed; a block's backward runs its MLP or
// experts half first); past the head its kept tensors are released (but for a tied table's
// gradient, `table_grad`, which the embedding's backward adds to before its bucket opens); at the
// embedding every block is freed. While a block's parameters get theirs, `working` more: the
// pass's working set (working_set), the piece it reruns, and under ZeRO-3 the block before,
// gathered while one is differentiated (above the gathered units add_gathered counts). Relative
// to what is held once the micro-batch's `whole` is freed, as peak_held adds it.
std::vector<double> backward_held(const std::vector<Slot>& slots, const PlanBasis& b,
                                  std::pair<int64_t, int64_t> layers, bool first_chunk,
                                  double whole, double head_kept, double table_grad,
                                  double working) {
  const auto& m = b.m;
  const auto& a = b.a;
  auto acts = [&](int64_t i) { return m.moe.is_moe(i) ? b.per_moe_layer : b.per_layer; };
  const double attention_half =
      b.per_layer - b.w * b.tok *
                        (a.ffn * static_cast<double>(m.ffn_hidden) / b.tp +
                         0.5 * a.replicated * b.h / (b.sp ? b.tp : 1.0));
  auto freed_in_block = [&](int64_t i, const std::string& suffix) {
    const double mlp = acts(i) - attention_half;
    auto starts = [&](const char* p) { return suffix.rfind(p, 0) == 0; };
    if (starts("mlp.")) return suffix.find("down") != std::string::npos ? 0.0 : 0.5 * mlp;
    if (starts("mlp_norm") || starts("attn.o.")) return mlp;
    if (starts("attn.")) return mlp + 0.5 * attention_half;
    return acts(i);  // attn_norm
  };
  std::vector<double> held;
  for (size_t k = 0; k < slots.size(); ++k) {
    const auto& name = slots[k].name;
    double freed = head_kept - table_grad, extra = 0;
    if (name.rfind("layers.", 0) == 0) {
      const auto dot = name.find('.', 7);
      const int64_t at = std::stoll(name.substr(7, dot - 7));
      freed += freed_in_block(at, name.substr(dot + 1));
      for (int64_t i = at + 1; i < layers.second; ++i) freed += acts(i);
      extra = working;
    } else if (name == "pos_embed.weight" ||
               (name == "embed.weight" && first_chunk && k + 1 == slots.size())) {
      freed += table_grad;
      for (int64_t i = layers.first; i < layers.second; ++i) freed += acts(i);
    }
    held.push_back(whole - freed + extra);
  }
  return held;
}

// What a W (zero-bubble schedules) still holds when each parameter gets its gradient: the
// deferred bytes of the parameters it has not handed theirs yet (W hands every gradient of the
// chunk over).
std::vector<double> weight_held(const std::vector<Slot>& slots, double deferred) {
  double total = 0, done = 0;
  for (const auto& slot : slots) total += slot.params;
  std::vector<double> held;
  for (const auto& slot : slots) {
    held.push_back(deferred * (1 - done / std::max(total, 1.0)));
    done += slot.params;
  }
  return held;
}

// Zero-bubble schedules: what a micro-batch chunk holds past B until its W (see held_peak).
double deferred_bytes(const plan::Layout& l, const PlanBasis& b, const models::StagePart& one) {
  using models::BlockImpl;
  double layers = 0, linear = 0;  // linear: the weights W computes (their gradients deferred)
  for (const auto& [begin, end] : one.chunks)
    for (int64_t i = begin; i < end; ++i)
      layers += 1, linear += BlockImpl::deferred_weights(b.parts, i, b.tp);
  const double params = static_cast<double>(models::parameters_on_rank(b.m, l.tp, one, l.ep));
  return layers * b.w * b.tok * BlockImpl::deferred_per_token(b.parts, b.tp) +
         b.w * std::max(0.0, params - linear);
}

// One stage: each micro-batch's forward and backward in turn (pairs: two forwards, two
// backwards).
std::vector<parallel::pp::Simulation::Slot> one_stage_turns(const PlanBasis& b) {
  std::vector<parallel::pp::Simulation::Slot> turns;
  for (int64_t i = 0; i < b.mbs; i += b.lanes) {
    const int64_t n = std::min(b.lanes, b.mbs - i);
    for (int64_t j = 0; j < n; ++j) turns.push_back({0, 0, {parallel::pp::Op::kForward, i + j, 0}});
    for (int64_t j = 0; j < n; ++j)
      turns.push_back({0, 0, {parallel::pp::Op::kBackward, i + j, 0}});
  }
  return turns;
}

// A block's backward working set: its MLP's declaration (MlpImpl::working_set).
models::MlpImpl::Working working_set(const PlanBasis& b) {
  return models::MlpImpl::working_set(b.parts, b.tok, b.tp, b.sp, b.w, b.own_kernels,
                                      device_matmul(b), b.fp8);
}

// One micro-batch of one chunk (layers [begin, end), local chunk k of pipeline rank `stage`).
// It holds its saved activations from F to B (the first chunk also the embedding's output, a
// chunk that receives its input that input, the last chunk `last_kept`, the head's). Zero-bubble
// schedules: past B, until its W, each linear layer's input and output gradient (q/k/v share an
// input, as up/gate do) and the gradients B computed for every other parameter of the chunk
// (norms, biases, embeddings, the head, the router and experts), which W hands over with the
// linear weights' (parallel/pp/weight_grad.h). Over Gloo (CPU) every tensor sent to another rank
// stays until the step's end, where its send is waited for (a V's turn between its two chunks on
// one rank sends nothing). A forward's peak: its working set, a recomputed piece's activations
// (`rerun`) before they are dropped, or on the last chunk the head and loss (`head_transient`).
// A backward's: everything still held (the head's kept tensors but a tied table's gradient
// released first) and the working set, with the piece it reruns; a B's: at its start, or where it
// holds more at its end (its deferred tensors), the input gradient's working set; a W's: the
// weight gradient's. ZeRO-2/3 walk their buckets' buffers parameter by parameter (walk).
parallel::pp::ChunkBytes chunk_bytes(const plan::Config& c, const plan::Layout& l,
                                     const PlanBasis& b, int64_t stage, int64_t k,
                                     const models::StagePart& one, double last_kept,
                                     double head_transient, double rerun,
                                     const optim::FlatLayout* layout, bool part_first) {
  const auto& m = b.m;
  const double h = b.h, w = b.w, tok = b.tok;
  const auto [begin, end] = one.chunks.front();
  const double layers = static_cast<double>(end - begin);
  const double moe = static_cast<double>(moe_layers_in(m, one));
  parallel::pp::ChunkBytes cb;
  cb.whole = (layers - moe) * b.per_layer + moe * b.per_moe_layer +
             (one.first ? tok * h * w : b.act_row) + (one.last ? last_kept : 0.0);
  if (l.pp > 1) {
    parallel::pp::Schedule placed;
    placed.stages = l.pp;
    placed.v_shape =
        plan::schedule_shape(plan::PipelineSchedule(c.parallel.pipeline_schedule)).v_shape;
    const int64_t g = placed.stage_of(stage, k);
    cb.deferred = deferred_bytes(l, b, one);
    cb.sent_forward = b.cpu && !one.last && placed.rank_of(g + 1) != stage ? b.act_row : 0.0;
    cb.sent_backward = b.cpu && !one.first && placed.rank_of(g - 1) != stage ? b.act_row : 0.0;
  }
  // Lean logits keep the head's fp32 weight gradient from forward and hand it to the table in
  // the weights' dtype; a tied table on this chunk holds that until the embedding's backward.
  const double table_grad =
      one.last && one.first && m.tied() && c.training.lean_logits ? b.vocab_local * h * w : 0.0;
  const auto x = working_set(b);
  const double release = one.last ? last_kept - table_grad : 0.0;
  const double plain = cb.whole - cb.sent_backward + std::max(0.0, x.backward + rerun - release);
  cb.during_forward = one.last ? head_transient : x.forward + rerun;
  cb.during_input = std::max(0.0, cb.whole - cb.sent_backward - cb.deferred + rerun) + x.input;
  cb.backward = {plain, plain, plain, plain};
  const double weight_plain = cb.deferred + x.weight;
  cb.weight = {weight_plain, weight_plain, weight_plain, weight_plain};
  if (!layout) return cb;
  auto list = chunk_slots(*layout, k);
  const bool once = reduce_once(b);
  for (const auto& slot : list) cb.grads += once ? 4 * slot.params : 0.0;
  // A V's first rank: its tied table (in chunk 0's buckets) gets the head's gradient first in
  // each pass of its last chunk too, opening the table's bucket there.
  if (one.last && !one.first && part_first && m.tied())
    for (const auto& slot : chunk_slots(*layout, 0))
      if (slot.name == "embed.weight") list.insert(list.begin(), slot);
  // ZeRO-3 without kept units and pipelining: the prefetched block beside the one add_gathered
  // counts.
  const double neighbour = b.sharding.weights && !b.keep_gathered && l.pp == 1 &&
                                   c.training.recompute == plan::Recompute::kNone
                               ? b.w * b.block
                               : 0.0;
  cb.backward =
      walk(list,
           backward_held(list, b, {begin, end}, one.first, cb.whole, one.last ? last_kept : 0.0,
                         table_grad, neighbour + x.backward + rerun),
           once, plain);
  auto held = weight_held(list, cb.deferred);
  for (auto& bytes : held) bytes += x.weight;
  cb.weight = walk(list, held, once, weight_plain);
  return cb;
}

// A rank's peak over its schedule (the simulated pipeline's, or one stage's micro-batches in
// turn, two at once where pairs run), each chunk's micro-batches as chunk_bytes has them. ZeRO-3
// without kept units in a pipeline: the units gathered at each pass beside them
// (replay_units), those at the peak in `gathered_at_peak` (else left as it was).
double held_peak(const plan::Config& c, const plan::Layout& l, const PlanBasis& b, int64_t stage,
                 const models::StagePart& part, double last_kept, double head_transient,
                 double rerun, double* gathered_at_peak) {
  const auto& m = b.m;
  // ZeRO-2/3: the buckets as the rank lays them out, from the plan's parameter list.
  std::optional<optim::FlatLayout> layout;
  if (b.sharding.grads)
    layout = optim::layout_of(
        models::param_entries(m, l.tp, part, l.ep),
        optim::layout_options(c, b.split.shards, 0, b.split.expert_shards, 0, l.pp));
  std::vector<parallel::pp::ChunkBytes> bytes;
  for (const auto& [begin, end] : part.chunks) {
    const models::StagePart one{
        {{begin, end}}, part.first && begin == 0, part.last && end == m.layers};
    bytes.push_back(chunk_bytes(c, l, b, stage, static_cast<int64_t>(bytes.size()), one, last_kept,
                                head_transient, rerun, layout ? &*layout : nullptr, part.first));
  }
  if (l.pp == 1) return parallel::pp::peak_held(one_stage_turns(b), bytes);
  const auto& timeline = b.sim.timeline[static_cast<size_t>(stage)];
  if (!b.sharding.weights || b.keep_gathered) return parallel::pp::peak_held(timeline, bytes);
  const auto units = replay_units(timeline, b, l, part, b.w * root_parameters(b, l, part));
  size_t at = 0;
  const double peak = parallel::pp::peak_held(timeline, bytes, units.held, &at);
  *gathered_at_peak = units.held.at(at);
  return peak;
}

// The largest gradient tensor the norm reads on a rank holding `params`: the whole gradient
// (ZeRO 0), the shard (2-3), or at ZeRO-1 the largest bucket's piece (its pieces sit apart in the
// full buffer).
double norm_piece(const plan::Config& c, const plan::Layout& l, const PlanBasis& b,
                  const models::StagePart& part, int64_t params) {
  if (!b.sharding.state_only())
    return static_cast<double>(params) / static_cast<double>(b.split.shards);
  const auto flat =
      optim::layout_of(models::param_entries(b.m, l.tp, part, l.ep),
                       optim::layout_options(c, b.split.shards, 0, b.split.expert_shards, 0, l.pp));
  double piece = 0;
  for (const auto& k : flat.buckets())
    piece = std::max(piece, static_cast<double>(flat.piece_numel(k)));
  return piece;
}

}  // namespace

// Sequence parallelism: the all-gathered inputs a block keeps (BlockImpl::column_inputs_kept),
// per token beyond the norm's output the activation model counts (1/tp of it).
double sp_gathered_floats(plan::Recompute recompute, double h, double tp, bool sp) {
  if (!sp) return 0.0;
  return models::BlockImpl::column_inputs_kept(recompute) * h *
         parallel::tp::ColumnParallelLinearImpl::gathered_kept_per_in(tp, sp);
}

// Each part's declaration (models/layers.h): per block, the residual stream and two norms, the
// attention's query-wide and key/value-wide tensors, the MLP form's ffn-wide ones; outside the
// blocks, the embedding, the head's input and the final norm. Recomputation: full keeps each
// block's input only (a recomputed piece's); selective reruns the MLP half, whose input the
// piece keeps in place of its norm's output and the ffn-wide tensors. Each piece also keeps the
// CPU generator's state (models::piece_rng_state_bytes).
ActivationModel activation_model(const models::DecoderOptions& o, plan::Recompute recompute,
                                 bool own_kernels, bool cpu, double w) {
  const double norm = models::NormImpl::kept_per_h(o, own_kernels, cpu, w);
  const auto attn = models::AttentionImpl::kept(o);
  const double stream = models::BlockImpl::stream_kept_per_h(o);
  const double outside = models::DecoderImpl::outside_kept_per_h(o, own_kernels, cpu, w);
  if (recompute == plan::Recompute::kFull) return {models::kPieceKeptPerInput, 0, 0, 0, outside};
  if (recompute == plan::Recompute::kSelective)
    return {stream + norm, attn.per_h, attn.per_kv, 0.0, outside};
  return {stream + 2 * norm, attn.per_h, attn.per_kv, models::MlpImpl::kept_per_ffn(o, own_kernels),
          outside};
}

RankEstimate stage_memory(const plan::Config& c, const plan::Layout& l, const PlanBasis& b,
                          int64_t stage, const models::StagePart& part) {
  const auto& t = c.training;
  const auto& m = b.m;
  const auto& a = b.a;
  const double w = b.w, tok = b.tok, h = b.h;
  RankEstimate r;
  r.stage = stage;
  r.params = models::parameters_on_rank(m, l.tp, part, l.ep);
  for (const auto& [first, end] : part.chunks) r.layers += end - first;
  // ZeRO splits the experts over the ranks holding the same experts (data ranks / ep); hybrid
  // sharding each over its shard groups.
  const auto experts = static_cast<int64_t>(expert_params(m, part, l.ep));
  const auto state =
      optim::planned_state_bytes(r.params - experts, b.sharding, b.split.shards, b.dtype);
  const auto expert_state =
      optim::planned_state_bytes(experts, b.sharding, b.split.expert_shards, b.dtype);
  r.weights = static_cast<double>(state.params + expert_state.params);
  r.grads = static_cast<double>(state.grads + expert_state.grads);
  r.optimizer = static_cast<double>(state.optimizer + expert_state.optimizer);
  r.inflight = l.pp > 1 ? b.sim.peak_activations[static_cast<size_t>(stage)] : b.lanes;
  const auto head = head_bytes(t, b);
  const double last_kept = head.kept + (a.outside - 1) * tok * h * w;
  // Recomputation: one block (full) or MLP (selective) rerun in backward, live whole while it
  // is differentiated (and while forward runs it before dropping it); the rerun block's
  // attention probabilities with it.
  double rerun = 0;
  if (t.recompute != plan::Recompute::kNone && r.layers > 0) {
    const double probs = t.recompute == plan::Recompute::kFull ? b.short_attention * tok : 0.0;
    rerun = rerun_bytes(c, b) + probs;
  }
  double units_at_peak = -1;  // ZeRO-3 in a pipeline: the units held_peak counted at its peak
  r.activations = held_peak(c, l, b, stage, part, last_kept, head.transient, rerun, &units_at_peak);
  add_gathered(r, c, l, b, part, units_at_peak);
  // After backward, the gradient norm (core/optim/optim.cpp clip_grad_norm): on the CPU each of
  // its chunks of at most 2^14 elements is copied to fp64 in turn, the step's peak when the
  // activations are smaller (CUDA reads each chunk in its own dtype).
  if (b.cpu) {
    r.activations =
        std::max(r.activations, 8.0 * std::min(16384.0, norm_piece(c, l, b, part, r.params)));
  }
  return r;
}

}  // namespace tessel::planner
