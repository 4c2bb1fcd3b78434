// Adding a 16-bit gradient into its fp32 accumulator (mixed-precision training's fold of a
// micro-batch's bf16/fp16 gradients), with no temporary: LibTorch's CPU operators cast a
// mixed-dtype input to a full-size copy first (4 bytes per element, the size of the whole flat
// gradient at the end of every micro-batch's backward); CUDA's cast inside the kernel.
#pragma once

#include <torch/types.h>

namespace tessel::kernels {

/// dst += src, in dst's dtype. dst fp32 and contiguous; src the same shape, any floating dtype.
/// Each element is rounded once, as dst.add_(src) rounds it: the same bits.
void add_widened(const torch::Tensor& dst, const torch::Tensor& src);

}  // namespace tessel::kernels
