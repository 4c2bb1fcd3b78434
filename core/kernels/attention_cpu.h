// Tessel's own attention for short sequences on CPU, fp32. On AVX2 with head sizes a multiple of
// 8, each head in one pass of register-tiled loops (core/kernels/softmax_kernels.h: scores up to
// the causal diagonal, softmax per row, the weighted values), reading q, k, v where the projections
// wrote them and writing in the layout the output projection reads. Otherwise the scores of each
// head as one batched matmul, softmax (or its backward) in one pass over each row, the output as
// a second batched matmul. LibTorch's CPU flash kernel works in blocks sized for long
// sequences; at a few hundred keys and head sizes of 32-64 it runs its matmuls far below the
// machine's rate, while two batched matmuls over whole [m, n] score matrices run at it. The
// probabilities [b, heads, m, n] are held for backward (fp32: 4·heads·n bytes per token), which
// is what limits this kernel to short sequences (kShortAttentionKeys).
#pragma once

#include <torch/types.h>

#include <tuple>
#include <utility>

namespace tessel::kernels {

/// Keys per query up to which short_attention applies.
constexpr int64_t kShortAttentionKeys = 256;

/// Whether short_attention takes attention over `keys` keys in `dtype` on `device`.
bool short_attention_applies(const torch::Device& device, torch::ScalarType dtype, int64_t keys);
/// Bytes per query token it keeps for backward beyond what SDPA's kernels would, over `keys` keys
/// in `dtype` with `heads` query heads: each head's fp32 probabilities, rows padded to 8 keys;
/// 0 where it does not apply (the plan's --dry-run adds it per block).
inline double short_attention_kept_bytes(torch::ScalarType dtype, int64_t keys, int64_t heads) {
  if (!short_attention_applies(torch::kCPU, dtype, keys)) return 0;
  return 4.0 * static_cast<double>(heads) * static_cast<double>((keys + 7) / 8 * 8);
}
/// Whether it takes q [b, heads, m, d] against k [b, kv_heads, n, d] (heads a multiple of
/// kv_heads; causal only with m == n).
bool short_attention_applies(const torch::Tensor& q, const torch::Tensor& k, bool causal);

/// What backward reads. With the fused head loops (AVX2, head size a multiple of 8): q, k, v as
/// given and the probabilities [b, heads, m, n rounded up to 8]. Otherwise the operands as batched
/// matrices over the b·kv_heads key/value heads (the query heads sharing one stacked:
/// q [b·kv_heads, groups·m, d], k and v [b·kv_heads, n, d]) and the probabilities
/// [b·kv_heads, groups·m, n].
struct ShortAttentionSaved {
  torch::Tensor q, k, v, probs;
};

/// out [b, heads, m, d] and what backward needs. causal: aligned top-left.
std::pair<torch::Tensor, ShortAttentionSaved> short_attention_forward(const torch::Tensor& q,
                                                                      const torch::Tensor& k,
                                                                      const torch::Tensor& v,
                                                                      bool causal);
/// (dq [b, heads, m, d], dk, dv [b, kv_heads, n, d]) from the gradient of out.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> short_attention_backward(
    const torch::Tensor& dout, const ShortAttentionSaved& saved, bool causal);

/// The differentiable attention (forward alone when no gradient is wanted).
torch::Tensor short_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, bool causal);

}  // namespace tessel::kernels
