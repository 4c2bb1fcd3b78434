// What Tessel's own CPU loops share (core/kernels/activation_kernels.cpp,
// core/kernels/softmax_kernels.cpp): whether this build carries AVX2+FMA loops, an 8-lane e^x in
// those intrinsics, the CPU check that picks them, and the split of a loop over LibTorch's
// intra-op threads. Include it only from files built with -fopenmp (their CMake properties say
// so): ATen's at::parallel_for runs serially in files built without it.
#pragma once

// The one place that says which loops a build carries. x86-64: the AVX2+FMA intrinsics beside the
// portable loops, one picked at run time by has_avx2_fma(). Any other architecture (aarch64:
// Grace): the portable loops alone, plain C++ that the compiler vectorises for the target's own
// SIMD (NEON/ASIMD, the aarch64 baseline), and has_avx2_fma() false.
#if defined(__x86_64__)
#define TESSEL_AVX2_LOOPS 1
#include <immintrin.h>
#else
#define TESSEL_AVX2_LOOPS 0
#endif
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace tessel::kernels::simd {

#if TESSEL_AVX2_LOOPS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
/// e^x in eight lanes for x in any range: clamped to [-87, 88] first (e^-87 is still a normal
/// float), range reduction to 2^n·e^r with |r| <= ln2/2, a degree-7 polynomial: under 2 float
/// ulps. NaN in, NaN out (max and min return x when it is NaN). Callable from functions built
/// for AVX2+FMA (the same target), where it inlines.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#pragma GCC pop_options
#endif

/// Whether this CPU runs the AVX2+FMA loops (checked once); false where the build carries none.
inline bool has_avx2_fma() {
#if TESSEL_AVX2_LOOPS
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

/// f(begin, end) over [0, n) split into contiguous ranges, one per thread of the OpenMP team that
/// LibTorch's intra-op threads are (the same runtime, linked from LibTorch's own library; its size
/// set by at::set_num_threads), each at least `grain` long, its bounds multiples of `align`
/// (so that vector lanes fall the same way whatever the thread count). As ATen's parallel_for
/// does, no num_threads clause (it makes GOMP rebuild its pool when sizes differ).
template <class F>
void over_threads(int64_t n, int64_t grain, int64_t align, const F& f) {
  if (n <= grain || omp_in_parallel()) return f(0, n);
#pragma omp parallel
  {
    const int64_t threads = std::min<int64_t>(omp_get_num_threads(), (n + grain - 1) / grain);
    const int64_t t = omp_get_thread_num();
    const int64_t chunk = ((n + threads - 1) / threads + align - 1) / align * align;
    const int64_t b = std::min(n, t * chunk), e = std::min(n, b + chunk);
    if (t < threads && b < e) f(b, e);
  }
}

}  // namespace tessel::kernels::simd
