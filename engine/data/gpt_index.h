// Megatron-Core's sample indices, restated: which tokens each sample of its GPTDataset holds and
// in which order (its document, sample and shuffle indices, numpy's RandomState included), its
// split of a dataset's documents, and how a weighted blend sizes each dataset. Checked against
// megatron-core's own builder (tests/reference/data_cli_test.py, class MegatronSamples).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace tessel::data {

/// A dataset's document lengths as a megatron index holds them: int32, read in place (a mapped
/// array need not be aligned).
struct DocSizes {
  const uint8_t* lens = nullptr;
  int64_t n = 0;
  int32_t operator[](int64_t i) const {
    int32_t v;
    std::memcpy(&v, lens + 4 * i, 4);
    return v;
  }
  int64_t size() const { return n; }
};

/// numpy's float64 sum of a contiguous array (pairwise, in blocks of 8) and its normalisation
/// (each value over that sum), bit for bit.
double numpy_sum(const std::vector<double>& v);
std::vector<double> numpy_normalize(std::vector<double> v);

/// numpy.random.RandomState(seed): MT19937 seeded as numpy's legacy integer seed, and its
/// shuffle of a one-dimensional array.
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}
  /// A uniform integer in [0, max] (numpy's masked rejection).
  uint64_t interval(uint64_t max);
  template <class T>
  void shuffle(T* a, int64_t n) {
    for (int64_t i = n - 1; i > 0; --i)
      std::swap(a[i], a[static_cast<int64_t>(interval(static_cast<uint64_t>(i)))]);
  }
  template <class T>
  void shuffle(std::vector<T>& a) {
    shuffle(a.data(), static_cast<int64_t>(a.size()));
  }

 private:
  std::mt19937 mt_;
};

/// The documents [begin, end) of each split (train, validation, test) of a dataset of `n`
/// documents under the shares of data.split, as Megatron-Core's split matrix; nullopt for a
/// split of share 0.
std::array<std::optional<std::pair<int64_t, int64_t>>, 3> split_documents(
    const std::array<double, 3>& shares, int64_t n);

/// The samples each dataset of a weighted blend is built with, for `total` samples of the
/// blend (normalised weights; Megatron-Core's 0.5% surplus when `surplus`).
std::vector<int64_t> blend_dataset_sizes(const std::vector<double>& weights, int64_t total,
                                         bool surplus);

/// One GPTDataset's indices: documents [begin, end) of a dataset whose document d holds
/// size(d) tokens, `samples` samples of seq_len+1 tokens (nullopt: one epoch), `seed`.
struct GptIndex {
  std::vector<int32_t> documents;  // the document index: documents, every epoch, shuffled
  std::vector<int64_t> starts;     // the sample index: (document-index position, offset) pairs
  std::vector<int64_t> order;      // the shuffle index
  int64_t epochs = 0;
  int64_t size() const { return static_cast<int64_t>(order.size()); }
};

/// Sizes: document d's tokens. Throws std::invalid_argument when the documents hold under 2
/// tokens (Megatron-Core loops forever there), or, for one epoch, under seq_len+1 (no sample);
/// callers say which split and dataset.
GptIndex build_gpt_index(const DocSizes& sizes, int64_t begin, int64_t end,
                         std::optional<int64_t> samples, int64_t seq_len, uint32_t seed);

/// The same indices read in place (built, or mapped from the cache: engine/data/index_cache.h).
struct GptView {
  const int32_t* documents = nullptr;
  const int64_t* starts = nullptr;
  const int64_t* order = nullptr;
  int64_t n_documents = 0, n_samples = 0, epochs = 0;
  int64_t size() const { return n_samples; }
};
GptView view_of(const GptIndex& ix);

/// "" when `ix` is what build_gpt_index makes of documents [begin, end) of `sizes` with samples of
/// seq_len+1 tokens, as far as reading it is concerned: every document of the dataset `epochs`
/// times, each sample's start within its document and seq_len+1 tokens long, samples in reading
/// order, the shuffle a permutation. Else what is wrong. One pass over the arrays (a cache file
/// is checked with it once, where it is mapped).
std::string check_gpt_view(const GptView& ix, const DocSizes& sizes, int64_t begin, int64_t end,
                           int64_t seq_len);

/// Sample k's pieces: (document, offset, tokens) in reading order, seq_len+1 tokens in all.
struct DocPiece {
  int64_t document, offset, tokens;
};
void gpt_sample(const GptView& ix, const DocSizes& sizes, int64_t k, std::vector<DocPiece>& out);

}  // namespace tessel::data
