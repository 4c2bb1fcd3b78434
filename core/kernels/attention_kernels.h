// Attention kernels: the one place that chooses which fused kernel runs and in which memory layout
// its inputs and outputs live. Everything that attends (the dense layer in models/, both context-
// parallel methods in parallel/cp) calls these, so a kernel's layout contract is kept in one file.
//
// Dense attention on CPU in fp32 over short sequences runs Tessel's own kernel (attention_cpu.h)
// unless training.kernels says torch. Otherwise it goes through at::scaled_dot_product_attention,
// whose dispatcher picks
// flash (CUDA, bf16/fp16, grouped-query heads natively), memory-efficient (CUDA, any float dtype,
// equal head counts only) or the math kernel (a full [s, s] score matrix). On CUDA, fp32 with
// grouped-query heads would fall to math; K/V heads are expanded for it instead.
//
// Blocks with a log-sum-exp (for merging partial attention over key blocks, as ring attention
// does) use the CPU flash kernel or the CUDA memory-efficient kernel directly. The CUDA backward
// reads `out` with the row stride of the [b, m, h, d] buffer its forward returned (o_strideM is
// derived from the head count, not read from the tensor), so block_backward puts `out` into that
// memory order itself: the backward consumes exactly the layout the forward produces.
#pragma once

#include <torch/types.h>

#include <string>
#include <tuple>
#include <utility>

namespace tessel::kernels {

/// x [b, h, m, d] as a view over [b, m, h, d] memory (what the fused kernels' forward returns);
/// no copy when it already is.
torch::Tensor kernel_layout(const torch::Tensor& x);

/// Key/value heads repeated for the query heads that share them (SDPA's enable_gqa order):
/// kv [b, kv_heads, n, d] -> [b, heads, n, d].
torch::Tensor expand_heads(const torch::Tensor& kv, int64_t heads);
/// The inverse for gradients: g [b, heads, n, d] summed over each group -> [b, kv_heads, n, d].
torch::Tensor sum_heads(const torch::Tensor& g, int64_t kv_heads);

/// Dense attention: q [b, heads, m, d] against k, v [b, kv_heads, n, d] (heads a multiple of
/// kv_heads); causal aligned top-left (use it with m == n, or causal false). Differentiable.
/// tessel_kernels (training.kernels tessel): Tessel's own kernel where it applies
/// (core/kernels/attention_cpu.h: CPU, fp32, short sequences), SDPA otherwise.
torch::Tensor dense_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, bool causal, bool tessel_kernels);
/// The SDPA backend dense_attention gets for these inputs: "flash", "efficient", "cudnn", "math"
/// (from at::_fused_sdp_choice on exactly the tensors it passes; the GPU tests assert it).
std::string dense_attention_kernel(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, bool causal);

/// The kernel dense_attention gets for a plan's attention: `heads` query and `kv_heads` key/value
/// heads (one tp rank's), head size `head_dim`, a causal sequence of `seq_len` tokens, in `dtype`
/// on `device`: "tessel" (Tessel's short-sequence CPU kernel) or SDPA's choice (probed at
/// `seq_len`, batch 1: the choice may depend on the length).
std::string planned_attention_kernel(int64_t heads, int64_t kv_heads, int64_t seq_len,
                                     int64_t head_dim, torch::ScalarType dtype,
                                     const torch::Device& device, bool tessel_kernels);

/// SDPA's backend order on CUDA for a run in `dtype`, set explicitly (the start-up calls it before
/// planned_attention_kernel): bf16/fp16 cuDNN, flash, memory-efficient, math; fp32
/// memory-efficient, math. `deterministic` (training.deterministic): cuDNN's attention last,
/// after math (its backward does not repeat bitwise; PyTorch's strict deterministic mode leaves
/// it out as well).
void pin_sdpa_order(torch::ScalarType dtype, bool deterministic = false);

/// One block of attention and its log-sum-exp: q [b, h, m, d] against k, v [b, h, n, d] (equal
/// head counts; causal: m == n and the block is on the diagonal). Returns (out [b, h, m, d] in
/// q's dtype, over [b, m, h, d] memory; lse [b, h, m] fp32).
std::pair<torch::Tensor, torch::Tensor> block_forward(const torch::Tensor& q,
                                                      const torch::Tensor& k,
                                                      const torch::Tensor& v, bool causal);
/// Its gradients (dq, dk, dv) given the gradient of the final output and the final out and lse
/// of these queries (after merging every key block; any layout, any float dtype).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> block_backward(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse, bool causal);

}  // namespace tessel::kernels
