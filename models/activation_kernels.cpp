// Compiled with -O3 -fopenmp-simd -fno-trapping-math (CMakeLists.txt): the loops vectorise because
// exp is written out (models/activation_kernels_impl.h) and the clamps become vector selects; IEEE
// arithmetic is kept (no -ffast-math), so NaN propagates. The loops are built twice, for AVX2+FMA
// and for the baseline, and the CPU picks one at the first call.
#include "models/activation_kernels.h"

#include <cstdint>
#include <cstring>

namespace tessel::models::kernels {

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "models/activation_kernels_impl.h"
}  // namespace avx2
#pragma GCC pop_options

namespace baseline {
#include "models/activation_kernels_impl.h"
}  // namespace baseline

namespace {
bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
}  // namespace

void gelu_tanh_forward(const float* x, float* y, int64_t n) {
  if (has_avx2_fma()) return avx2::gelu_tanh_forward(x, y, n);
  baseline::gelu_tanh_forward(x, y, n);
}

void gelu_tanh_backward(const float* dy, const float* x, float* dx, int64_t n) {
  if (has_avx2_fma()) return avx2::gelu_tanh_backward(dy, x, dx, n);
  baseline::gelu_tanh_backward(dy, x, dx, n);
}

}  // namespace tessel::models::kernels
