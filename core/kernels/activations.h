// Activations of the decoders with one owner for the kernel choice: fp32 on the CPU runs Tessel's
// vectorised loops (core/kernels/activation_kernels.h) over LibTorch's intra-op threads, everything
// else (CUDA, bf16, fp16) LibTorch's fused kernels. Gradients flow through either.
#pragma once

#include <torch/types.h>

namespace tessel::kernels {

/// GELU, tanh approximation (GPT-2). On fp32 CPU tensors Tessel's kernel: about 2x LibTorch's
/// torch::gelu(x, "tanh") forward and backward inside a step, equal to it within a few float
/// ulps (docs/performance.md).
torch::Tensor gelu_tanh(const torch::Tensor& x);

/// Tessel's CPU kernel itself, without autograd (`x` fp32 on the CPU): GELU(x), and GELU'(x) into
/// `slope` when given (from the same exp; what the autograd function keeps for backward).
torch::Tensor gelu_tanh_cpu(const torch::Tensor& x, torch::Tensor* slope = nullptr);

/// GELU(x + bias), `bias` [x.size(-1)]: a linear layer's bias fused into the activation (the layer
/// runs without it). On fp32 CPU tensors one pass of Tessel's kernel, the bias's gradient the
/// column sum of x's; elsewhere torch::gelu(x + bias).
torch::Tensor bias_gelu_tanh(const torch::Tensor& x, const torch::Tensor& bias);
/// Its CPU kernel without autograd: GELU(x + bias), and its slope into `slope`.
torch::Tensor bias_gelu_tanh_cpu(const torch::Tensor& x, const torch::Tensor& bias,
                                 torch::Tensor* slope);

/// Whether a custom autograd function's backward may overwrite its incoming gradient `g`: nothing
/// else holds it (its tensor held only by the engine's list and the node's copy of it, LibTorch's
/// CppNode::apply; its storage by that tensor alone), and it is contiguous with `sizes`. The
/// next linear's input gradient, just written, is; a caller's tensor or a gradient shared with
/// another branch is not (tests/unit/activation_test.cpp).
bool sole_gradient(const torch::Tensor& g, at::IntArrayRef sizes);

/// Whether gelu_tanh runs Tessel's CPU loops for `x` (else torch::gelu).
bool gelu_tanh_uses_cpu_kernel(const torch::Tensor& x);

}  // namespace tessel::kernels
