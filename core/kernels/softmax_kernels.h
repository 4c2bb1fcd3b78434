// The row loops of Tessel's CPU attention for short sequences (core/kernels/attention_cpu.h is
// their user): softmax over score rows and its backward, in place, on raw fp32 arrays, free of
// LibTorch. Built for AVX2+FMA (intrinsics) and for the baseline instruction set; the CPU picks
// one. Each call splits its rows over LibTorch's intra-op threads.
#pragma once

#include <cstdint>

namespace tessel::kernels::cpu {

/// The rows of a score tensor [batches, rows, n] (rows·batches rows of n floats, contiguous).
/// Row r attends to keys [0, len(r)): every key when not causal, else keys 0..(r mod m) (query
/// r mod m of a block of m queries on the diagonal; grouped heads stack such blocks).
struct ScoreRows {
  int64_t count;  // rows in all
  int64_t n;      // keys per row
  int64_t m;      // queries per block (causal rows)
  bool causal;
  float scale;  // the scores' factor (1/sqrt(head size))
};

/// s <- softmax(scale·s) over each row's keys, 0 past them.
void softmax_rows(float* s, const ScoreRows& rows);
/// dp <- scale·p·(dp - sum_j p_j·dp_j) over each row's keys, 0 past them: the gradient of the
/// unscaled scores given p = softmax(scale·s) and dp the gradient of p.
void softmax_backward_rows(const float* p, float* dp, const ScoreRows& rows);

/// A [b, heads, s, d] tensor's memory: element strides of its batch, head and position (its last
/// dimension contiguous).
struct HeadsConst {
  const float* data;
  int64_t sb, sh, ss;
};
struct HeadsOut {
  float* data;
  int64_t sb, sh, ss;
};
/// Attention of q [b, heads, m, d] against k, v [b, kv_heads, n, d] (the query heads of one key
/// head adjacent, SDPA's grouped-query order); causal: m == n, aligned top-left.
struct AttentionDims {
  int64_t b, heads, kv_heads, m, n, d;
  bool causal;
  float scale;
};

/// Whether the fused head loops below run for head size d here (AVX2+FMA, d a multiple of 8).
bool head_loops_apply(int64_t d);
/// The probabilities' row length for n keys (rounded up to 8; the padding is 0).
int64_t padded_keys(int64_t n);

/// Each head in one pass: its scores against the keys (transposed once per key head, causal
/// rows computed only up to their diagonal block), each row's softmax, the weighted sum of the
/// values; `out` written, `probs` [b, heads, m, padded_keys(n)] kept for backward.
void attention_forward(const AttentionDims& a, const HeadsConst& q, const HeadsConst& k,
                       const HeadsConst& v, const HeadsOut& out, float* probs);
/// dq, dk, dv from dout and the forward's probabilities: per key head, dV += Pᵀ·dO,
/// dS = softmax'(P, dO·Vᵀ), dQ = dS·K, dK += dSᵀ·Q over its query heads.
void attention_backward(const AttentionDims& a, const HeadsConst& dout, const HeadsConst& q,
                        const HeadsConst& k, const HeadsConst& v, const float* probs,
                        const HeadsOut& dq, const HeadsOut& dk, const HeadsOut& dv);

}  // namespace tessel::kernels::cpu
