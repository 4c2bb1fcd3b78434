// Mixture of experts: the feed-forward of an MoE layer (llama family; model.moe.*). A router in
// fp32 scores every token against E experts (softmax or sigmoid), each token goes to its top k
// (selected on score + balance bias), the chosen experts' SwiGLU outputs are summed with the
// gate weights (renormalised over the k when norm_topk), plus optional shared experts that every
// token passes through. Expert weights are stacked per layer ([E, f, h], Hugging Face's
// per-expert tensors one slice each) and run as grouped matmuls (at::_grouped_mm: one call over
// all local experts). Under expert parallelism (parallel/ep) each rank holds E/ep experts and its
// tokens travel to them and back by all-to-all.
//
// Balance: the sequence-wise auxiliary loss (DeepSeek-V3) coef · Σ_e f_e·P_e per sequence, with
// f_e = E/(k·T)·(tokens choosing e) and P_e = mean normalised score, averaged over the global
// batch's sequences and summed over MoE layers: whole sequences make it the same for every
// layout. Its gradient enters backward at the layer (AuxLoss, as Megatron's MoEAuxLossAutoScaler),
// so the loss the run reports stays the language-model loss.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "models/layers.h"
#include "parallel/ep/dispatch.h"

namespace tessel::models {

/// What a decoder's MoE layers share: the factor the trainer multiplies the loss sum by (the
/// auxiliary loss's gradient scale; undefined outside training steps), the sequence length, and
/// the statistics of the step (counted once per forward, not by recomputation).
struct MoeState {
  torch::Tensor loss_factor;  // device scalar; undefined: no auxiliary gradient, no statistics
  int64_t seq_len = 0;        // tokens of a whole sequence
  torch::Tensor counts;       // [layers, E] fp32: (token, expert) choices routed this step
  torch::Tensor aux;          // [layers] fp32: Σ over this rank's sequences of the balance loss
  torch::Tensor dropped;      // [layers] fp32: choices dropped by the capacity factor
  bool count_here = true;     // this rank adds its statistics (false: a tp/cp replica's copy)
};

class MoeImpl : public torch::nn::Module, public parallel::tp::Placed {
 public:
  MoeImpl(const DecoderOptions& o, int64_t layer, MoeState* state);
  /// The stacked experts, E/ep of them on each ep rank (replicated over tp, like the router).
  std::vector<std::pair<std::string, parallel::tp::Placement>> placements() const override;
  /// What it keeps for backward per token without recomputation, in elements of the compute dtype
  /// `w` bytes wide, beyond its input: per choice (top_k) the row sent to its expert, the
  /// expert's output and its gate-weighted copy (3·h) and its SwiGLU's four ffn-wide tensors
  /// (gate, up, silu, their product: the grouped matmuls take no fused kernel); the router's
  /// fp32 logits and scores (2·E); in bf16/fp16 the router's fp32 copy of the input (4/w per h).
  /// The shared experts are an MLP's (MlpImpl::kept_per_ffn). Measured on CPU fp32
  /// (tests/dist/planner_test.py, 2026-11-25; the ffn-wide tensors by a sweep of moe.ffn_hidden
  /// and layers, 2026-11-27) and CPU bf16 (2026-11-28: the router's copy 2.6 KB a layer where
  /// this counts 2.0).
  static double routed_kept(const DecoderOptions& o, double w) {
    const auto& e = o.model.moe;
    const auto h = static_cast<double>(o.model.hidden);
    const double k = static_cast<double>(e.top_k), f = static_cast<double>(e.ffn_hidden);
    return k * (4 * f + 3 * h) + 2 * static_cast<double>(e.experts) * 4 / w +
           (w < 4 ? 4 / w * h : 0.0);
  }
  /// FLOPs per token (models/flops.h): the router, the top_k experts a token is routed to and the
  /// shared experts, as weights.
  static Flops flops(const DecoderOptions& o) {
    const auto& e = o.model.moe;
    const auto h = static_cast<double>(o.model.hidden);
    auto f =
        weight_flops(static_cast<double>(e.experts) * h +
                     static_cast<double>(e.top_k) * 3.0 * static_cast<double>(e.ffn_hidden) * h);
    if (e.shared > 0) f += MlpImpl::flops(o, e.shared * e.ffn_hidden);
    return f;
  }
  /// x [b, s, h] (SP: [b, s/t, h]) -> same.
  torch::Tensor forward(const torch::Tensor& x);
  /// Auxiliary-loss-free balancing, after an optimizer step: `choices` [E] (this layer's, over
  /// the global batch) move the bias by the rate toward the mean.
  void update_balance_bias(const torch::Tensor& choices);
  int64_t index() const { return index_; }  // its place among the model's MoE layers
  torch::Tensor router;                     // [E, h]
  torch::Tensor balance_bias;  // [E] fp32, not trained (model.moe.bias_update_rate; else undefined)
  torch::Tensor gate, up, down;  // [E/ep, f, h], [E/ep, f, h], [E/ep, h, f]
  Mlp shared{nullptr};           // shared experts (one MLP of shared·f), or none

 private:
  /// Dispatched rows, sorted by their expert -> the SwiGLU of each row's expert: grouped matmuls
  /// over the local experts, or, where those would read their offsets on the host
  /// (parallel/ep/dispatch.h grouped_mm_on_device), one matmul per expert on the rows per expert
  /// dispatch() read.
  torch::Tensor experts(const parallel::ep::Dispatched& d) const;
  /// The balance loss's gradient attached to `out`; statistics added to the state.
  torch::Tensor balance(const torch::Tensor& out, const torch::Tensor& scores,
                        const torch::Tensor& chosen, int64_t b, int64_t s);
  MoeShape m_;
  int64_t layer_, index_;  // global layer, and its place among the model's MoE layers
  parallel::Group* tp_;
  parallel::Group* cp_;
  parallel::Group* ep_;
  bool sp_;
  MoeState* state_;
};
TORCH_MODULE(Moe);

}  // namespace tessel::models
