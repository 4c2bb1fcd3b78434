// Tessel's own CPU loops (core/kernels: GELU-tanh, SwiGLU, RMSNorm, softmax) against double
// precision, free of LibTorch and of any test framework, so that it builds for another
// architecture with nothing but a cross compiler and runs under qemu-user (tests/cross/aarch64.sh).
// Prints each loop's worst relative error and the SIMD path this build took; exits 1 when any
// error exceeds its bound.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "core/kernels/activation_kernels.h"
#include "core/kernels/norm_kernels.h"
#include "core/kernels/simd.h"
#include "core/kernels/softmax_kernels.h"

namespace {

using tessel::kernels::cpu::ScoreRows;
namespace cpu = tessel::kernels::cpu;

std::vector<float> randn(size_t n, uint32_t seed, float scale = 2.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

struct Worst {
  const char* name;
  double bound, err = 0;
  void see(double got, double want) {
    err = std::max(err, std::fabs(got - want) / std::max(1.0, std::fabs(want)));
  }
};

}  // namespace

int main() {
  // Odd lengths: every loop's vector body and its tail.
  const int64_t n = 4099, rows = 37, h = 64, keys = 45;
  std::vector<Worst> all;

  const auto x = randn(n, 1), g = randn(n, 2), u = randn(n, 3), dy = randn(n, 4);
  std::vector<float> y(n), dg(n), du(n);
  Worst gelu{"gelu_tanh_forward", 2e-6};
  cpu::gelu_tanh_forward(x.data(), y.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    gelu.see(y[i], 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
  }
  all.push_back(gelu);

  Worst swiglu{"swiglu_forward", 2e-6}, swiglu_back{"swiglu_backward", 4e-6};
  cpu::swiglu_forward(g.data(), u.data(), y.data(), n);
  cpu::swiglu_backward(dy.data(), g.data(), u.data(), dg.data(), du.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double a = g[i], s = 1 / (1 + std::exp(-a)), silu = a * s;
    swiglu.see(y[i], silu * u[i]);
    swiglu_back.see(dg[i], dy[i] * u[i] * (s + a * s * (1 - s)));
    swiglu_back.see(du[i], dy[i] * silu);
  }
  all.push_back(swiglu);
  all.push_back(swiglu_back);

  const auto xs = randn(rows * h, 5), w = randn(h, 6, 1.0f);
  std::vector<float> ys(rows * h), rstd(rows);
  Worst norm{"rms_norm_forward", 2e-6};
  cpu::rms_norm_forward(xs.data(), w.data(), ys.data(), rstd.data(), rows, h, 1e-6f);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += double(xs[r * h + j]) * xs[r * h + j];
    const double inv = 1 / std::sqrt(ss / h + 1e-6);
    for (int64_t j = 0; j < h; ++j) norm.see(ys[r * h + j], xs[r * h + j] * inv * w[j]);
  }
  all.push_back(norm);

  auto s = randn(rows * keys, 7);
  const auto s0 = s;
  const ScoreRows score{rows, keys, rows, true, 0.125f};
  Worst soft{"softmax_rows", 2e-6};
  cpu::softmax_rows(s.data(), score);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = std::min<int64_t>(keys, r % rows + 1);
    double mx = -1e300, sum = 0;
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, 0.125 * s0[r * keys + j]);
    for (int64_t j = 0; j < len; ++j) sum += std::exp(0.125 * s0[r * keys + j] - mx);
    for (int64_t j = 0; j < keys; ++j)
      soft.see(s[r * keys + j], j < len ? std::exp(0.125 * s0[r * keys + j] - mx) / sum : 0.0);
  }
  all.push_back(soft);

  bool ok = true;
  std::printf("loops: %s\n", tessel::kernels::simd::has_avx2_fma()
                                 ? "AVX2+FMA intrinsics"
                                 : "portable (vectorised by the compiler for this target)");
  for (const auto& a : all) {
    std::printf("%-20s worst relative error %.2e (bound %.0e)\n", a.name, a.err, a.bound);
    ok = ok && a.err <= a.bound;
  }
  std::printf("%s\n", ok ? "all within their bounds" : "FAILED");
  return ok ? 0 : 1;
}
