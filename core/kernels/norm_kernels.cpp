// Compiled with -O3 -fopenmp -fno-trapping-math (CMakeLists.txt), no -ffast-math. The loops are
// plain C++ that GCC vectorises; `target_clones` builds each for AVX2 and for the baseline.
#include "core/kernels/norm_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/kernels/simd.h"

namespace tessel::kernels::cpu {
namespace {

// Rows of a block whose weight-gradient share is summed together (and rows per thread at least).
constexpr int64_t kBlockRows = 32;

#if TESSEL_AVX2_LOOPS  // built for AVX2 and the baseline, picked at load (core/kernels/simd.h)
#define TESSEL_CLONES __attribute__((target_clones("avx2", "default")))
#else  // one build, vectorised for the target's own SIMD
#define TESSEL_CLONES
#endif

TESSEL_CLONES void norm_rows(const float* x, const float* w, float* y, float* rstd, int64_t first,
                             int64_t end, int64_t h, float eps) {
  for (int64_t r = first; r < end; ++r) {
    const float* xr = x + r * h;
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < h; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    rstd[r] = inv;
    float* yr = y + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

// dx for rows [first, end) and the block's dw share (dw_block [h], overwritten).
TESSEL_CLONES void norm_grad_rows(const float* dy, const float* x, const float* w,
                                  const float* rstd, float* dx, float* dw_block, int64_t first,
                                  int64_t end, int64_t h) {
  std::fill(dw_block, dw_block + h, 0.0f);
  for (int64_t r = first; r < end; ++r) {
    const float *dyr = dy + r * h, *xr = x + r * h;
    const float inv = rstd[r];
    float dot = 0;  // sum_j dy_j·w_j·x_j
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < h; ++j) dot += dyr[j] * w[j] * xr[j];
    const float k = inv * inv * inv * dot / static_cast<float>(h);
    float* dxr = dx + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      dxr[j] = inv * (dyr[j] * w[j]) - k * xr[j];
      dw_block[j] += dyr[j] * (xr[j] * inv);
    }
  }
}

TESSEL_CLONES void sum_blocks(const float* blocks, int64_t count, int64_t h, float* out) {
  std::copy(blocks, blocks + h, out);
  for (int64_t i = 1; i < count; ++i) {
    const float* b = blocks + i * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) out[j] += b[j];
  }
}

TESSEL_CLONES void rope_row(const float* x, const float* c, const float* s, float* o, int64_t d,
                            bool backward) {
  const int64_t half = d / 2;
  const float *x1 = x, *x2 = x + half, *c1 = c, *c2 = c + half, *s1 = s, *s2 = s + half;
  float *o1 = o, *o2 = o + half;
  if (!backward) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      o1[i] = a * c1[i] - b * s1[i];
      o2[i] = b * c2[i] + a * s2[i];
    }
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x1[i], b = x2[i];
    o1[i] = a * c1[i] + b * s2[i];
    o2[i] = b * c2[i] - a * s1[i];
  }
}

}  // namespace

void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows,
                      int64_t h, float eps) {
  simd::over_threads(rows, kBlockRows, 1,
                     [&](int64_t b, int64_t e) { norm_rows(x, w, y, rstd, b, e, h, eps); });
}

void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                       float* dx, float* dw, int64_t rows, int64_t h) {
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<float> shares(static_cast<size_t>(std::max<int64_t>(blocks, 1) * h), 0.0f);
  // Whole blocks per thread: each block's share is summed by one thread, in row order.
  simd::over_threads(blocks, 1, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      norm_grad_rows(dy, x, w, rstd, dx, shares.data() + i * h, i * kBlockRows,
                     std::min(rows, (i + 1) * kBlockRows), h);
  });
  sum_blocks(shares.data(), blocks, h, dw);
}

void rope(const float* x, const float* cos, const float* sin, float* out, const RopeRows& r,
          bool backward) {
  const int64_t per_b = r.heads * r.s;
  simd::over_threads(r.b * per_b, 64, 1, [&](int64_t first, int64_t end) {
    for (int64_t i = first; i < end; ++i) {
      const int64_t bi = i / per_b, hi = (i / r.s) % r.heads, si = i % r.s;
      const int64_t table = bi * r.table_b + si * r.d;
      rope_row(x + bi * r.in_b + hi * r.in_h + si * r.in_s, cos + table, sin + table,
               out + bi * r.out_b + hi * r.out_h + si * r.out_s, r.d, backward);
    }
  });
}

}  // namespace tessel::kernels::cpu
