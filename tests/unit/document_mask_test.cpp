// data.document_mask: documents found from end-of-document ids, and a packed sequence of
// documents A|B|C scored token by token as A, B and C alone (attention and positions restart).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/kernels/document_attention.h"
#include "engine/planner/model_plan.h"
#include "models/registry.h"
#include "tests/common/attention_cases.h"

namespace tessel::models {
namespace {

constexpr int64_t kEod = 299;

ModelShape model(const std::string& yaml) {
  return planner::model_shape(
      plan::load_config_text("data: {path: x}\nmodel: " + yaml + "\n", "t").model);
}

TEST(DocumentMask, AttentionMatchesTheBlockDiagonalMask) {
  // Per-document calls on the CPU: Tessel's short kernel and LibTorch's flash kernel.
  testing::check_document_attention(torch::kCPU, torch::kFloat32, /*tessel_kernels=*/true);
  testing::check_document_attention(torch::kCPU, torch::kFloat32, /*tessel_kernels=*/false);
  EXPECT_EQ(kernels::document_attention_kernel(torch::zeros({1})), "per-document");
}

TEST(DocumentMask, FindsDocumentsAfterEachEndOfDocument) {
  // Row 0: a document ends after position 2 and after 5; row 1 ends one at its last token only.
  auto tokens =
      torch::tensor(std::vector<int64_t>{3, 4, kEod, 5, 6, kEod, 7, 8, 1, 2, 3, 4, 5, 6, 7, kEod})
          .to(torch::kInt32)  // any integer dtype
          .view({2, 8});
  const auto d = kernels::find_documents(tokens, kEod, torch::kCPU);
  EXPECT_EQ(d.bounds, (std::vector<int64_t>{0, 3, 6, 8, 16}));
  EXPECT_EQ(d.count(), 4);
  EXPECT_EQ(d.longest, 8);
  EXPECT_TRUE(torch::equal(
      d.positions, torch::tensor({0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7}).view({2, 8})));
  // Attention kept: (3·4 + 3·4 + 2·3 + 8·9) / (2·8·9).
  EXPECT_DOUBLE_EQ(d.attention_share(), (12.0 + 12 + 6 + 72) / 144);
  EXPECT_FALSE(d.cu_seqlens.defined()) << "bounds go to the device for CUDA's kernels only";
}

// Per-token losses of rows [1, T+1] (the logits of the model's whole vocabulary).
torch::Tensor token_losses(Decoder& m, const torch::Tensor& row, const kernels::Documents* docs) {
  const int64_t t = row.size(1) - 1;
  auto logits = m->forward(row.narrow(1, 0, t), docs)[0];
  return torch::nn::functional::cross_entropy(
      logits, row[0].narrow(0, 1, t),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
}

void expect_packed_equals_alone(const std::string& yaml, const std::string& kernels) {
  SCOPED_TRACE(yaml + " kernels " + kernels);
  auto m = build_model(model(yaml), 5);
  m->set_kernels(kernels);
  torch::manual_seed(3);
  // A (5 tokens), B (7), C (4), each but the last ended by an end-of-document id.
  const std::vector<int64_t> lens{5, 7, 4};
  auto row = torch::randint(0, kEod, {1, 17}, torch::kInt64);
  row[0][4] = kEod, row[0][11] = kEod;
  const auto docs = kernels::find_documents(row.narrow(1, 0, 16), kEod, torch::kCPU);
  ASSERT_EQ(docs.bounds, (std::vector<int64_t>{0, 5, 12, 16}));
  torch::NoGradGuard no_grad;
  const auto packed = token_losses(m, row, &docs);
  // Alone: each document's tokens and the next token after it (its last target).
  int64_t at = 0;
  for (int64_t len : lens) {
    const auto alone = token_losses(m, row.narrow(1, at, len + 1), nullptr);
    const auto mine = packed.narrow(0, at, len);
    EXPECT_LE((mine - alone).abs().max().item<double>(), 1e-6)
        << "document at " << at << ": " << mine << " alone " << alone;
    at += len;
  }
  // Without the mask the later documents see the earlier ones: the figure above can fail.
  const auto unmasked = token_losses(m, row, nullptr);
  EXPECT_GT((unmasked - packed).narrow(0, 5, 11).abs().max().item<double>(), 1e-4);
}

TEST(DocumentMask, PackedDocumentsScoreAsAlone) {
  for (const char* k : {"tessel", "torch"}) {
    // Llama: RoPE restarted per document, grouped-query heads.
    expect_packed_equals_alone(
        "{arch: llama, layers: 2, hidden: 32, heads: 4, kv_heads: 2, vocab_size: 300, "
        "max_seq_len: 128}",
        k);
    // GPT-2: learned positions restarted per document.
    expect_packed_equals_alone(
        "{arch: gpt2, layers: 2, hidden: 32, heads: 4, vocab_size: 300, max_seq_len: 128}", k);
  }
}

TEST(DocumentMask, GradientsAreTheDocumentsAlone) {
  // The packed row's loss sum is the documents' alone, so are its gradients.
  auto m = build_model(
      model("{arch: llama, layers: 2, hidden: 32, heads: 4, kv_heads: 2, vocab_size: 300, "
            "max_seq_len: 128}"),
      7);
  torch::manual_seed(4);
  auto rows = torch::randint(0, kEod, {2, 13}, torch::kInt64);
  rows[0][3] = kEod, rows[1][8] = kEod;
  const auto docs = kernels::find_documents(rows.narrow(1, 0, 12), kEod, torch::kCPU);
  m->loss_sum(rows, &docs).backward();
  std::map<std::string, torch::Tensor> packed;
  for (const auto& p : m->named_parameters()) packed[p.key()] = p.value().grad().clone();
  m->zero_grad();
  for (const auto& [r, s, len] : {std::tuple{0, 0, 4}, {0, 4, 8}, {1, 0, 9}, {1, 9, 3}})
    m->loss_sum(rows.narrow(0, r, 1).narrow(1, s, len + 1)).backward();
  for (const auto& p : m->named_parameters()) {
    const auto& g = packed.at(p.key());
    EXPECT_LE((g - p.value().grad()).abs().max().item<double>(),
              1e-5 * std::max(1.0, g.abs().max().item<double>()))
        << p.key();
  }
}

}  // namespace
}  // namespace tessel::models
