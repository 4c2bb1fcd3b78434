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

}  // namespace tessel::models
