// Elementwise CPU loops of Llama's RMSNorm and rotary embedding (core/kernels/fused_ops.h is their
// user), on raw fp32 arrays, free of LibTorch. Each is built for AVX2 and for the baseline
// instruction set (the CPU picks one at load time) and splits its rows over LibTorch's intra-op
// threads. Results do not depend on the thread count: rows are independent, and the weight
// gradient is summed over fixed blocks of rows in a fixed order.
#pragma once

#include <cstdint>

namespace tessel::kernels::cpu {

/// y = w · (x · rstd) with rstd = 1/sqrt(mean(x²) + eps) per row; x, y [rows, h], rstd [rows].
void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows,
                      int64_t h, float eps);
/// dx [rows, h] and dw [h] (summed over rows) from dy, given the forward's x, w and rstd.
void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                       float* dx, float* dw, int64_t rows, int64_t h);

/// Rows of d elements in a [b, heads, s, d] tensor with any strides for its first three
/// dimensions (elements; the last dimension contiguous).
struct RopeRows {
  int64_t b, heads, s, d;
  int64_t in_b, in_h, in_s;     // strides of the input
  int64_t out_b, out_h, out_s;  // strides of the output
  int64_t table_b = 0;          // elements between rows' tables (0: one [s, d] table for all)
};
/// Rotate-half rotary embedding with tables cos, sin [s, d] (or one per row, table_b apart):
/// forward o = x·cos + rotate_half(x)·sin (rotate_half(x) = [-x2, x1]); backward (the transpose) dx
/// = dy·cos + [dy2·sin2, -dy1·sin1] rearranged: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 -
/// dy1·sin1.
void rope(const float* x, const float* cos, const float* sin, float* out, const RopeRows& rows,
          bool backward);

}  // namespace tessel::kernels::cpu
