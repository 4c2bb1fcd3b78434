// Checks of core/kernels/attention_kernels.h shared by the unit tests (CPU) and the GPU suite
// (CUDA): the log-sum-exp block kernels, forward and backward, and attention inside documents
// (core/kernels/document_attention.h), against autograd through plain attention written out in
// fp64 (softmax(q·kᵀ/√d + mask)·v) from the same rounded inputs.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "core/kernels/attention_kernels.h"
#include "core/kernels/document_attention.h"

namespace tessel::testing {

struct BlockCase {
  torch::Device device;
  torch::ScalarType dtype;
  bool causal;
  int64_t kv_heads;  // query heads: 4
  int64_t head_dim;
};

inline std::string case_name(const BlockCase& c) {
  return std::string(c.device.is_cuda() ? "cuda" : "cpu") +
         (c.dtype == torch::kFloat32 ? "_fp32" : "_bf16") + (c.causal ? "_causal" : "_full") +
         "_kv" + std::to_string(c.kv_heads) + "_d" + std::to_string(c.head_dim);
}

// Plain attention in fp64 with autograd; queries are the last m of the n keys' positions
// (bottom-right causal alignment, as a diagonal block preceded by earlier keys).
inline torch::Tensor plain_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, bool causal) {
  const int64_t m = q.size(2), n = k.size(2), groups = q.size(1) / k.size(1);
  auto kk = k.repeat_interleave(groups, 1), vv = v.repeat_interleave(groups, 1);
  auto s = torch::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) {
    auto opts = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
    auto allowed =
        torch::arange(n, opts).unsqueeze(0) <= (torch::arange(m, opts) + (n - m)).unsqueeze(1);
    s = s.masked_fill(allowed.logical_not(), -INFINITY);
  }
  return torch::matmul(torch::softmax(s, -1), vv);
}

// Queries of one chunk (m) against `past` earlier keys (one unmasked block) and their own chunk
// (a causal diagonal block) when causal; against one unmasked block of m keys otherwise. The
// blocks are merged in fp32 and cast back, and the merged output is handed to block_backward in
// [b, h, m, d]-contiguous memory: the layout the CUDA kernel would misread without
// kernel_layout.
inline void check_block_kernels(const BlockCase& c) {
  torch::manual_seed(1234);
  const int64_t b = 2, heads = 4, m = 48, past = c.causal ? 80 : 0, n = past + m, d = c.head_dim;
  auto opts = torch::TensorOptions().dtype(c.dtype).device(c.device);
  auto q = torch::randn({b, heads, m, d}, opts), k = torch::randn({b, c.kv_heads, n, d}, opts),
       v = torch::randn({b, c.kv_heads, n, d}, opts), dy = torch::randn({b, heads, m, d}, opts);
  // Reference: fp64 autograd from the same (rounded) values.
  auto q64 = q.to(torch::kFloat64).requires_grad_(), k64 = k.to(torch::kFloat64).requires_grad_(),
       v64 = v.to(torch::kFloat64).requires_grad_();
  auto ref = plain_attention(q64, k64, v64, c.causal);
  ref.backward(dy.to(torch::kFloat64));

  auto kx = kernels::expand_heads(k, heads), vx = kernels::expand_heads(v, heads);
  auto [o_diag, l_diag] =
      kernels::block_forward(q, kx.narrow(2, past, m), vx.narrow(2, past, m), c.causal);
  auto out = o_diag.to(torch::kFloat32), lse = l_diag;
  if (past > 0) {
    auto [o_past, l_past] =
        kernels::block_forward(q, kx.narrow(2, 0, past), vx.narrow(2, 0, past), false);
    auto merged = torch::logaddexp(lse, l_past);
    out = out * (lse - merged).exp().unsqueeze(-1) +
          o_past.to(torch::kFloat32) * (l_past - merged).exp().unsqueeze(-1);
    lse = merged;
  }
  auto y = out.to(c.dtype).contiguous();  // [b, h, m, d] memory, not the kernel's
  auto dq = torch::zeros({b, heads, m, d}, opts.dtype(torch::kFloat32));
  auto dk = torch::zeros({b, heads, n, d}, dq.options()), dv = torch::zeros_like(dk);
  auto add = [&](int64_t from, int64_t len, bool causal) {
    auto [gq, gk, gv] = kernels::block_backward(dy, q, kx.narrow(2, from, len),
                                                vx.narrow(2, from, len), y, lse, causal);
    dq.add_(gq);
    dk.narrow(2, from, len).add_(gk);
    dv.narrow(2, from, len).add_(gv);
  };
  add(past, m, c.causal);
  if (past > 0) add(0, past, false);

  // fp32: kernel rounding only; bf16: inputs are exact in both, the kernels round their products
  // and P to bf16 (8 bits), the reference does not.
  const double tol = c.dtype == torch::kFloat32 ? 2e-5 : 3e-2;
  auto check = [&](const char* what, const torch::Tensor& got, const torch::Tensor& want) {
    auto g64 = got.to(torch::kFloat64).cpu(), w64 = want.cpu();
    const double err = (g64 - w64).abs().max().item<double>();
    const double scale = std::max(1.0, w64.abs().max().item<double>());
    EXPECT_LE(err / scale, tol) << case_name(c) << ": " << what << " differs by " << err
                                << " (largest magnitude " << scale << ")";
  };
  check("out", y, ref.detach());
  EXPECT_EQ(lse.scalar_type(), torch::kFloat32);
  check("dq", dq, q64.grad());
  check("dk", kernels::sum_heads(dk, c.kv_heads), k64.grad());
  check("dv", kernels::sum_heads(dv, c.kv_heads), v64.grad());
}

// Every combination the issue asks for on one device.
inline std::vector<BlockCase> block_cases(const torch::Device& device) {
  std::vector<BlockCase> out;
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (bool causal : {true, false})
      for (int64_t kv : {4, 2, 1})
        for (int64_t d : {16, 40, 72}) out.push_back({device, dtype, causal, kv, d});
  return out;
}

// Attention inside documents on `device` in `dtype` (fp32: CPU per-document calls, CUDA's
// memory-efficient variable-length kernel; bf16: CUDA's flash variable-length kernel), grouped-
// query heads, two rows of 48 tokens cut into documents of 1 to 30 tokens, against plain
// attention with the block-diagonal causal mask in fp64: output and the three gradients.
inline void check_document_attention(const torch::Device& device, torch::ScalarType dtype,
                                     bool tessel_kernels) {
  SCOPED_TRACE(device.str() + (dtype == torch::kFloat32 ? " fp32" : " bf16"));
  torch::manual_seed(11);
  const int64_t b = 2, t = 48, heads = 4, kv = 2, d = 32, eod = 7;
  auto tokens = torch::randint(8, 100, {b, t}, torch::kInt64);
  for (int64_t at : {0, 4, 34}) tokens[0][at] = eod;  // row 0: documents of 1, 4, 30, 13 tokens
  tokens[1][20] = eod;                                // row 1: 21 and 27
  const auto docs = kernels::find_documents(tokens, eod, device);
  ASSERT_EQ(docs.count(), 6);
  const auto o = torch::TensorOptions().dtype(dtype).device(device);
  // [b, s, heads, d] memory viewed [b, heads, s, d], as the projections make them.
  auto q = torch::randn({b, t, heads, d}, o).transpose(1, 2).requires_grad_();
  auto k = torch::randn({b, t, kv, d}, o).transpose(1, 2).requires_grad_();
  auto v = torch::randn({b, t, kv, d}, o).transpose(1, 2).requires_grad_();
  auto y = kernels::document_attention(q, k, v, docs, tessel_kernels);
  auto dy = torch::randn_like(y);
  auto grads = torch::autograd::grad({y}, {q, k, v}, {dy});
  // The reference: key j visible to query i when j <= i in the same document.
  auto q64 = q.detach().to(torch::kFloat64).requires_grad_(),
       k64 = k.detach().to(torch::kFloat64).requires_grad_(),
       v64 = v.detach().to(torch::kFloat64).requires_grad_();
  auto doc =
      torch::cumsum((tokens == eod).to(torch::kInt64), 1) - (tokens == eod).to(torch::kInt64);
  doc = doc.to(device);
  auto pos = torch::arange(t, torch::TensorOptions().dtype(torch::kInt64).device(device));
  auto allowed = (pos.view({1, 1, t}) <= pos.view({1, t, 1})) &
                 (doc.unsqueeze(2) == doc.unsqueeze(1));  // [b, t(query), t(key)]
  auto s = torch::matmul(q64, k64.repeat_interleave(heads / kv, 1).transpose(-2, -1)) /
           std::sqrt(static_cast<double>(d));
  s = s.masked_fill(allowed.unsqueeze(1).logical_not(), -INFINITY);
  auto ref = torch::matmul(torch::softmax(s, -1), v64.repeat_interleave(heads / kv, 1));
  auto ref_grads = torch::autograd::grad({ref}, {q64, k64, v64}, {dy.to(torch::kFloat64)});
  const double tol = dtype == torch::kFloat32 ? 2e-5 : 3e-2;
  EXPECT_LT((y.to(torch::kFloat64) - ref).abs().max().item<double>(), tol) << "output";
  const char* names[] = {"dq", "dk", "dv"};
  for (size_t i = 0; i < 3; ++i)
    EXPECT_LT((grads[i].to(torch::kFloat64) - ref_grads[i]).abs().max().item<double>(), 4 * tol)
        << names[i];
}

}  // namespace tessel::testing
