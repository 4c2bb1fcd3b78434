#include "core/kernels/document_attention.h"

#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>

#include "core/kernels/attention_kernels.h"

namespace tessel::kernels {
namespace {

// The memory-efficient kernel's mask types (sdp::CustomMaskType): causal, aligned top-left.
constexpr int64_t kCausalFromTopLeft = 1;

// [b, h, T, d] -> [b·T, h, d] (the packed tokens, heads inside): a view over the [b, T, h, d]
// memory the projections write, a copy otherwise.
torch::Tensor packed(const torch::Tensor& x) {
  return x.transpose(1, 2).reshape({x.size(0) * x.size(2), x.size(1), x.size(3)});
}
// Its inverse for the output: [b·T, h, d] -> [b, h, T, d] over [b, T, h, d] memory.
torch::Tensor unpacked(const torch::Tensor& y, int64_t b, int64_t t) {
  return y.view({b, t, y.size(1), y.size(2)}).transpose(1, 2);
}

torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const Documents& docs) {
  TORCH_CHECK(docs.cu_seqlens.defined() && docs.cu_seqlens.device() == q.device(),
              "document_attention: the documents' bounds are not on ", q.device());
  const int64_t b = q.size(0), t = q.size(2), n = docs.longest;
  if (q.scalar_type() != torch::kFloat32) {  // flash: grouped-query heads natively
    auto out = std::get<0>(at::_flash_attention_forward(packed(q), packed(k), packed(v),
                                                        docs.cu_seqlens, docs.cu_seqlens, n, n,
                                                        /*dropout_p=*/0.0, /*is_causal=*/true,
                                                        /*return_debug_mask=*/false));
    return unpacked(out, b, t);
  }
  // fp32: the memory-efficient kernel, with equal head counts, over one batch of b·T tokens.
  const int64_t h = q.size(1);
  auto out = std::get<0>(at::_efficient_attention_forward(
      packed(q).unsqueeze(0), packed(expand_heads(k, h)).unsqueeze(0),
      packed(expand_heads(v, h)).unsqueeze(0), /*bias=*/std::nullopt, docs.cu_seqlens,
      docs.cu_seqlens, n, n, /*dropout_p=*/0.0, kCausalFromTopLeft,
      /*compute_log_sumexp=*/true));
  return unpacked(out.squeeze(0), b, t);
}

// One dense causal attention per document (no document sees another's keys).
torch::Tensor per_document_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const Documents& docs,
                                     bool tessel_kernels) {
  if (docs.count() == docs.rows)  // one document per row: the sequence's own causal attention
    return dense_attention(q, k, v, /*causal=*/true, tessel_kernels);
  std::vector<torch::Tensor> rows;
  size_t i = 0;
  for (int64_t r = 0; r < docs.rows; ++r) {
    const int64_t first = r * docs.tokens, end = first + docs.tokens;
    std::vector<torch::Tensor> parts;
    const auto qr = q.narrow(0, r, 1), kr = k.narrow(0, r, 1), vr = v.narrow(0, r, 1);
    for (; i + 1 < docs.bounds.size() && docs.bounds[i] < end; ++i) {
      const int64_t s = docs.bounds[i] - first, len = docs.bounds[i + 1] - docs.bounds[i];
      parts.push_back(dense_attention(qr.narrow(2, s, len), kr.narrow(2, s, len),
                                      vr.narrow(2, s, len), /*causal=*/true, tessel_kernels));
    }
    rows.push_back(parts.size() == 1 ? parts[0] : torch::cat(parts, 2));
  }
  return torch::cat(rows, 0);
}

}  // namespace

double Documents::attention_share() const {
  double kept = 0;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const double l = static_cast<double>(bounds[i + 1] - bounds[i]);
    kept += l * (l + 1);
  }
  const double t = static_cast<double>(tokens);
  return rows > 0 ? kept / (static_cast<double>(rows) * t * (t + 1)) : 1.0;
}

Documents find_documents(const torch::Tensor& tokens, int64_t eod, const torch::Device& device) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.device().is_cpu(),
              "find_documents: tokens must be [rows, T] on the host, not ", tokens.sizes(), " on ",
              tokens.device());
  const auto ids = tokens.to(torch::kInt64).contiguous();
  Documents d;
  d.rows = ids.size(0), d.tokens = ids.size(1);
  auto pos = torch::empty({d.rows, d.tokens}, torch::kInt64);
  const int64_t* in = ids.const_data_ptr<int64_t>();
  int64_t* p = pos.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < d.rows; ++r) {
    int64_t start = r * d.tokens;
    d.bounds.push_back(start);
    for (int64_t i = 0; i < d.tokens; ++i) {
      const int64_t at = r * d.tokens + i;
      p[at] = at - start;
      if (in[at] == eod && i + 1 < d.tokens) d.bounds.push_back(start = at + 1);
    }
  }
  d.bounds.push_back(d.rows * d.tokens);
  for (size_t i = 0; i + 1 < d.bounds.size(); ++i)
    d.longest = std::max(d.longest, d.bounds[i + 1] - d.bounds[i]);
  if (!device.is_cuda()) {
    d.positions = pos.to(device);
    return d;
  }
  auto bounds =
      torch::tensor(std::vector<int32_t>(d.bounds.begin(), d.bounds.end()), torch::kInt32);
  d.positions = pos.pin_memory().to(device, /*non_blocking=*/true);
  d.cu_seqlens = bounds.pin_memory().to(device, /*non_blocking=*/true);
  return d;
}

torch::Tensor document_attention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const Documents& docs,
                                 bool tessel_kernels) {
  TORCH_CHECK(q.size(0) == docs.rows && q.size(2) == docs.tokens && k.size(2) == docs.tokens,
              "document_attention: q ", q.sizes(), " and k ", k.sizes(), " against documents of ",
              docs.rows, " rows of ", docs.tokens, " tokens");
  if (q.is_cuda()) return varlen_attention(q, k, v, docs);
  return per_document_attention(q, k, v, docs, tessel_kernels);
}

std::string document_attention_kernel(const torch::Tensor& q) {
  if (!q.is_cuda()) return "per-document";
  return q.scalar_type() == torch::kFloat32 ? "efficient-varlen" : "flash-varlen";
}

std::string document_kernel_unfit(int64_t head_dim, torch::ScalarType dtype, int cc) {
  const bool flash = dtype != torch::kFloat32;
  const std::string kernel = flash ? "flash-varlen" : "efficient-varlen";
  std::string why;
  if (head_dim % 8 != 0) why = fmt::format("a head size that is a multiple of 8, not {}", head_dim);
  if (flash && head_dim > 256) why = fmt::format("a head size of at most 256, not {}", head_dim);
  if (flash && cc < 80)
    why = fmt::format("compute capability 8.0 or newer, not {}.{}", cc / 10, cc % 10);
  if (why.empty()) return "";
  return fmt::format("{} (document masking's attention on CUDA in {}) needs {}", kernel,
                     c10::toString(dtype), why);
}

double document_lse_bytes(int64_t documents, int64_t heads, int64_t longest) {
  return 4.0 * static_cast<double>(documents) * static_cast<double>(heads) *
         static_cast<double>((longest + 31) / 32 * 32);
}

}  // namespace tessel::kernels
