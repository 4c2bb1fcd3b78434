#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "engine/data/blend.h"
#include "engine/data/dataset.h"

namespace fs = std::filesystem;

namespace tessel::data {
namespace {

// Megatron-Core's BlendedDataset rule (megatron/core/datasets/helpers.cpp,
// build_blending_indices), restated from its definition: sample i from argmax_d(w_d·max(i,1) −
// taken_d), the first on ties. Weights 0.3/0.5/0.2 (normalised from 3/5/2): the first twenty.
TEST(Blend, MegatronsErrorMinimisingRule) {
  Blend b({3, 5, 2});
  std::vector<int64_t> picks;
  for (int64_t i = 0; i < 20; ++i) picks.push_back(b.at(i).first);
  // As the rule gives them: the same list megatron-core 0.16.1's compiled build_blending_indices
  // returns for these weights (checked 2026-11-28 with the PyPI wheel).
  const std::vector<int64_t> want = {1, 0, 2, 1, 0, 1, 2, 1, 0, 1, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1};
  EXPECT_EQ(picks, want);
  // Each dataset's own samples are numbered in the order it gives them.
  std::vector<int64_t> seen(3, 0);
  Blend again({0.3, 0.5, 0.2});
  for (int64_t i = 0; i < 1000; ++i) {
    const auto [d, k] = again.at(i);
    ASSERT_EQ(k, seen[static_cast<size_t>(d)]++) << i;
  }
  // The shares stay within one sample of the weights at every point.
  for (int64_t n : {1, 7, 100, 999, 1000}) {
    const auto t = Blend({3, 5, 2}).taken(n);
    for (size_t d = 0; d < 3; ++d)
      EXPECT_LE(std::abs(static_cast<double>(t[d]) - n * std::vector<double>{0.3, 0.5, 0.2}[d]),
                1.0)
          << n;
  }
  // Random access equals the sequential walk (a resumed run starts anywhere).
  Blend walk({3, 5, 2});
  for (int64_t i = 0; i < 50; ++i) walk.at(i);
  EXPECT_EQ(Blend({3, 5, 2}).at(49), walk.at(49));
  EXPECT_EQ(walk.at(7), Blend({3, 5, 2}).at(7));  // and backwards
}

// A position the walk has passed is found again from its nearest kept state: a run's start-up
// walks its length once (the report's shares), then a resume or `samples --skip` far into it
// costs under one stride, not its position.
TEST(Blend, PositionsPassedAreFoundWithoutWalkingFromZero) {
  constexpr int64_t S = Blend::kStride;
  Blend b({0.25, 0.5, 0.125, 0.125});
  const auto far = b.taken(40 * S + 11);
  EXPECT_EQ(b.walked(), 40 * S + 11);
  const int64_t before = b.walked();
  const auto back = b.at(37 * S + 5);
  EXPECT_LT(b.walked() - before, S);
  EXPECT_EQ(back, Blend({0.25, 0.5, 0.125, 0.125}).at(37 * S + 5));
  EXPECT_EQ(b.taken(40 * S + 11), far);
  EXPECT_LT(b.walked() - before, 4 * S);
  // A position no run reaches (a crafted checkpoint's consumed_samples of 2^53) is refused at
  // once, naming it, rather than walked for days.
  const int64_t walked = b.walked();
  try {
    b.at(int64_t{1} << 53);
    ADD_FAILURE() << "2^53 was walked to";
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("sample 9007199254740992 of a blend of 4 datasets"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(b.walked(), walked);  // nothing walked by the refusal
  // A report of a run that long (training.steps 1e9 to run until stopped) takes each weight's
  // share without a walk, saying so; within reach the walk's own counts.
  bool exact = false;
  EXPECT_EQ(b.shares(40 * S + 11, &exact), far);
  EXPECT_TRUE(exact);
  EXPECT_EQ(b.shares(int64_t{1} << 40, &exact),
            (std::vector<int64_t>{int64_t{1} << 38, int64_t{1} << 39, int64_t{1} << 37,
                                  int64_t{1} << 37}));
  EXPECT_FALSE(exact);
  EXPECT_EQ(b.walked(), walked);
}

class BlendData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tessel-blend-test-" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A token file whose every token is `id` (so a sample names its dataset).
  std::string tokens(const std::string& name, uint16_t id, int64_t n) {
    std::vector<uint16_t> v(static_cast<size_t>(n), id);
    std::ofstream(dir_ / name, std::ios::binary)
        .write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(n * 2));
    return (dir_ / name).string();
  }
  fs::path dir_;
};

// A plan's blend: every global sample from the dataset the rule picks, in that dataset's own
// order; validation held out of each; a blend of one equals data.path.
TEST_F(BlendData, SamplesFollowTheRuleAndEachDatasetsOrder) {
  const auto a = tokens("a.bin", 1, 8 * 20 + 1), b = tokens("b.bin", 2, 8 * 30 + 1);
  auto c = plan::load_config_text("data: {format: tokens, blend: [{weight: 1, path: " + a +
                                      "}, {weight: 3, path: [" + b +
                                      "]}]}\ntraining: {seq_len: 8}\nmodel: {vocab_size: 16}\n",
                                  "t.yaml");
  Dataset d(c);
  ASSERT_EQ(d.sources().size(), 2u);
  EXPECT_EQ(d.train_samples(), 20 + 30);
  auto rows = d.train_batch(0, 40);
  Blend rule({1, 3});
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(rows[i][0].item<int64_t>(), 1 + rule.at(i).first) << i;
  EXPECT_EQ(d.taken(40), (std::vector<int64_t>{10, 30}));
  // The second dataset's windows: its own permutation (salted seed), a full epoch of 30.
  std::set<int64_t> windows;
  for (int64_t i = 0; i < 40; ++i) {
    const auto [set, w] = d.window_at(i);
    if (set == 1) windows.insert(w);
  }
  EXPECT_EQ(windows.size(), 30u);
  // A blend of one is data.path.
  auto one = plan::load_config_text("data: {format: tokens, blend: [{weight: 2, path: " + a +
                                        "}]}\ntraining: {seq_len: 8}\nmodel: {vocab_size: 16}\n",
                                    "t.yaml");
  auto path = plan::load_config_text(
      "data: {format: tokens, path: " + a + "}\ntraining: {seq_len: 8}\nmodel: {vocab_size: 16}\n",
      "t.yaml");
  Dataset x(one), y(path);
  EXPECT_TRUE(torch::equal(x.train_batch(0, 25), y.train_batch(0, 25)));
}

TEST(BlendPlan, BadBlendsNameTheKeyAndItem) {
  auto error = [](const std::string& yaml) {
    try {
      plan::load_config_text(yaml, "t.yaml");
    } catch (const plan::UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("data: {blend: [{weight: 0, path: a}]}\n").find("item 1: weight must be"),
            std::string::npos);
  EXPECT_NE(error("data: {blend: [{weight: 1}]}\n").find("needs both weight and path"),
            std::string::npos);
  EXPECT_NE(error("data: {blend: [{weight: 1, path: a, paths: b}]}\n").find("unknown key 'paths'"),
            std::string::npos);
  EXPECT_NE(
      error("data: {path: a, blend: [{weight: 1, path: b}]}\n").find("data.path and data.blend"),
      std::string::npos);
  // The resolved plan writes it back as YAML that reads the same.
  auto c = plan::load_config_text(
      "data: {blend: [{weight: 0.5, path: [a, b]}, {weight: 2, path: c}]}\n", "t.yaml");
  auto again = plan::load_config_text(plan::dump_config(c), "dump.yaml");
  EXPECT_EQ(again.data.blend, c.data.blend);
}

}  // namespace
}  // namespace tessel::data
