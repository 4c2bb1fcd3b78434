// data.document_mask: documents found from end-of-document ids, and a packed sequence of
// documents A|B|C scored token by token as A, B and C alone (attention and positions restart).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/kernels/document_attention.h"
#include "core/plan/layout.h"
#include "engine/planner/documents.h"
#include "engine/planner/planner.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "tests/common/attention_cases.h"

namespace tessel::models {
namespace {

constexpr int64_t kEod = 299;

ModelShape model(const std::string& yaml) {
  return models::model_shape(
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

void expect_packed_equals_alone(const std::string& yaml, plan::Kernels kernels) {
  SCOPED_TRACE(yaml + " kernels " + plan::name_of(kernels));
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
  for (auto k : {plan::Kernels::kTessel, plan::Kernels::kTorch}) {
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

namespace tessel {
namespace {

// The variable-length CUDA kernels have no fallback: their limits are checked where the run picks
// its attention kernel (engine/run/build.cpp), naming what the plan would need.
TEST(DocumentMaskOnCuda, KernelLimitsAreNamed) {
  using kernels::document_kernel_unfit;
  EXPECT_EQ(document_kernel_unfit(128, torch::kBFloat16, 90), "");
  EXPECT_EQ(document_kernel_unfit(256, torch::kHalf, 80), "");
  EXPECT_EQ(document_kernel_unfit(100, torch::kBFloat16, 90),
            "flash-varlen (document masking's attention on CUDA in BFloat16) needs a head size "
            "that is a multiple of 8, not 100");
  EXPECT_EQ(document_kernel_unfit(264, torch::kBFloat16, 90),
            "flash-varlen (document masking's attention on CUDA in BFloat16) needs a head size of "
            "at most 256, not 264");
  EXPECT_EQ(document_kernel_unfit(64, torch::kHalf, 75),
            "flash-varlen (document masking's attention on CUDA in Half) needs compute capability "
            "8.0 or newer, not 7.5");
  EXPECT_EQ(document_kernel_unfit(264, torch::kFloat32, 75), "");  // the memory-efficient kernel
  EXPECT_EQ(document_kernel_unfit(60, torch::kFloat32, 90),
            "efficient-varlen (document masking's attention on CUDA in Float) needs a head size "
            "that is a multiple of 8, not 60");
}

// fp32 masked attention on CUDA keeps a log-sum-exp row per document and head, padded to the
// longest document: the planner counts it per layer, from the documents of the first samples.
// Data: 50 documents of 10 tokens, then one of 501, over and over.
TEST(DocumentMaskOnCuda, PlannerCountsTheLogSumExpRows) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tessel-lse-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto path = (dir / "d.u16").string();
  {
    std::vector<uint16_t> tokens;
    for (int r = 0; r < 64; ++r) {
      for (int d = 0; d < 50; ++d) {
        for (int i = 0; i < 9; ++i) tokens.push_back(static_cast<uint16_t>(1 + (r + i) % 200));
        tokens.push_back(0);  // end of document
      }
      for (int i = 0; i < 500; ++i) tokens.push_back(static_cast<uint16_t>(1 + i % 200));
      tokens.push_back(0);
    }
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * 2));
  }
  const std::string plan =
      "data: {format: tokens, path: [" + path +
      "], eod_token: 0}\nmodel: {arch: gpt2, layers: 2, hidden: 64, heads: 4, vocab_size: 256, "
      "max_seq_len: 256}\ntraining: {steps: 4, global_batch: 2, micro_batch: 2, seq_len: 256, "
      "dtype: fp32}\n";
  const auto profile = planner::device_profile("h100", {});
  auto activations = [&](const std::vector<std::string>& sets) {
    const plan::Config c = plan::load_config_text(plan, "p.yaml", sets);
    const auto layout = plan::check_layout(c, 1, 0);
    return planner::estimate(c, layout, profile).ranks.at(0).activations;
  };
  const double masked = activations({"data.document_mask=true"});
  const double plain = activations({});
  const double bf16 = activations({"data.document_mask=true", "training.dtype=bf16"}) -
                      activations({"training.dtype=bf16"});
  const auto docs = planner::document_figures(
      plan::load_config_text(plan, "p.yaml", {"data.document_mask=true"}));
  std::filesystem::remove_all(dir);
  EXPECT_GT(docs.per_sample, 10);
  EXPECT_EQ(docs.longest, 256);  // a row inside the long document
  // Two layers, one micro-batch in flight, 2 rows, 4 heads, rows of 256 fp32 values.
  const double rows = std::ceil(docs.per_sample * 2) * 4;
  EXPECT_EQ(masked - plain, 2 * rows * 256 * 4);
  EXPECT_EQ(bf16, 0);  // flash-varlen keeps a value per token, as unmasked attention does
}

}  // namespace
}  // namespace tessel
