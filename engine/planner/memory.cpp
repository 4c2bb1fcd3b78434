// The planner's memory model (basis.h): what a step adds at its peak on each stage (saved
// activations by architecture and recomputation, a pipeline rank's walk of its schedule, the head
// and loss, ZeRO's gathered units and buckets, the gradient norm) beside its state between steps.
#include <algorithm>
#include <cmath>

#include "core/optim/optim.h"
#include "engine/planner/basis.h"
#include "models/registry.h"
#include "parallel/pp/schedule.h"
#include "parallel/tp/head_loss.h"

namespace tessel::planner {
namespace {

// ZeRO-2's and ZeRO-3's buffers at a stage's peak, added to its activations.
void add_zero_buffers(RankEstimate& r, const plan::Config& c, const PlanBasis& b) {
  const auto& t = c.training;
  const double w = b.w, block = b.block;
  const double one_microbatch =
      r.inflight > 1 ? r.activations / static_cast<double>(r.inflight) : 0.0;
  if (b.zero == 2)  // gradient buckets being reduced (half the fp32 gradient at the peak, as
                    // measured; at most three buckets exist at once)
    r.activations += 0.5 * std::min(4.0 * static_cast<double>(r.params),
                                    3 * c.parallel.ddp_bucket_mb * (1 << 20));
  // and the parameters' accumulated gradients, from the stage's first backward on: by then one
  // held micro-batch's activations are being freed (measured at pp 2: stage 0, holding two,
  // peaks before its first backward; the last stage, holding one, with the gradients).
  if (reduce_once(b))
    r.activations += std::max(0.0, 4.0 * static_cast<double>(r.params) - one_microbatch);
  if (b.zero == 3 && b.keep_gathered) {  // the stage's whole weights, for the whole step
    r.gathered = w * static_cast<double>(r.params);
    r.activations += r.gathered;
    if (!reduce_once(b))  // bf16/fp16: buckets reduced per micro-batch, as below
      r.activations += 4.0 * std::min(static_cast<double>(r.params), 2 * block);
  } else if (b.zero == 3) {
    // At the peak, the root unit and blocks: without recomputation the peak is where backward
    // begins (the last block gathered); with it, the saved activations are smaller and the
    // peak moves into backward, where the block being differentiated and its prefetched
    // neighbour are gathered at once (2 blocks, measured once Gloo's all-gather stopped staging
    // its output, 2026-11-27; 3 before).
    const double blocks = std::min<double>(static_cast<double>(r.layers),
                                           t.recompute == plan::Recompute::kNone ? 1.0 : 2.0);
    r.gathered = w * (static_cast<double>(r.params) - r.layers * block + blocks * block);
    // Plus the gradient buckets in flight: two units' fp32 gradients wait for their
    // reduce-scatter (parallel/dp/grad_reducer.h; fitted on the parity table's ZeRO-3 rows,
    // 2026-11-27).
    r.activations += r.gathered + 4.0 * std::min(static_cast<double>(r.params), 2 * block);
  }
}

// One stage's bytes: its parameters' state between steps and what a step adds at its peak.
// The last stage's head and loss: what each micro-batch keeps from its forward to its backward,
// and what the loss allocates while it runs. Whole logits: the head's output and the loss's fp32
// softmax/gradient buffer for every token, kept. Lean logits (parallel/tp/head_loss.h): forward
// makes the gradients, kept for backward (the fp32 weight gradient and the input's); while it
// runs, one chunk's output and its fp32 copy.
struct HeadBytes {
  double kept, transient;
};
HeadBytes head_bytes(const plan::TrainingConfig& t, const PlanBasis& b) {
  const double w = b.w, tok = b.tok, v = b.vocab_local;
  if (!t.lean_logits) return {tok * v * (w + 4), 0.0};
  const double chunk = std::min(
      tok, static_cast<double>(t.lean_logits_chunk > 0 ? t.lean_logits_chunk
                                                       : parallel::tp::default_head_chunk_rows(
                                                             static_cast<int64_t>(v), !b.cpu)));
  return {v * b.h * 4 + tok * b.h * w, chunk * v * (w == 4 ? 4 : w + 4)};
}

// The activations of one block (full recomputation) or one MLP (selective) that backward reruns.
double rerun_bytes(const plan::Config& c, const PlanBasis& b) {
  const auto& m = b.m;
  const auto none = activation_model(m, plan::Recompute::kNone, b.own_kernels, b.cpu);
  const double floats =
      c.training.recompute == plan::Recompute::kFull
          ? none.replicated * b.h / (b.sp ? b.tp : 1.0) +
                (none.attn * b.h + none.kv * b.kvd + none.ffn * m.ffn_hidden) / b.tp
          : none.ffn * m.ffn_hidden / b.tp;
  return b.w * b.tok * floats;
}

// A pipeline rank: the most it holds over the simulated run of its schedule. A micro-batch chunk
// holds its saved activations from F to B (the first chunk also the embedding's output, a chunk
// that receives its input that input, the leaf its gradient goes back from; the last chunk
// `last_kept`, the head's). Zero-bubble schedules: past B, until its W, each linear layer's input
// and output gradient (q/k/v share an input, as up/gate do) and the gradients B computed for
// every other parameter of the chunk (norms, biases, embeddings, the head, the router and
// experts), which W hands over with the linear weights' (parallel/pp/weight_grad.h). Over Gloo
// (CPU) every tensor sent stays until the step's end, where its send is waited for. A backward
// works on about half a block's activations more (and a recomputed block or MLP, `rerun`, whole).
double pipeline_held(const plan::Layout& l, const PlanBasis& b, int64_t stage,
                     const models::StagePart& part, double last_kept, double rerun) {
  const auto& m = b.m;
  const double h = b.h, tp = b.tp, kvd = b.kvd, w = b.w, tok = b.tok;
  const double f = static_cast<double>(m.ffn_hidden) / tp;
  const double kept =
      3 * h + f + (h + 2 * kvd) / tp + 2 * h + (m.arch == plan::ModelArch::kLlama ? 2 : 1) * f;
  const double mlp_mats = m.arch == plan::ModelArch::kLlama ? 3.0 : 2.0;
  const double attention_weights = (2 * h * h + 2 * h * kvd) / tp;  // q, k, v, o
  const double mlp_weights = mlp_mats * h * f;
  const double shared_weights =
      mlp_mats * h * static_cast<double>(m.moe.shared * m.moe.ffn_hidden) / tp;
  std::vector<parallel::pp::ChunkBytes> bytes;
  for (const auto& [begin, end] : part.chunks) {
    const models::StagePart one{
        {{begin, end}}, part.first && begin == 0, part.last && end == m.layers};
    const double layers = static_cast<double>(end - begin);
    const double moe = static_cast<double>(moe_layers_in(m, one));
    const double linear = layers * attention_weights + (layers - moe) * mlp_weights +
                          moe * shared_weights;  // the weights W computes
    const double params = static_cast<double>(models::parameters_on_rank(m, l.tp, one, l.ep));
    parallel::pp::ChunkBytes c;
    c.whole = (layers - moe) * b.per_layer + moe * b.per_moe_layer +
              (one.first ? tok * h * w : b.act_row) + (one.last ? last_kept : 0.0);
    c.deferred = layers * w * tok * kept + w * std::max(0.0, params - linear);
    c.sent_forward = b.cpu && !one.last ? b.act_row : 0.0;
    c.sent_backward = b.cpu && !one.first ? b.act_row : 0.0;
    bytes.push_back(c);
  }
  return parallel::pp::peak_held(b.sim, stage, bytes, 0.5 * b.per_layer + rerun);
}

}  // namespace

// Llama's RMSNorm as Tessel's CPU kernel (training.kernels tessel, fp32 on the CPU) or LibTorch's
// fused CUDA kernel (core/kernels/fused_ops.cpp) keeps x and one scale per row, not also x·rsqrt as
// the composite does (LibTorch's CPU operator is the composite): one h less per norm, two per block
// and one outside. `own_kernels`: Tessel's SwiGLU runs too, which keeps gate and up, not also
// silu(gate) (one ffn less).
ActivationModel activation_model(const models::ModelShape& m, plan::Recompute recompute,
                                 bool own_kernels, bool cpu) {
  const bool llama = m.arch == plan::ModelArch::kLlama, fused = llama && own_kernels;
  const bool fused_norm = fused || (llama && !cpu);
  ActivationModel a = !llama       ? ActivationModel{4.76, 3.58, 0.0, 2.0, 2.3}
                      : fused      ? ActivationModel{4.5, 1.6, 2.0, 3.0, 2.3}
                      : fused_norm ? ActivationModel{4.5, 1.6, 2.0, 4.0, 2.3}
                                   : ActivationModel{6.5, 1.6, 2.0, 4.0, 3.3};
  // Recomputation, measured the same way: full keeps each block's input (1·h per token) and
  // holds about half of one block's activations at the peak; selective keeps the MLP half's
  // input instead of its norm and ffn-wide tensors, and a quarter of one MLP's at the peak.
  if (recompute == plan::Recompute::kFull) return {1.0, 0, 0, 0, a.outside, 0.5};
  if (recompute == plan::Recompute::kSelective)
    return {llama ? (fused_norm ? 3.5 : 4.5) : 3.76, a.attn, a.kv, 0.0, a.outside, 0.25};
  return a;
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
  // ZeRO splits the experts over the ranks holding the same experts (data ranks / ep).
  const auto experts = static_cast<int64_t>(expert_params(m, part, l.ep));
  const auto state = optim::planned_state_bytes(r.params - experts, b.zero, b.data_ranks, b.dtype);
  const auto expert_state =
      optim::planned_state_bytes(experts, b.zero, b.data_ranks / l.ep, b.dtype);
  r.weights = static_cast<double>(state.params + expert_state.params);
  r.grads = static_cast<double>(state.grads + expert_state.grads);
  r.optimizer = static_cast<double>(state.optimizer + expert_state.optimizer);
  const int64_t chunks = std::max<int64_t>(1, static_cast<int64_t>(part.chunks.size()));
  r.inflight = l.pp > 1 ? b.sim.peak_activations[static_cast<size_t>(stage)] : b.lanes;
  const double moe_layers = static_cast<double>(moe_layers_in(m, part));
  r.activations =
      static_cast<double>(r.inflight) *
      ((static_cast<double>(r.layers) - moe_layers) * b.per_layer + moe_layers * b.per_moe_layer) /
      static_cast<double>(chunks);
  const auto head = head_bytes(t, b);
  const double last_kept = head.kept + (a.outside - 1) * tok * h * w;
  if (l.pp > 1)
    r.activations = pipeline_held(l, b, stage, part, last_kept, 0.0);
  else
    r.activations += static_cast<double>(r.inflight) * (tok * h * w + (part.last ? last_kept : 0));
  if (t.recompute != plan::Recompute::kNone && r.layers > 0) {
    // One block (full) or MLP (selective) rerun in backward. Without pipelining, about half of
    // it at the step's peak (calibrated with the head's); a pipeline rank's peak is a backward
    // holding other micro-batches, where the rerun is whole (measured on recompute_pp2_full_gpt2:
    // 426 and 499 KB above the held activations on its two stages).
    // The rerun block's attention probabilities are live whole until its backward.
    const double probs = t.recompute == plan::Recompute::kFull ? b.short_attention * tok : 0.0;
    if (l.pp > 1)
      r.activations = pipeline_held(l, b, stage, part, last_kept, rerun_bytes(c, b) + probs);
    else
      r.activations += a.rerun * rerun_bytes(c, b) + probs;
  }
  if (part.last) r.activations += static_cast<double>(b.lanes) * head.transient;
  add_zero_buffers(r, c, b);
  // After backward, the gradient norm (core/optim/optim.cpp clip_grad_norm): on the CPU each of
  // its chunks of at most 2^14 elements is copied to fp64 in turn, the step's peak when the
  // activations are smaller (CUDA reads each chunk in its own dtype).
  if (b.cpu) {
    const double shard =
        static_cast<double>(r.params) / static_cast<double>(b.zero > 0 ? b.data_ranks : 1);
    r.activations = std::max(r.activations, 8.0 * std::min(16384.0, shard));
  }
  return r;
}

}  // namespace tessel::planner
