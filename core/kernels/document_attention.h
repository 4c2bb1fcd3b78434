// Document masking (data.document_mask): a sample packs several documents back to back, and
// attention stays inside each (block-diagonal causal: a token sees the earlier tokens of its own
// document only) while positions restart at every document. The documents of a micro-batch are
// found once, on the host, from its token ids (a document ends after each end-of-document id),
// before the batch goes to the device: the kernels then need no host read of device data.
//
// No S×S mask is ever made. On the CPU each document is dense causal attention of its own
// (dense_attention: Tessel's short kernel or LibTorch's flash kernel), one call per document. On
// CUDA the variable-length path of the fused kernels takes the whole micro-batch in one call as
// one packed sequence with cumulative document bounds: flash attention for bf16/fp16 (grouped-
// query heads natively), the memory-efficient kernel for fp32 (key/value heads expanded, as
// dense_attention does). Both are differentiable through LibTorch's own backward formulas.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessel::kernels {

/// The documents of `rows` packed sequences of `tokens` tokens each.
struct Documents {
  int64_t rows = 0, tokens = 0;
  /// Document bounds over the rows' tokens flattened (row r's token i is r·tokens + i):
  /// 0 = b_0 < b_1 < ... < b_n = rows·tokens; every row's first token starts a document.
  std::vector<int64_t> bounds;
  int64_t longest = 0;       // the longest document's tokens
  torch::Tensor cu_seqlens;  // the bounds as int32 on the device (CUDA only; else undefined)
  torch::Tensor positions;   // int64 [rows, tokens] on the device: each token's place in its
                             // document (0 at its first token)
  int64_t count() const { return static_cast<int64_t>(bounds.size()) - 1; }
  /// Attention's share of a causal sequence's: Σ l(l+1) over documents / rows·T(T+1).
  double attention_share() const;
};

/// The documents of input tokens `tokens` [rows, T] (host, any integer dtype): a document ends
/// after every `eod` id (the last token of a row ends one regardless). Positions and bounds go to
/// `device` (non-blocking from pinned memory when it is CUDA).
Documents find_documents(const torch::Tensor& tokens, int64_t eod, const torch::Device& device);

/// Causal attention inside each document: q [b, heads, T, d], k and v [b, kv_heads, T, d]
/// (heads a multiple of kv_heads) for the b = docs.rows sequences of docs.tokens tokens ->
/// [b, heads, T, d]. Differentiable. tessel_kernels: as dense_attention.
torch::Tensor document_attention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const Documents& docs,
                                 bool tessel_kernels);

/// The kernel document_attention runs for q's device and dtype: "per-document" (CPU),
/// "flash-varlen" or "efficient-varlen" (CUDA).
std::string document_attention_kernel(const torch::Tensor& q);

/// Why the CUDA kernel document_attention runs for head size `head_dim` in `dtype` cannot run on
/// a device of compute capability `cc` (10·major + minor), or "" when it can: flash-varlen
/// (bf16/fp16) needs a head size that is a multiple of 8 and at most 256 and compute capability
/// 8.0 or newer; efficient-varlen (fp32) a head size that is a multiple of 8. Checked where the
/// run picks its attention kernel, before any step (the kernels themselves fail mid-step).
std::string document_kernel_unfit(int64_t head_dim, torch::ScalarType dtype, int cc);

/// The log-sum-exp buffer efficient-varlen (fp32 on CUDA) saves for backward per call: one row
/// per document and head, each as long as the longest document rounded up to 32 tokens, in fp32
/// (LibTorch's memory-efficient kernel pads the variable-length rows to the longest). flash-varlen
/// keeps one value per token and head, as unmasked attention does.
double document_lse_bytes(int64_t documents, int64_t heads, int64_t longest);

}  // namespace tessel::kernels
