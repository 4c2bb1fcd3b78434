// Llama's elementwise layers (RMSNorm, SwiGLU, rotary embedding), each with one owner for its
// kernel choice: with `fused` (training.kernels tessel) and fp32 CPU tensors, Tessel's loops
// (core/kernels/norm_kernels.h, core/kernels/activation_kernels.h) behind one autograd function
// each, which keeps only what its backward reads; otherwise LibTorch's fused kernel where it has
// one (RMSNorm: at::_fused_rms_norm, one pass each way on CUDA), else the composite of LibTorch
// operators, as Hugging Face's Llama writes it. All compute the same function; they differ in
// float rounding only.
#pragma once

#include <torch/types.h>

namespace tessel::kernels {

/// Whether the fused CPU loops take `x` (fp32 on the CPU).
bool fused_cpu(const torch::Tensor& x);

/// RMSNorm as Hugging Face's LlamaRMSNorm: weight · (x · rsqrt(mean(x²) + eps)), statistics in
/// fp32, the scale in the weight's dtype. x [..., h], weight [h].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool fused);

/// SwiGLU: silu(gate) · up.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up, bool fused);

/// Rotate-half rotary embedding (GPT-NeoX / Hugging Face Llama): x [b, heads, s, d] (any layout
/// whose last dimension is contiguous), cos and sin [s, d], or [b, s, d] (each row's own
/// positions: data.document_mask). The result has x's memory layout.
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   bool fused);

}  // namespace tessel::kernels
