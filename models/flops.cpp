// The whole model's FLOPs and a block's: each part's declaration (models/flops.h), added up.
#include "models/layers.h"
#include "models/moe.h"

namespace tessel::models {

namespace {
// A block's MLP half past its norm: the MLP, or the experts of an MoE layer.
Flops ffn_flops(const DecoderOptions& o, int64_t layer) {
  return o.model.moe.is_moe(layer) ? MoeImpl::flops(o) : MlpImpl::flops(o, o.model.ffn_hidden);
}
}  // namespace

Flops BlockImpl::flops(const DecoderOptions& o, int64_t layer, int64_t seq, double share) {
  auto f = NormImpl::flops(o, o.model.hidden);
  f += NormImpl::flops(o, o.model.hidden);
  f += AttentionImpl::flops(o, seq, share);
  f += ffn_flops(o, layer);
  return f;
}

double BlockImpl::rerun_flops(const DecoderOptions& o, int64_t layer, plan::Recompute mode,
                              int64_t seq, double share) {
  if (mode == plan::Recompute::kFull) return flops(o, layer, seq, share).forward;
  if (mode != plan::Recompute::kSelective) return 0.0;
  auto half = NormImpl::flops(o, o.model.hidden);
  half += ffn_flops(o, layer);
  return half.forward;
}

Flops DecoderImpl::flops(const DecoderOptions& o, int64_t seq, double share) {
  const auto& m = o.model;
  Flops f;
  for (int64_t i = 0; i < m.layers; ++i) f += BlockImpl::flops(o, i, seq, share);
  f += NormImpl::flops(o, m.hidden);
  f += weight_flops(static_cast<double>(m.vocab_size) * static_cast<double>(m.hidden));
  return f;
}

double DecoderImpl::rerun_flops(const DecoderOptions& o, plan::Recompute mode, int64_t seq,
                                double share) {
  double f = 0;
  for (int64_t i = 0; i < o.model.layers; ++i) f += BlockImpl::rerun_flops(o, i, mode, seq, share);
  return f;
}

namespace {

// One linear layer's reductions: `split` its axis tensor parallelism splits (in or out).
Fp8Reduces linear(kernels::fp8::Recipe r, double tokens, double in, double out, bool split_out) {
  const auto l = kernels::fp8::linear_reduces(r, tokens, in, out);
  return {split_out ? l.out : l.in, l.tokens};
}

// The reductions of a forward alone (what a recomputation reruns).
Fp8Reduces forward_only(Fp8Reduces f) {
  f.tp.backward = f.cp.backward = {};
  return f;
}

}  // namespace

Fp8Reduces AttentionImpl::fp8_reduces(const DecoderOptions& o, double tokens, double tp,
                                      kernels::fp8::Recipe recipe) {
  const auto h = static_cast<double>(o.model.hidden);
  const auto kv = static_cast<double>(o.model.kv_heads * o.model.head_dim());
  auto f = linear(recipe, tokens, h, h / tp, true);  // q
  if (o.model.kv_heads >= static_cast<int64_t>(tp))
    for (int i = 0; i < 2; ++i) f += linear(recipe, tokens, h, kv / tp, true);  // k, v
  f += linear(recipe, tokens, h / tp, h, false);                                // o
  return f;
}

Fp8Reduces MlpImpl::fp8_reduces(const DecoderOptions& o, int64_t ffn, double tokens, double tp,
                                kernels::fp8::Recipe recipe) {
  const auto h = static_cast<double>(o.model.hidden), f = static_cast<double>(ffn) / tp;
  Fp8Reduces r;
  for (int i = 0; i < static_cast<int>(column_matrices(o)); ++i)
    r += linear(recipe, tokens, h, f, true);  // up (and gate)
  r += linear(recipe, tokens, f, h, false);   // down
  return r;
}

namespace {
Fp8Reduces ffn_reduces(const DecoderOptions& o, int64_t layer, double tokens, double tp,
                       kernels::fp8::Recipe recipe) {
  const auto& moe = o.model.moe;
  if (!moe.is_moe(layer)) return MlpImpl::fp8_reduces(o, o.model.ffn_hidden, tokens, tp, recipe);
  if (moe.shared > 0)
    return MlpImpl::fp8_reduces(o, moe.shared * moe.ffn_hidden, tokens, tp, recipe);
  return {};  // the routed experts and the router stay in the model's dtype
}
}  // namespace

Fp8Reduces BlockImpl::fp8_reduces(const DecoderOptions& o, int64_t layer, double tokens, double tp,
                                  kernels::fp8::Recipe recipe) {
  auto f = AttentionImpl::fp8_reduces(o, tokens, tp, recipe);
  f += ffn_reduces(o, layer, tokens, tp, recipe);
  return f;
}

Fp8Reduces BlockImpl::fp8_rerun_reduces(const DecoderOptions& o, int64_t layer, double tokens,
                                        double tp, kernels::fp8::Recipe recipe,
                                        plan::Recompute mode) {
  if (mode == plan::Recompute::kFull)
    return forward_only(fp8_reduces(o, layer, tokens, tp, recipe));
  if (mode == plan::Recompute::kSelective)
    return forward_only(ffn_reduces(o, layer, tokens, tp, recipe));
  return {};
}

}  // namespace tessel::models
