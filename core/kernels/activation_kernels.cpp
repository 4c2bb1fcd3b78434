// Compiled with -O3 -fopenmp-simd -fno-trapping-math (CMakeLists.txt): the loops vectorise because
// exp is written out (core/kernels/activation_kernels_impl.h) and the clamps become vector selects;
// IEEE arithmetic is kept (no -ffast-math), so NaN propagates. The loops are built twice, for
// AVX2+FMA and for the baseline, and the CPU picks one at the first call; on AVX2 the bulk runs in
// the intrinsics below, the tails in the loops. Compiled with -fopenmp too: the threads are split
// here, because ATen's at::parallel_for runs serially in a file compiled without it.
#include "core/kernels/activation_kernels.h"

#include <cstdint>
#include <cstring>

#include "core/kernels/simd.h"

namespace tessel::kernels::cpu {

#if TESSEL_AVX2_LOOPS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "core/kernels/activation_kernels_impl.h"

// The same arithmetic as the loops above, eight lanes at a time in AVX2 intrinsics: GCC's
// vectorisation of the forward loop kept both arms of the clamps and a second division
// (2.2 ms against 0.57 ms for 786K elements on one core of an AMD EPYC). The tails go to the
// loops above.
using simd::exp8;

// e^(-2u), u = sqrt(2/pi)·(x + 0.044715·x³), the products in the loops' order.
inline __m256 exp_minus_2u(__m256 v) {
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(kA), v), v), v);
  return exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f * kC), _mm256_add_ps(v, cube)));
}

void gelu_tanh_forward_vec(const float* x, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp_minus_2u(v)));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(v, s));  // x·s, as gelu_tanh_forward_slope_vec
  }
  gelu_tanh_forward(x + i, y + i, n - i);
}

// d/dx (x·s) = s + x·s(1-s)·2c(1 + 3a·x²), with s(1-s) = e·s² (no cancellation as s -> 1)
inline __m256 gelu_slope(__m256 v, __m256 e, __m256 s) {
  const __m256 es2 = _mm256_mul_ps(_mm256_mul_ps(e, s), s);
  const __m256 slope = _mm256_add_ps(_mm256_set1_ps(1.0f),
                                     _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(3.0f * kA), v), v));
  return _mm256_add_ps(
      s, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(v, es2), _mm256_set1_ps(2.0f * kC)), slope));
}

template <bool kBias>
void gelu_tanh_forward_slope_vec(const float* x, const float* bias, float* y, float* slope,
                                 int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    if constexpr (kBias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
    const __m256 e = exp_minus_2u(v);
    const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(v, s));
    _mm256_storeu_ps(slope + i, gelu_slope(v, e, s));
  }
  gelu_tanh_forward_slope(x + i, kBias ? bias + i : nullptr, y + i, slope + i, n - i);
}

void swiglu_forward_vec(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  swiglu_forward(g + i, u + i, y + i, n - i);
}

void swiglu_backward_vec(const float* dy, const float* g, const float* u, float* dg, float* du,
                         int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i), d = _mm256_loadu_ps(dy + i);
    const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v))));
    _mm256_storeu_ps(du + i, _mm256_mul_ps(d, _mm256_mul_ps(v, s)));
    const __m256 slope =
        _mm256_mul_ps(s, _mm256_add_ps(one, _mm256_mul_ps(v, _mm256_sub_ps(one, s))));
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + i)), slope));
  }
  swiglu_backward(dy + i, g + i, u + i, dg + i, du + i, n - i);
}

}  // namespace avx2
#pragma GCC pop_options
#endif

namespace baseline {
#include "core/kernels/activation_kernels_impl.h"
}  // namespace baseline

namespace {
using simd::has_avx2_fma;

void forward_serial(const float* x, float* y, int64_t n) {
#if TESSEL_AVX2_LOOPS
  if (has_avx2_fma()) return avx2::gelu_tanh_forward_vec(x, y, n);
#endif
  baseline::gelu_tanh_forward(x, y, n);
}

void forward_slope_serial(const float* x, const float* bias, float* y, float* slope, int64_t n) {
#if TESSEL_AVX2_LOOPS
  if (has_avx2_fma())
    return bias ? avx2::gelu_tanh_forward_slope_vec<true>(x, bias, y, slope, n)
                : avx2::gelu_tanh_forward_slope_vec<false>(x, nullptr, y, slope, n);
#endif
  baseline::gelu_tanh_forward_slope(x, bias, y, slope, n);
}

// Elements per thread at least: below this a fork costs more than the loop. Chunks of whole
// 8-lane vectors: every element but the array's own tail takes the same vector arithmetic
// whatever the thread count, so the result does not depend on it.
constexpr int64_t kGrain = 1 << 15, kAlign = 64;

template <class F>
void over_threads(int64_t n, const F& f) {
  simd::over_threads(n, kGrain, kAlign, f);
}
}  // namespace

void swiglu_forward(const float* g, const float* u, float* y, int64_t n) {
  over_threads(n, [&](int64_t b, int64_t e) {
#if TESSEL_AVX2_LOOPS
    if (has_avx2_fma()) return avx2::swiglu_forward_vec(g + b, u + b, y + b, e - b);
#endif
    baseline::swiglu_forward(g + b, u + b, y + b, e - b);
  });
}

void swiglu_backward(const float* dy, const float* g, const float* u, float* dg, float* du,
                     int64_t n) {
  over_threads(n, [&](int64_t b, int64_t e) {
#if TESSEL_AVX2_LOOPS
    if (has_avx2_fma())
      return avx2::swiglu_backward_vec(dy + b, g + b, u + b, dg + b, du + b, e - b);
#endif
    baseline::swiglu_backward(dy + b, g + b, u + b, dg + b, du + b, e - b);
  });
}

void gelu_tanh_forward(const float* x, float* y, int64_t n) {
  over_threads(n, [&](int64_t b, int64_t e) { forward_serial(x + b, y + b, e - b); });
}

void gelu_tanh_forward_slope(const float* x, float* y, float* slope, int64_t n) {
  over_threads(n, [&](int64_t b, int64_t e) {
    forward_slope_serial(x + b, nullptr, y + b, slope + b, e - b);
  });
}

void gelu_tanh_bias_forward_slope(const float* x, const float* bias, int64_t cols, float* y,
                                  float* slope, int64_t n) {
  // Whole rows per thread, each from its first column: every element takes the same arithmetic
  // (vector or tail loop) whatever the thread count.
  simd::over_threads(n, kGrain, cols, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; i += cols) forward_slope_serial(x + i, bias, y + i, slope + i, cols);
  });
}

}  // namespace tessel::kernels::cpu
