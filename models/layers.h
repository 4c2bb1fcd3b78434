// Building blocks of both decoders, tensor-parallel by construction: every projection is its own
// named column- or row-parallel layer (q, k, v, o; up, gate, down), the token table is
// vocabulary-parallel, and with one process (a group of size 1) they are plain layers. Every
// parameter keeps its global name and a ParamSpec saying which slice of the global tensor this
// rank holds, so initialisation, loading, checkpoints and export work on global tensors.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/kernels/document_attention.h"
#include "core/plan/user_error.h"
#include "models/flops.h"
#include "models/mlp.h"
#include "models/shape.h"
#include "parallel/block_hooks.h"
#include "parallel/comm.h"
#include "parallel/tp/layers.h"

namespace tessel::models {

/// The pipeline stages one rank holds (parallel/pp): the global layer range of each of its model
/// chunks, whether its first chunk is the model's first stage (token and position embeddings) and
/// whether its last chunk is the last stage (final norm, head and loss). The default is the whole
/// model in one chunk.
struct StagePart {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [begin, end) per chunk; empty: all layers
  bool first = true, last = true;
};

/// What differs between the two architectures (from the registry), and the tensor-parallel group.
struct DecoderOptions {
  ModelShape model;
  bool layer_norm = true;                // LayerNorm with bias (gpt2) or RMSNorm (llama)
  bool learned_pos = true;               // learned position table (gpt2) or RoPE (llama)
  plan::Mlp mlp = plan::Mlp::kGeluTanh;  // the MLP's form (models/mlp.h), never auto
  bool linear_bias = true;               // biases in projections (gpt2)
  parallel::Group* tp = nullptr;         // null: one process
  bool sequence_parallel = false;
  StagePart stages;
  parallel::Group* cp = nullptr;  // context parallelism (parallel/cp): null or size 1: none
  plan::CpMethod cp_method = plan::CpMethod::kAllGather;
  parallel::Group* ep = nullptr;  // expert parallelism (parallel/ep): null: the group of one
};

/// Where a parameter sits in the global model.
struct ParamSpec {
  std::vector<int64_t> global_shape;  // the model's true shape (vocabulary unpadded)
  parallel::tp::Shard shard;          // this rank's slice of the (padded) global tensor
  int64_t padded_rows = 0;            // > 0: dim 0 is zero-padded to this before sharding
  bool tp_grad_sum = false;  // replicated, but each tp rank holds a partial gradient: sum over tp
  int64_t replicas = 1;      // model-parallel ranks holding the same values (global gradient norm)
  int64_t chunk = 0;  // the pipeline chunk (of this rank) whose backward produces its gradient
  bool pipeline_copy = false;  // the last stage's copy of a tied token table (the first stage's
                               // is the one saved; their gradients are summed over the embedding
                               // group, so they stay equal)
  bool expert = false;  // an MoE layer's stacked experts: `shard` splits dim 0 over the ep group
                        // (not tp), and gradients are summed over the expert data group

  /// This rank's slice of a global tensor (padded first when the spec says so).
  torch::Tensor local_of(const torch::Tensor& global) const;
  /// The part of this rank's slice that holds real (unpadded) rows: [begin, end) per dimension.
  std::vector<std::pair<int64_t, int64_t>> global_ranges() const;
};

/// LayerNorm (weight, bias) or RMSNorm (weight), as in Hugging Face. Replicated.
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(int64_t dim, double eps, bool layer_norm);
  torch::Tensor forward(const torch::Tensor& x);
  /// Its elements at width `dim`: weight, and bias for LayerNorm.
  static int64_t parameters(const DecoderOptions& o, int64_t dim) {
    return (o.layer_norm ? 2 : 1) * dim;
  }
  /// What one norm keeps for backward per token, in units of its width and elements of the
  /// compute dtype `w` bytes wide, beside its input (the residual stream's: BlockImpl): its
  /// output (1). RMSNorm's composite (LibTorch's CPU operator, which runs where neither Tessel's
  /// CPU kernel, `own_kernels`, nor the fused CUDA kernel does) keeps x·rsqrt too (1) and, in
  /// bf16/fp16, the fp32 copy of its input (4/w; CPU bf16, 2026-11-28). Measured with whole blocks
  /// (BlockImpl::stream_kept_per_h): the selective mode, which drops one norm, gives the same.
  static double kept_per_h(const DecoderOptions& o, bool own_kernels, bool cpu, double w) {
    if (o.layer_norm || own_kernels || !cpu) return 1.0;
    return 2.0 + (w < 4 ? 4 / w : 0.0);
  }
  /// FLOPs per token at width `dim` (models/flops.h): its elements as weights.
  static Flops flops(const DecoderOptions& o, int64_t dim) {
    return weight_flops(parameters(o, dim));
  }
  torch::Tensor weight, bias;
  bool tessel_kernels = true;  // RMSNorm: core/kernels/fused_ops.h's CPU loops where they apply

 private:
  double eps_;
  bool layer_norm_;
};
TORCH_MODULE(Norm);

/// Causal self-attention through kernels::dense_attention (the kernel choice), grouped-query when
/// kv_heads < heads. Heads are split over tp; key/value heads too when kv_heads % tp == 0, else
/// (tp > kv_heads) every rank holds all key/value projections and uses the head its query heads
/// share. x: [b, s, h] (SP: [b, s/t, h]) -> same.
class AttentionImpl : public torch::nn::Module, public parallel::tp::Placed {
 public:
  explicit AttentionImpl(const DecoderOptions& o);
  /// q, k, v, o declare their own; here what the tp layers do not: key/value projections held
  /// whole by every rank (tp > kv_heads) and the per-head norms, whose gradients are partial.
  std::vector<std::pair<std::string, parallel::tp::Placement>> placements() const override;
  /// What it keeps for backward per token: `per_h`·hidden query-wide elements and `per_kv`·kv_dim
  /// for the keys and values, each split over tp. Measured with the counting allocator
  /// (core/observe/counters.h) on whole blocks, CPU fp32, 2026-11-23: 1.6 and 2 with RoPE, 1.58
  /// and 2 with learned positions (GPT-2's 3.58·hidden, its kv_dim being hidden).
  struct Kept {
    double per_h, per_kv;
  };
  static Kept kept(const DecoderOptions& o) { return {o.learned_pos ? 1.58 : 1.6, 2.0}; }
  /// Its own matmuls per token of a `seq`-token causal sequence (models/flops.h): scores and
  /// weighted values, 4·H·Q·T in forward and twice that in backward.
  static Flops core_flops(const DecoderOptions& o, int64_t seq) {
    const double f = 4.0 * static_cast<double>(o.model.heads * o.model.head_dim() * seq);
    return {3 * f, f};
  }
  /// FLOPs per token: q, k, v and o (their biases and the per-head norms too) as weights, and
  /// core_flops times `share`, the share of a causal sequence's attention a document mask keeps.
  static Flops flops(const DecoderOptions& o, int64_t seq, double share) {
    const auto& m = o.model;
    const auto h = static_cast<double>(m.hidden),
               kv = static_cast<double>(m.kv_heads * m.head_dim());
    auto f = weight_flops(2 * h * h + 2 * h * kv + (o.linear_bias ? 2 * h + 2 * kv : 0.0) +
                              (m.qk_norm ? 2.0 * static_cast<double>(m.head_dim()) : 0.0),
                          2 * h * h + 2 * h * kv);
    const auto core = core_flops(o, seq);
    f.train += core.train * share, f.forward += core.forward * share;
    return f;
  }
  /// training.fp8's amax reductions per micro-batch of `tokens` rows (Fp8Reduces): q, k and v
  /// split by output features, o by input features (k and v replicated over tp when kv_heads < tp
  /// stay in the model's dtype: none).
  static Fp8Reduces fp8_reduces(const DecoderOptions& o, double tokens, double tp,
                                kernels::fp8::Recipe recipe);
  /// docs: the micro-batch's documents (data.document_mask; every token of the sequence, as the
  /// cp rank's all-to-all sees them), attention kept inside each; null: one causal sequence.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const kernels::Documents* docs = nullptr);
  parallel::tp::ColumnParallelLinear q{nullptr}, k{nullptr}, v{nullptr};
  torch::nn::Linear k_all{nullptr}, v_all{nullptr};  // registered as k, v when replicated
  parallel::tp::RowParallelLinear o{nullptr};
  Norm q_norm{nullptr}, k_norm{nullptr};  // model.qk_norm: RMSNorm of each head before RoPE
  bool kv_replicated() const { return !k; }
  /// Generation: keys and values of the positions seen so far, [b, kv_heads, n, d] (after RoPE).
  struct KvCache {
    torch::Tensor k, v;
  };
  /// While set (DecoderImpl::decode), forward appends this call's keys/values to it and attends
  /// over all of them: the new tokens follow the cached positions.
  KvCache* cache = nullptr;
  bool tessel_kernels = true;  // Tessel's attention and RoPE kernels where they apply

 private:
  parallel::Group* tp_;
  bool sp_;
  int64_t heads_, kv_heads_, head_dim_, kv_index_ = 0;  // local counts
  parallel::Group* cp_;                                 // null: no context parallelism
  plan::CpMethod cp_method_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const DecoderOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  /// Its column-parallel hidden x ffn_hidden weight matrices (gate and up for a gated form,
  /// else up): each keeps an ffn-wide output whose gradient its weight's gradient reads.
  static double column_matrices(const DecoderOptions& o) { return mlp_form(o.mlp).gated() ? 2 : 1; }
  /// All its hidden x ffn_hidden weight matrices: the column-parallel ones and down.
  static double weight_matrices(const DecoderOptions& o) { return column_matrices(o) + 1; }
  /// FLOPs per token at inner width `ffn` (models/flops.h): its matrices and biases as weights.
  static Flops flops(const DecoderOptions& o, int64_t ffn) {
    const auto h = static_cast<double>(o.model.hidden), f = static_cast<double>(ffn);
    return weight_flops(
        weight_matrices(o) * h * f + (o.linear_bias ? column_matrices(o) * f + h : 0.0),
        weight_matrices(o) * h * f);
  }
  /// training.fp8's amax reductions per micro-batch of `tokens` rows (Fp8Reduces) of an MLP
  /// `ffn` wide: up (and gate) split by output features, down by input features.
  static Fp8Reduces fp8_reduces(const DecoderOptions& o, int64_t ffn, double tokens, double tp,
                                kernels::fp8::Recipe recipe);
  /// Elements its forward keeps per token and unit of this rank's ffn width: its form's
  /// (MlpForm::kept_per_ffn).
  static double kept_per_ffn(const DecoderOptions& o, bool own_kernels) {
    return mlp_form(o.mlp).kept_per_ffn(own_kernels);
  }
  /// Elements its activation's backward holds per token and unit of ffn width beyond down's
  /// (MlpForm::backward_extra_per_ffn).
  static double backward_extra_per_ffn(const DecoderOptions& o, bool own_kernels) {
    return mlp_form(o.mlp).backward_extra_per_ffn(own_kernels);
  }
  /// Bytes a block's backward holds at once, over `tokens` rows in elements `w` bytes wide: it
  /// starts at down, whose backward's (tp::RowParallelLinearImpl::backward_bytes) `input`,
  /// `weight` and `backward` are, the last with what the activation's backward holds beyond it
  /// (backward_extra_per_ffn); `forward`: a forward's last op's output, tokens × h.
  struct Working {
    double input, weight, backward, forward;
  };
  static Working working_set(const DecoderOptions& o, double tokens, double tp, bool sp, double w,
                             bool own_kernels, const parallel::tp::MatmulBytes& matmul,
                             bool fp8 = false) {
    const double f = static_cast<double>(o.model.ffn_hidden) / tp;
    const auto h = static_cast<double>(o.model.hidden);
    const auto down =
        parallel::tp::RowParallelLinearImpl::backward_bytes(tokens, f, h, w, sp, matmul, fp8);
    const double activation = w * tokens * f * backward_extra_per_ffn(o, own_kernels);
    return {down.input, down.weight, down.both + activation, w * tokens * h};
  }
  parallel::tp::ColumnParallelLinear up{nullptr}, gate{nullptr};
  parallel::tp::RowParallelLinear down{nullptr};
  bool tessel_kernels = true;  // Tessel's GELU and SwiGLU where they apply (else LibTorch's)

 private:
  parallel::Group* tp_;
  bool sp_;
  const MlpForm* form_;
};
TORCH_MODULE(Mlp);

class MoeImpl;
struct MoeState;

/// Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); an MoE layer (o.model.moe.is_moe)
/// has models/moe.h's mixture of experts as its mlp.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const DecoderOptions& o, int64_t layer, MoeState* moe_state);
  /// Its elements every tensor-parallel rank holds whole at width `h` (the two norms, and the
  /// row-parallel projections' biases: attention's o and the MLP's down): under sequence
  /// parallelism each rank's gradient of them is partial.
  static int64_t replicated_parameters(const DecoderOptions& o, int64_t h) {
    return 2 * NormImpl::parameters(o, h) + (o.linear_bias ? 2 * h : 0);
  }
  /// Its residual stream kept for backward per token, in units of h, beside its norms'
  /// (NormImpl::kept_per_h): the block's input and the attention half's sum, each a norm's input,
  /// and what the whole-block measurements (CPU fp32, 2026-11-23) leave besides: 0.5·h in
  /// RMSNorm blocks, 0.76·h in LayerNorm blocks (biases, the norm's statistics).
  static double stream_kept_per_h(const DecoderOptions& o) { return o.layer_norm ? 2.76 : 2.5; }
  /// Host operators it issues per micro-batch, forward and backward (with the head and the
  /// optimizer's share), counted in --profile traces of GPT-2 and Llama blocks, CPU fp32,
  /// 2026-11-26: Tessel's kernels 115 (LayerNorm, GELU) and 107 (RMSNorm, SwiGLU, RoPE);
  /// LibTorch's 100 (its flash attention is fewer) and 200 (composite RMSNorm, RoPE, SwiGLU).
  static double host_ops(const DecoderOptions& o, bool own_kernels) {
    if (own_kernels) return o.layer_norm ? 115 : 107;
    return o.layer_norm ? 100 : 200;
  }
  /// FLOPs per token of block `layer` (models/flops.h): its norms, its attention, and its MLP or
  /// mixture of experts (MoeImpl::flops). `seq`, `share`: AttentionImpl::flops'.
  static Flops flops(const DecoderOptions& o, int64_t layer, int64_t seq, double share);
  /// training.fp8's amax reductions of block `layer` per micro-batch (its attention's, its dense
  /// MLP's or shared experts'); `rerun`: those a recomputation of it reruns under `mode`.
  static Fp8Reduces fp8_reduces(const DecoderOptions& o, int64_t layer, double tokens, double tp,
                                kernels::fp8::Recipe recipe);
  static Fp8Reduces fp8_rerun_reduces(const DecoderOptions& o, int64_t layer, double tokens,
                                      double tp, kernels::fp8::Recipe recipe, plan::Recompute mode);
  /// The forward work per token a recomputation of block `layer` reruns under `mode`: full, the
  /// whole block; selective, the MLP half (its norm and its MLP or experts); none, nothing.
  static double rerun_flops(const DecoderOptions& o, int64_t layer, plan::Recompute mode,
                            int64_t seq, double share);
  /// Zero-bubble schedules (parallel/pp/weight_grad.h): elements per token its linear layers hold
  /// from a B to its W at this tensor-parallel rank's widths, each one's input and output
  /// gradient (q/k/v share an input, as up/gate do): inputs 3·h + ffn/tp, output gradients
  /// (h + 2·kv)/tp + 2·h + the column matrices' ffn/tp each.
  static double deferred_per_token(const DecoderOptions& o, double tp) {
    const auto h = static_cast<double>(o.model.hidden);
    const double kv = static_cast<double>(o.model.kv_heads * o.model.head_dim());
    const double f = static_cast<double>(o.model.ffn_hidden) / tp;
    return 3 * h + f + (h + 2 * kv) / tp + 2 * h + MlpImpl::column_matrices(o) * f;
  }
  /// The weight elements whose gradients a W computes in block `layer` on a tensor-parallel rank:
  /// the attention's projections and the MLP's (an MoE layer's shared experts; the routed ones
  /// are not deferred).
  static double deferred_weights(const DecoderOptions& o, int64_t layer, double tp) {
    const auto& m = o.model;
    const auto h = static_cast<double>(m.hidden);
    const double kv = static_cast<double>(m.kv_heads * m.head_dim());
    const double ffn =
        static_cast<double>(m.moe.is_moe(layer) ? m.moe.shared * m.moe.ffn_hidden : m.ffn_hidden);
    return (2 * h * h + 2 * h * kv) / tp + MlpImpl::weight_matrices(o) * h * ffn / tp;
  }
  /// Its column-parallel regions' inputs (the attention's q/k/v, the MLP's up/gate) kept for
  /// backward under recomputation `mode`: both, the attention's (selective reruns the MLP half)
  /// or none (full). Under sequence parallelism each keeps its all-gathered input
  /// (tp::ColumnParallelLinearImpl::gathered_kept_per_in).
  static double column_inputs_kept(plan::Recompute mode) {
    return mode == plan::Recompute::kFull ? 0.0 : mode == plan::Recompute::kSelective ? 1.0 : 2.0;
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const kernels::Documents* docs = nullptr);
  /// training.recompute selective: the MLP half (its norm and its ffn-wide activations) is rerun
  /// in backward; attention keeps its activations.
  bool recompute_mlp = false;
  Norm attn_norm{nullptr}, mlp_norm{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};              // dense layers
  std::shared_ptr<MoeImpl> moe;  // MoE layers (registered as "mlp")

 private:
  torch::Tensor ffn(const torch::Tensor& x);
};
TORCH_MODULE(Block);

/// The decoder: embed (+ pos_embed) -> layers -> norm -> head (or the tied embedding). Under
/// pipeline parallelism a rank holds only its stages' parts (options().stages), each parameter
/// under its global name (layers.<global index>...).
class DecoderImpl : public torch::nn::Module {
 public:
  explicit DecoderImpl(DecoderOptions o);
  /// The whole model (one chunk holding every stage): tokens [b, s] int64 -> this rank's
  /// vocabulary slice of the logits [b, s, Vp/t].
  torch::Tensor forward(const torch::Tensor& tokens, const kernels::Documents* docs = nullptr);
  /// Generation with a key/value cache (whole model, one process): the logits [b, n, Vp] of
  /// `tokens` [b, n] at positions [start, start+n), attending over the positions before `start`
  /// given by earlier calls. start 0 begins a new sequence.
  torch::Tensor decode(const torch::Tensor& tokens, int64_t start);
  /// Sum of next-token losses (fp32) of rows [b, T+1]: inputs row[:-1], targets row[1:].
  torch::Tensor loss_sum(const torch::Tensor& rows, const kernels::Documents* docs = nullptr);
  /// One chunk's forward of micro-batch rows [b, T+1]. `input`: the previous stage's activation
  /// [b, T, h] (SP: [b, T/t, h]; CP: T/cp tokens, this cp rank's two chunks), ignored by the
  /// first stage (which embeds rows[:, :-1]). Returns the activation for the next stage, or on
  /// the last stage the loss sum over rows[:, 1:] (CP: over this rank's chunks). Only the first
  /// and last stage read `rows` (needs_rows()). `docs` (data.document_mask; every stage): the
  /// documents of rows[:, :-1], attention kept inside each and positions restarted at each.
  torch::Tensor stage_forward(int64_t chunk, const torch::Tensor& input, const torch::Tensor& rows,
                              const kernels::Documents* docs = nullptr);
  int64_t chunks() const { return static_cast<int64_t>(o_.stages.chunks.size()); }
  bool is_first_stage(int64_t chunk) const { return o_.stages.first && chunk == 0; }
  bool is_last_stage(int64_t chunk) const { return o_.stages.last && chunk == chunks() - 1; }
  bool needs_rows(int64_t chunk) const { return is_first_stage(chunk) || is_last_stage(chunk); }
  /// Every parameter name of the global model (all stages), for checking weight files.
  std::set<std::string> global_names() const;
  const DecoderOptions& options() const { return o_; }
  const std::map<std::string, ParamSpec>& specs() const { return specs_; }
  parallel::Group& tp() const { return *o_.tp; }
  /// training.recompute: none | selective (each block's MLP half) | full (each block kept as its
  /// input only and rerun in backward).
  void set_recompute(plan::Recompute mode);
  /// training.kernels: tessel (Tessel's own CPU kernels where they apply: GELU, SwiGLU, RMSNorm,
  /// RoPE, short-sequence attention) | torch (LibTorch's only).
  void set_kernels(plan::Kernels kernels);
  /// training.fp8: the blocks' tensor-parallel linear layers (attention's q, k, v and o, the MLP's,
  /// the shared experts') in float8 (core/kernels/fp8.h), their amaxes completed over tp and cp.
  /// Returns how many layers of this rank it set, and how many stay in the model's dtype (key and
  /// value projections replicated over tp when kv_heads < tp).
  std::pair<int64_t, int64_t> set_fp8(plan::Fp8 recipe);
  /// training.lean_logits: the loss through parallel/tp/head_loss.h in chunks of `chunk_tokens`
  /// (0: 64 MiB of fp32 logits per chunk); `on` false: whole logits, then the loss.
  void set_lean_logits(bool on, int64_t chunk_tokens);
  /// data.eod_mask_loss: the loss sum leaves out every target whose input token is `eod` (the
  /// first token of the next document); -1: every target counts.
  void set_loss_mask_after(int64_t eod) { loss_mask_eod_ = eod; }
  /// Hooks around every block (not owned; null: none).
  void set_hooks(parallel::BlockHooks* hooks) { hooks_ = hooks; }
  /// The MoE layers' shared state (null for a dense model): a training step sets the factor its
  /// loss sum is multiplied by (the balance loss's gradient scale; undefined: not training) and
  /// reads the step's statistics (reset_moe_stats() before it).
  MoeState* moe_state() const { return moe_state_.get(); }
  void reset_moe_stats();
  /// Auxiliary-loss-free balancing: `counts` [MoE layers, E], every layer's choices over the
  /// global batch, move this rank's layers' balance biases.
  void update_moe_bias(const torch::Tensor& counts);

  /// What the model keeps per token outside its blocks, in units of h: the embedding's output and
  /// the head's input (1.3, measured with the blocks) and the final norm's (NormImpl::kept_per_h).
  static double outside_kept_per_h(const DecoderOptions& o, bool own_kernels, bool cpu, double w) {
    return 1.3 + NormImpl::kept_per_h(o, own_kernels, cpu, w);
  }
  /// The model FLOPs per token of the whole model, whatever this rank holds (models/flops.h):
  /// its blocks', the final norm's and the head's (a tied table counts once, as the head; input
  /// lookups count nothing), for `seq`-token sequences of which a document mask keeps `share` of
  /// the attention (1: one causal sequence).
  static Flops flops(const DecoderOptions& o, int64_t seq, double share = 1.0);
  /// The forward work per token recomputation reruns over the whole model under `mode`.
  static double rerun_flops(const DecoderOptions& o, plan::Recompute mode, int64_t seq,
                            double share = 1.0);

  parallel::tp::VocabParallelEmbedding embed{nullptr};  // first stage; tied: last stage too
  torch::nn::Embedding pos_embed{nullptr};
  std::shared_ptr<torch::nn::Module> layers;  // children named by global layer index
  Norm norm{nullptr};
  parallel::tp::ColumnParallelLinear head{nullptr};  // absent when tied

  /// RoPE's cos and sin for this rank's positions of a `seq`-token sequence, [local, head_dim]
  /// in `dtype` on `device`: computed once per (seq, device, dtype) and kept (no host-to-device
  /// copy or recomputation per micro-batch).
  const std::pair<torch::Tensor, torch::Tensor>& rope(int64_t seq, const torch::Device& device,
                                                      torch::ScalarType dtype);

 private:
  int64_t cp_size() const { return o_.cp ? o_.cp->size() : 1; }
  /// Global positions of this rank's tokens of a `seq`-token sequence (CP: its two chunks), [T];
  /// with documents, each token's place in its document, [b, T].
  torch::Tensor positions(int64_t seq, const torch::Device& device,
                          const kernels::Documents* docs = nullptr) const;
  torch::Tensor embed_tokens(const torch::Tensor& tokens, const torch::Tensor& positions);
  torch::Tensor run_blocks(int64_t chunk, torch::Tensor x, const torch::Tensor& positions,
                           const kernels::Documents* docs = nullptr);
  /// RoPE's cos and sin of each token's own position: positions [T] or [b, T] -> [..., head_dim]
  /// (rope() keeps those of [0, seq) per device and dtype).
  std::pair<torch::Tensor, torch::Tensor> rope_of(const torch::Tensor& positions,
                                                  torch::ScalarType dtype) const;
  torch::Tensor logits(const torch::Tensor& x);
  /// `weights` [N] (undefined: all 1): each target's share of the sum (0: not scored).
  torch::Tensor token_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                               const torch::Tensor& weights = {});
  /// The last stage's loss sum from its final activation x [b, T, h] (SP: [b, T/t, h]).
  torch::Tensor head_loss_sum(const torch::Tensor& x, const torch::Tensor& targets,
                              const torch::Tensor& weights = {});
  void build_specs();
  std::vector<std::vector<Block>> blocks_;  // per chunk
  DecoderOptions o_;
  std::shared_ptr<parallel::Group> solo_;     // the group of one when no tp group is given
  std::shared_ptr<parallel::Group> solo_ep_;  // ... when no ep group is given
  std::shared_ptr<MoeState> moe_state_;
  torch::Tensor inv_freq_;  // [head_dim / 2], fp32, as Hugging Face computes it (host)
  // inv_freq_ on the device it was last asked for: copied once, not per micro-batch (a document
  // mask's positions change every micro-batch, and a host-to-device copy per call would make
  // the host wait each time). Not a registered buffer: model->to(device, dtype) would round it.
  mutable std::map<std::string, torch::Tensor> inv_freq_on_;
  std::shared_ptr<std::mutex> inv_freq_mutex_ = std::make_shared<std::mutex>();
  std::map<std::tuple<int64_t, std::string, int>, std::pair<torch::Tensor, torch::Tensor>> rope_;
  // rope_ is filled on first use, possibly by two micro-batches' forwards at once (CPU pairs).
  std::shared_ptr<std::mutex> rope_mutex_ = std::make_shared<std::mutex>();
  std::map<std::string, ParamSpec> specs_;
  parallel::BlockHooks* hooks_ = nullptr;
  bool recompute_blocks_ = false;
  int64_t lean_chunk_ = -1;     // tokens per chunk of the fused head and loss; -1: not fused
  int64_t loss_mask_eod_ = -1;  // data.eod_mask_loss's id (-1: every target scored)
  std::vector<AttentionImpl::KvCache> caches_;  // decode(): one per block
};
TORCH_MODULE(Decoder);

}  // namespace tessel::models
