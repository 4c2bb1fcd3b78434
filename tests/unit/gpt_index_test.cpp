// Megatron-Core's index pieces restated in engine/data/gpt_index.h, against figures numpy and
// megatron-core 0.16.1 give (the whole samples are checked against megatron-core itself in
// tests/reference/megatron_samples_test.py).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "core/plan/user_error.h"
#include "engine/data/gpt_index.h"
#include "engine/data/index_cache.h"

namespace tessel::data {
namespace {

// numpy.random.RandomState(1234).shuffle of arange(10), then of arange(7) from the same state;
// RandomState(0).randint(0, 2**40, dtype=uint64) (the 64-bit masked path).
TEST(GptIndex, NumpyRandomStateShuffles) {
  NumpyRandomState rs(1234);
  std::vector<int32_t> a(10);
  std::iota(a.begin(), a.end(), 0);
  rs.shuffle(a);
  EXPECT_EQ(a, (std::vector<int32_t>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
  std::vector<int64_t> b(7);
  std::iota(b.begin(), b.end(), 0);
  rs.shuffle(b);
  EXPECT_EQ(b, (std::vector<int64_t>{6, 4, 0, 5, 3, 2, 1}));
  NumpyRandomState zero(0);
  EXPECT_EQ(zero.interval((uint64_t{1} << 40) - 1), uint64_t{741280623151});
}

// convert_split_vector_to_split_matrix and the builder's round(): halves to even.
TEST(GptIndex, SplitMatrixAsMegatron) {
  using R = std::optional<std::pair<int64_t, int64_t>>;
  auto docs = split_documents({969, 30, 1}, 1000);
  EXPECT_EQ(docs[0], R({0, 969}));
  EXPECT_EQ(docs[1], R({969, 999}));
  EXPECT_EQ(docs[2], R({999, 1000}));
  docs = split_documents({1, 1, 1}, 10);
  EXPECT_EQ(docs[1], R({3, 7}));
  docs = split_documents({0.5, 0.5, 0}, 5);
  EXPECT_EQ(docs[0], R({0, 2}));
  EXPECT_EQ(docs[2], std::nullopt);
}

// numpy's pairwise float64 sum (differs from a running sum from 8 values on).
TEST(GptIndex, NumpySum) {
  std::vector<double> v;
  for (int i = 0; i < 9; ++i) v.push_back(0.1 * (i + 1) * (i % 2 ? 1e-8 : 1.0));
  double running = 0;
  for (double x : v) running += x;
  double pairwise = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  pairwise += v[8];
  EXPECT_EQ(numpy_sum(v), pairwise);
  EXPECT_EQ(numpy_sum({0.3, 0.5, 0.2}), (0.0 + 0.3 + 0.5) + 0.2);
  (void)running;
}

// Each sample holds seq_len+1 tokens; consecutive samples (before the shuffle) share one token;
// documents come every epoch; a final epoch under 80% of one is shuffled on its own.
TEST(GptIndex, SamplesCoverTheDocumentsEpochByEpoch) {
  const std::vector<int32_t> lens = {5, 9, 3, 12, 7, 1, 8, 6, 10, 4};  // 65 tokens
  const DocSizes sizes{reinterpret_cast<const uint8_t*>(lens.data()), 10};
  const int64_t seq = 8;
  const auto one = build_gpt_index(sizes, 2, 9, std::nullopt, seq, 3);  // documents 2..8: 47
  EXPECT_EQ(one.epochs, 1);
  EXPECT_EQ(one.size(), (47 - 1) / seq);
  std::vector<DocPiece> pieces;
  for (int64_t k = 0; k < one.size(); ++k) {
    gpt_sample(view_of(one), sizes, k, pieces);
    int64_t tokens = 0;
    for (const auto& p : pieces) {
      EXPECT_GE(p.document, 2);
      EXPECT_LT(p.document, 9);
      EXPECT_LE(p.offset + p.tokens, sizes[p.document]);
      tokens += p.tokens;
    }
    EXPECT_EQ(tokens, seq + 1);
  }
  const auto three = build_gpt_index(sizes, 2, 9, 13, seq, 3);  // 13 samples: 2 epochs + 1/5
  EXPECT_EQ(three.epochs, 3);
  EXPECT_EQ(three.documents.size(), 21u);
  const int64_t before_last = (2 * 47 - 1) / seq;  // 11: shuffled apart from the last epoch's
  for (int64_t k = 0; k < before_last; ++k) EXPECT_LT(three.order[static_cast<size_t>(k)], 11);
  EXPECT_THROW(build_gpt_index(sizes, 5, 6, 4, seq, 3), std::invalid_argument);  // 1 token
}

// Built once, mapped after; a damaged, truncated or foreign file is rebuilt, never trusted.
TEST(GptIndex, CacheBuildsOnceAndChecksOnReuse) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tessel-index-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<int32_t> lens = {5, 9, 3, 12, 7, 1, 8, 6, 10, 4};
  const DocSizes sizes{reinterpret_cast<const uint8_t*>(lens.data()), 10};
  int builds = 0;
  auto build = [&] {
    ++builds;
    return build_gpt_index(sizes, 0, 10, 20, 8, 7);
  };
  const auto want = build_gpt_index(sizes, 0, 10, 20, 8, 7);
  auto check = [&](const GptView& v) { return check_gpt_view(v, sizes, 0, 10, 8); };
  auto same = [&](const MappedIndex& m) {
    ASSERT_EQ(m.view.size(), want.size());
    for (int64_t k = 0; k < want.size(); ++k) EXPECT_EQ(m.view.order[k], want.order[k]);
    for (size_t i = 0; i < want.starts.size(); ++i) EXPECT_EQ(m.view.starts[i], want.starts[i]);
    for (size_t i = 0; i < want.documents.size(); ++i)
      EXPECT_EQ(m.view.documents[i], want.documents[i]);
  };
  const auto a = cached_index(dir.string(), "{\"x\": 1}", build, check);
  EXPECT_TRUE(a.built);
  same(a);
  const auto b = cached_index(dir.string(), "{\"x\": 1}", build, check);
  EXPECT_FALSE(b.built);
  same(b);
  EXPECT_EQ(builds, 1);
  // One flipped byte in the arrays, then a truncated file: each rebuilt.
  const std::string path = a.path;
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_TRUE(cached_index(dir.string(), "{\"x\": 1}", build, check).built);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 8);
  same(cached_index(dir.string(), "{\"x\": 1}", build, check));
  EXPECT_EQ(builds, 3);
  // Other settings: another file.
  EXPECT_NE(cached_index(dir.string(), "{\"x\": 2}", build, check).path, path);
  std::filesystem::remove_all(dir);
}

// A mapped index is read without bounds checks, so a cache file is checked once where it is
// mapped: each way of pointing outside the data, or of repeating a sample, is named.
TEST(GptIndex, CheckNamesIndicesOutsideTheData) {
  const std::vector<int32_t> lens = {5, 9, 3, 12, 7, 1, 8, 6, 10, 4};
  const DocSizes sizes{reinterpret_cast<const uint8_t*>(lens.data()), 10};
  const auto good = build_gpt_index(sizes, 2, 9, 13, 8, 3);
  EXPECT_EQ(check_gpt_view(view_of(good), sizes, 2, 9, 8), "");
  EXPECT_NE(check_gpt_view(view_of(good), sizes, 2, 9, 7), "");  // another seq_len
  EXPECT_NE(check_gpt_view(view_of(good), sizes, 0, 9, 8), "");  // other documents
  auto bad = [&](auto mutate, const std::string& want) {
    GptIndex ix = good;
    mutate(ix);
    const std::string why = check_gpt_view(view_of(ix), sizes, 2, 9, 8);
    EXPECT_NE(why.find(want), std::string::npos) << "got: '" << why << "'";
  };
  bad([](GptIndex& ix) { ix.documents[4] = 12; }, "outside 2 to 9");
  bad([](GptIndex& ix) { ix.documents[4] = -1; }, "outside 2 to 9");
  bad([](GptIndex& ix) { ix.documents[1] = ix.documents[0]; }, "more than once per epoch");
  bad([](GptIndex& ix) { ix.starts[3] = 1 << 30; }, "outside its document");
  bad([](GptIndex& ix) { ix.starts[2] = 1 << 30; }, "outside its document");
  bad(
      [](GptIndex& ix) {
        ix.starts[2] = ix.starts[0];
        ix.starts[3] = ix.starts[1];
      },
      "sample 0 ends before it starts");
  bad([](GptIndex& ix) { ix.starts[3] += 1; }, "tokens, not seq_len+1 = 9");
  bad([](GptIndex& ix) { std::fill(ix.order.begin(), ix.order.end(), 0); }, "permutation");
  bad([](GptIndex& ix) { ix.order[0] = ix.size(); }, "permutation");
  bad([](GptIndex& ix) { ix.epochs = 2; }, "document entries for 2 epochs");
}

// A file made for this data's description, with a valid checksum, whose indices point outside
// the data (as a crafted file would: its maker recomputes the checksum) is rebuilt, never read.
TEST(GptIndex, CacheRebuildsACraftedFileWithAValidChecksum) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tessel-crafted-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<int32_t> lens = {5, 9, 3, 12, 7, 1, 8, 6, 10, 4};
  const DocSizes sizes{reinterpret_cast<const uint8_t*>(lens.data()), 10};
  const auto want = build_gpt_index(sizes, 0, 10, 20, 8, 7);
  auto check = [&](const GptView& v) { return check_gpt_view(v, sizes, 0, 10, 8); };
  for (int variant = 0; variant < 2; ++variant) {
    GptIndex crafted = want;
    if (variant == 0)
      crafted.documents[3] = 1000000;  // a read far outside
    else
      std::fill(crafted.order.begin(), crafted.order.end(), 5);  // one sample, repeated
    const auto written = cached_index(
        dir.string(), "{\"k\": 1}", [&] { return crafted; },
        [](const GptView&) { return std::string(); });
    ASSERT_TRUE(written.built);
    int builds = 0;
    const auto m = cached_index(
        dir.string(), "{\"k\": 1}",
        [&] {
          ++builds;
          return want;
        },
        check);
    EXPECT_EQ(builds, 1) << "variant " << variant;
    EXPECT_TRUE(m.built);
    for (int64_t k = 0; k < want.size(); ++k) ASSERT_EQ(m.view.order[k], want.order[k]);
    std::filesystem::remove_all(dir);
  }
}

// A FIFO where the cache file goes, and a lock that is a symbolic link, are refused at once
// naming data.index_cache and the path: a FIFO would block the open forever, a link would make
// the lock create or lock what it names.
TEST(GptIndex, CacheRefusesAFifoAndALinkedLock) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tessel-fifo-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::vector<int32_t> lens = {5, 9, 3, 12, 7, 1, 8, 6, 10, 4};
  const DocSizes sizes{reinterpret_cast<const uint8_t*>(lens.data()), 10};
  auto build = [&] { return build_gpt_index(sizes, 0, 10, 20, 8, 7); };
  auto check = [&](const GptView& v) { return check_gpt_view(v, sizes, 0, 10, 8); };
  const std::string path = cached_index(dir.string(), "{}", build, check).path;
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  auto message = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      cached_index(dir.string(), "{}", build, check);
    } catch (const plan::UserError& e) {
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string m = message();
  EXPECT_NE(m.find("data.index_cache: " + path + " is a FIFO"), std::string::npos) << m;
  std::filesystem::remove(path);
  std::filesystem::remove(path + ".lock");
  std::filesystem::create_symlink(dir / "elsewhere", path + ".lock");
  m = message();
  EXPECT_NE(m.find(".lock is a symbolic link"), std::string::npos) << m;
  EXPECT_FALSE(std::filesystem::exists(dir / "elsewhere"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessel::data
