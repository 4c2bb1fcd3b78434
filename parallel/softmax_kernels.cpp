// Compiled with -O3 -fopenmp -fno-trapping-math (CMakeLists.txt), no -ffast-math: NaN propagates.
// On AVX2 each row runs in intrinsics, its last partial vector through masked loads and stores
// (so every element of a row takes the same arithmetic); elsewhere in plain loops with std::exp.
// Rows are independent and each is summed in one fixed order, so the results do not depend on
// the thread count.
#include "parallel/softmax_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "parallel/simd.h"

namespace tessel::parallel::kernels {
namespace {

int64_t keys(const ScoreRows& rows, int64_t r) {
  return rows.causal ? std::min(rows.n, r % rows.m + 1) : rows.n;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

// Lanes [0, k) of a vector set, k in [0, 8].
inline __m256i first_lanes(int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void softmax_row(float* x, int64_t len, int64_t n, float scale) {
  const int64_t full = len / 8 * 8;
  const __m256i tail = first_lanes(len - full);
  const __m256 lowest = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = lowest;
  for (int64_t j = 0; j < full; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + j));
  if (full < len)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(lowest, _mm256_maskload_ps(x + full, tail),
                                            _mm256_castsi256_ps(tail)));
  const __m256 sc = _mm256_set1_ps(scale), shift = _mm256_set1_ps(-scale * hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 e = simd::exp8(_mm256_fmadd_ps(_mm256_loadu_ps(x + j), sc, shift));
    _mm256_storeu_ps(x + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (full < len) {
    const __m256 e =
        _mm256_and_ps(simd::exp8(_mm256_fmadd_ps(_mm256_maskload_ps(x + full, tail), sc, shift)),
                      _mm256_castsi256_ps(tail));
    _mm256_maskstore_ps(x + full, tail, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  for (int64_t j = 0; j < full; j += 8)
    _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), inv));
  if (full < len)
    _mm256_maskstore_ps(x + full, tail, _mm256_mul_ps(_mm256_maskload_ps(x + full, tail), inv));
  std::fill(x + len, x + n, 0.0f);
}

void softmax_backward_row(const float* p, float* dp, int64_t len, int64_t n, float scale) {
  const int64_t full = len / 8 * 8;
  const __m256i tail = first_lanes(len - full);
  __m256 dot = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8)
    dot = _mm256_fmadd_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(dp + j), dot);
  if (full < len)
    dot = _mm256_fmadd_ps(_mm256_maskload_ps(p + full, tail), _mm256_maskload_ps(dp + full, tail),
                          dot);
  const __m256 delta = _mm256_set1_ps(hsum(dot)), sc = _mm256_set1_ps(scale);
  auto grad = [&](__m256 pv, __m256 dv) {
    return _mm256_mul_ps(_mm256_mul_ps(pv, sc), _mm256_sub_ps(dv, delta));
  };
  for (int64_t j = 0; j < full; j += 8)
    _mm256_storeu_ps(dp + j, grad(_mm256_loadu_ps(p + j), _mm256_loadu_ps(dp + j)));
  if (full < len)
    _mm256_maskstore_ps(
        dp + full, tail,
        grad(_mm256_maskload_ps(p + full, tail), _mm256_maskload_ps(dp + full, tail)));
  std::fill(dp + len, dp + n, 0.0f);
}

}  // namespace avx2
#pragma GCC pop_options

namespace baseline {

void softmax_row(float* x, int64_t len, int64_t n, float scale) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < len; ++j) mx = std::max(mx, x[j]);
  float sum = 0;
  for (int64_t j = 0; j < len; ++j) sum += x[j] = std::exp(scale * (x[j] - mx));
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < len; ++j) x[j] *= inv;
  std::fill(x + len, x + n, 0.0f);
}

void softmax_backward_row(const float* p, float* dp, int64_t len, int64_t n, float scale) {
  float delta = 0;
  for (int64_t j = 0; j < len; ++j) delta += p[j] * dp[j];
  for (int64_t j = 0; j < len; ++j) dp[j] = scale * p[j] * (dp[j] - delta);
  std::fill(dp + len, dp + n, 0.0f);
}

}  // namespace baseline

// Rows per thread at least: a row is up to a few hundred elements, a fork costs microseconds.
constexpr int64_t kGrainRows = 64;

}  // namespace

void softmax_rows(float* s, const ScoreRows& rows) {
  const bool vec = simd::has_avx2_fma();
  simd::over_threads(rows.count, kGrainRows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* x = s + r * rows.n;
      if (vec)
        avx2::softmax_row(x, keys(rows, r), rows.n, rows.scale);
      else
        baseline::softmax_row(x, keys(rows, r), rows.n, rows.scale);
    }
  });
}

void softmax_backward_rows(const float* p, float* dp, const ScoreRows& rows) {
  const bool vec = simd::has_avx2_fma();
  simd::over_threads(rows.count, kGrainRows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t off = r * rows.n;
      if (vec)
        avx2::softmax_backward_row(p + off, dp + off, keys(rows, r), rows.n, rows.scale);
      else
        baseline::softmax_backward_row(p + off, dp + off, keys(rows, r), rows.n, rows.scale);
    }
  });
}

}  // namespace tessel::parallel::kernels
