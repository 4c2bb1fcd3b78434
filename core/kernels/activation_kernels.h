// Elementwise CPU loops of the activations (core/kernels/activations.h is their user). Plain C++ on
// raw fp32 arrays, free of LibTorch, built for AVX2+FMA (intrinsics) and for the baseline
// instruction set (loops GCC vectorises, exp written out); the CPU picks one. Each call splits its
// elements over LibTorch's intra-op threads (the OpenMP team at::set_num_threads sizes).
#pragma once

#include <cstdint>

namespace tessel::kernels::cpu {

/// y = GELU with the tanh approximation (GPT-2's "gelu_new"), written x·sigmoid(2u) with
/// u = sqrt(2/pi)·(x + 0.044715·x³): the same function, as 0.5·(1 + tanh u) = sigmoid(2u), with
/// one exp per element instead of a tanh.
void gelu_tanh_forward(const float* x, float* y, int64_t n);
/// y as gelu_tanh_forward, and slope = d/dx GELU(x) from the same exp: the backward is then one
/// product, dx = dy·slope.
void gelu_tanh_forward_slope(const float* x, float* y, float* slope, int64_t n);
/// The same of x + bias: x [n / cols, cols] row-major, bias [cols] added to every row first (a
/// linear layer's bias, so that the layer itself runs without one: no copy of it into the output).
void gelu_tanh_bias_forward_slope(const float* x, const float* bias, int64_t cols, float* y,
                                  float* slope, int64_t n);

/// SwiGLU: y = silu(g)·u (Llama's MLP; silu(g) = g·sigmoid(g)).
void swiglu_forward(const float* g, const float* u, float* y, int64_t n);
/// Its gradients from dy and the forward's inputs (sigmoid recomputed: no tensor kept for it).
/// du may be dy itself (each element's dy is read before its du is written).
void swiglu_backward(const float* dy, const float* g, const float* u, float* dg, float* du,
                     int64_t n);

}  // namespace tessel::kernels::cpu
