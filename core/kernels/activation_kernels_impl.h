// The loops of core/kernels/activation_kernels.cpp, included there twice: once under
// `#pragma GCC target("avx2,fma")` and once for the baseline instruction set, each time in its own
// namespace. Everything here must be inline in the including namespace so that each copy is
// compiled, inlined and vectorised for its target (a function of another target is never inlined,
// and an exp called per element would not vectorise). No include guard on purpose.

constexpr float kC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kA = 0.044715f;

/// e^x for x in any range: clamped to [-87, 88] first (e^-87 is still a normal float), so
/// 1 + e^x neither overflows nor loses its scale factor. NaN in, NaN out. Range reduction to
/// 2^n·e^r with |r| <= ln2/2 and a degree-7 polynomial: under 2 float ulps.
inline float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : x;  // comparisons with NaN are false: NaN passes through
  x = x > 88.0f ? 88.0f : x;
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f,
                  kLn2Lo = 1.428606765330187045e-06f, kRound = 12582912.0f;  // 1.5·2^23
  const float n = (x * kLog2e + kRound) - kRound;  // round to nearest (no -ffast-math here)
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;   // |r| <= ln2/2
  // e^r by Taylor to r^7/7! (its truncation error under 1.3e-8 for |r| <= ln2/2)
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline void gelu_tanh_forward(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = v * (1.0f / (1.0f + exp_clamped(-2.0f * kC * (v + kA * v * v * v))));  // as below
  }
}

// With `bias` (else null): GELU(x + bias) elementwise, bias as long as x.
inline void gelu_tanh_forward_slope(const float* x, const float* bias, float* y, float* slope,
                                    int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = bias ? x[i] + bias[i] : x[i];
    const float e = exp_clamped(-2.0f * kC * (v + kA * v * v * v));
    const float s = 1.0f / (1.0f + e);  // (1 + tanh u) / 2
    y[i] = v * s;
    slope[i] = s + v * (e * s * s) * (2.0f * kC) * (1.0f + 3.0f * kA * v * v);
  }
}

// SwiGLU: y = silu(g)·u with silu(g) = g·sigmoid(g) = g / (1 + e^-g).
inline void swiglu_forward(const float* g, const float* u, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = g[i];
    y[i] = v / (1.0f + exp_clamped(-v)) * u[i];
  }
}

// dg = dy·u·sigmoid(g)·(1 + g·(1 - sigmoid(g))), du = dy·silu(g).
inline void swiglu_backward(const float* dy, const float* g, const float* u, float* dg, float* du,
                            int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = dy[i], v = g[i], s = 1.0f / (1.0f + exp_clamped(-v));
    du[i] = d * (v * s);  // du may be dy: d is read first
    dg[i] = d * u[i] * (s * (1.0f + v * (1.0f - s)));
  }
}
