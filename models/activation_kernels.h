// Elementwise CPU loops of the activations (models/activations.h runs them over threads). Plain
// C++ on raw fp32 arrays, free of LibTorch, that GCC vectorises (exp written out), built for
// AVX2+FMA and for the baseline instruction set; the CPU picks one.
#pragma once

#include <cstdint>

namespace tessel::models::kernels {

/// y = GELU with the tanh approximation (GPT-2's "gelu_new"), written x·sigmoid(2u) with
/// u = sqrt(2/pi)·(x + 0.044715·x³): the same function, as 0.5·(1 + tanh u) = sigmoid(2u), with
/// one exp per element instead of a tanh.
void gelu_tanh_forward(const float* x, float* y, int64_t n);
/// dx = dy · d/dx GELU(x), recomputed from x as the forward does.
void gelu_tanh_backward(const float* dy, const float* x, float* dx, int64_t n);

}  // namespace tessel::models::kernels
