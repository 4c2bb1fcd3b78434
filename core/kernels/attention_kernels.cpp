#include "core/kernels/attention_kernels.h"

#include <ATen/Context.h>

#include <algorithm>
#include <vector>

#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/torch.h>

#include "core/kernels/attention_cpu.h"

namespace tessel::kernels {
namespace {

// The memory-efficient CUDA kernel pads its log-sum-exp to a multiple of 32 queries.
constexpr int64_t kLseAlign = 32;

// What SDPA gets: on CUDA in fp32, grouped-query heads expanded (the memory-efficient kernel
// does not take them, flash does not take fp32, and math would hold the whole score matrix).
struct SdpaInputs {
  torch::Tensor k, v;
  bool gqa;
};
SdpaInputs sdpa_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const bool gqa = k.size(1) != q.size(1);
  if (gqa && q.is_cuda() && q.scalar_type() == torch::kFloat32)
    return {expand_heads(k, q.size(1)), expand_heads(v, q.size(1)), false};
  return {k, v, gqa};
}

}  // namespace

torch::Tensor expand_heads(const torch::Tensor& kv, int64_t heads) {
  const int64_t groups = heads / kv.size(1);
  return groups == 1 ? kv : kv.repeat_interleave(groups, 1);
}
torch::Tensor sum_heads(const torch::Tensor& g, int64_t kv_heads) {
  const int64_t groups = g.size(1) / kv_heads;
  if (groups == 1) return g;
  return g.reshape({g.size(0), kv_heads, groups, g.size(2), g.size(3)}).sum(2);
}

torch::Tensor dense_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, bool causal, bool tessel_kernels) {
  if (tessel_kernels && short_attention_applies(q, k, causal))
    return short_attention(q, k, v, causal);
  const auto in = sdpa_inputs(q, k, v);
  return at::scaled_dot_product_attention(q, in.k, in.v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          causal, /*scale=*/std::nullopt, in.gqa);
}

std::string dense_attention_kernel(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, bool causal) {
  const auto in = sdpa_inputs(q, k, v);
  // sdp::SDPBackend's numbering.
  switch (at::_fused_sdp_choice(q, in.k, in.v, {}, 0.0, causal, std::nullopt, in.gqa)) {
    case 0:
      return "math";
    case 1:
      return "flash";
    case 2:
      return "efficient";
    case 3:
      return "cudnn";
    default:
      return "other";
  }
}

std::string planned_attention_kernel(int64_t heads, int64_t kv_heads, int64_t seq_len,
                                     int64_t head_dim, torch::ScalarType dtype,
                                     const torch::Device& device, bool tessel_kernels) {
  if (tessel_kernels && short_attention_applies(device, dtype, seq_len)) return "tessel";
  // At the plan's own length: SDPA's choice may depend on it (cuDNN's attention has limits on
  // sequence lengths). Uninitialised, batch 1, freed at once: the choice reads shapes only.
  const auto o = torch::TensorOptions().dtype(dtype).device(device);
  return dense_attention_kernel(torch::empty({1, heads, seq_len, head_dim}, o),
                                torch::empty({1, kv_heads, seq_len, head_dim}, o),
                                torch::empty({1, kv_heads, seq_len, head_dim}, o), true);
}

void pin_sdpa_order(torch::ScalarType dtype, bool deterministic) {
  // bf16/fp16: cuDNN's attention first (on an H100, forward and backward of Llama-3 1B's causal
  // grouped-query shape took 846 us against flash's 1298 us), then flash, memory-efficient,
  // math. fp32 (neither cuDNN's nor flash's kernels take it): memory-efficient, then math. Set
  // explicitly, so that a LibTorch release changing its defaults does not change the kernel.
  using B = at::SDPBackend;
  const bool half = dtype == torch::kBFloat16 || dtype == torch::kHalf;
  const std::vector<B> order =
      half ? std::vector<B>{B::cudnn_attention, B::flash_attention, B::efficient_attention, B::math,
                            B::overrideable}
           : std::vector<B>{B::efficient_attention, B::math, B::flash_attention, B::cudnn_attention,
                            B::overrideable};
  std::vector<int64_t> ids;
  for (auto b : order)
    if (!(deterministic && b == B::cudnn_attention)) ids.push_back(static_cast<int64_t>(b));
  if (deterministic)
    ids.insert(ids.end() - 1, static_cast<int64_t>(B::cudnn_attention));  // before overrideable
  at::globalContext().setSDPPriorityOrder(ids);
}

torch::Tensor kernel_layout(const torch::Tensor& x) {
  // [b, h, m, d] viewed over [b, m, h, d] memory: a no-op for what the kernels' forward returns.
  return x.transpose(1, 2).contiguous().transpose(1, 2);
}

std::pair<torch::Tensor, torch::Tensor> block_forward(const torch::Tensor& q,
                                                      const torch::Tensor& k,
                                                      const torch::Tensor& v, bool causal) {
  TORCH_CHECK(q.size(1) == k.size(1) && k.sizes() == v.sizes(),
              "block_forward: q, k, v need equal head counts (expand grouped-query heads first)");
  if (q.is_cuda()) {
    auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
        kernel_layout(q), kernel_layout(k), kernel_layout(v), std::nullopt,
        /*compute_log_sumexp=*/true, 0.0, causal);
    return {out, lse.narrow(2, 0, q.size(2))};  // lse: padded to kLseAlign queries
  }
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      kernel_layout(q), kernel_layout(k), kernel_layout(v), 0.0, causal);
  return {out, lse};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> block_backward(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse, bool causal) {
  // `out` is usually not the block's own output but the merge of several blocks (fp32, cast back,
  // concatenated): kernel_layout gives it the memory order the forward would have returned.
  const auto o = kernel_layout(out.to(q.scalar_type()));
  if (q.is_cuda()) {
    const int64_t m = q.size(2), padded = (m + kLseAlign - 1) / kLseAlign * kLseAlign;
    auto full = torch::zeros({lse.size(0), lse.size(1), padded}, lse.options());
    full.narrow(2, 0, m).copy_(lse);
    auto none = torch::zeros({}, q.options().dtype(torch::kInt64));  // no dropout: unused
    auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
        kernel_layout(dout), kernel_layout(q), kernel_layout(k), kernel_layout(v), torch::Tensor(),
        o, full, none, none, 0.0, {true, true, true, false}, causal);
    return {dq, dk, dv};
  }
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      kernel_layout(dout), kernel_layout(q), kernel_layout(k), kernel_layout(v), o,
      lse.contiguous(), 0.0, causal);
}

}  // namespace tessel::kernels
