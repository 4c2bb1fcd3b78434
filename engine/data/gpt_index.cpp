#include "engine/data/gpt_index.h"

#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "core/observe/interrupt.h"

namespace tessel::data {
namespace {

double pairwise_sum(const double* a, size_t n) {
  if (n < 8) {
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += a[i];
    return s;
  }
  if (n <= 128) {  // numpy's PW_BLOCKSIZE: eight accumulators, then the rest in turn
    double r[8];
    for (size_t j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - n % 8; i += 8)
      for (size_t j = 0; j < 8; ++j) r[j] += a[i + j];
    double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) s += a[i];
    return s;
  }
  size_t half = n / 2;
  half -= half % 8;
  return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

// Megatron-Core's _build_document_index: the documents `epochs` times over, shuffled (the last
// epoch on its own when `separate_last`).
std::vector<int32_t> document_index(int64_t begin, int64_t end, int64_t epochs,
                                    NumpyRandomState& rs, bool separate_last) {
  if (separate_last && epochs > 1) {
    auto first = document_index(begin, end, epochs - 1, rs, false);
    auto last = document_index(begin, end, 1, rs, false);
    first.insert(first.end(), last.begin(), last.end());
    return first;
  }
  std::vector<int32_t> docs;
  docs.reserve(static_cast<size_t>(epochs * (end - begin)));
  for (int64_t e = 0; e < epochs; ++e)
    for (int64_t d = begin; d < end; ++d) docs.push_back(static_cast<int32_t>(d));
  rs.shuffle(docs);
  return docs;
}

// Megatron-Core's build_sample_idx (the last partial sample dropped, one extra token per sample).
std::vector<int64_t> sample_index(const DocSizes& sizes, const std::vector<int32_t>& docs,
                                  int64_t seq_len, int64_t epochs, int64_t tokens_per_epoch) {
  const int64_t samples = (epochs * tokens_per_epoch - 1) / seq_len;
  std::vector<int64_t> starts(static_cast<size_t>(2 * (samples + 1)));
  int64_t at = 0, offset = 0;
  const int64_t last = static_cast<int64_t>(docs.size()) - 1;
  for (int64_t s = 1; s <= samples; ++s) {
    if ((s & ((int64_t{1} << 22) - 1)) == 0) observe::stop_if_signalled("indexing the data");
    int64_t remaining = seq_len + 1;
    while (remaining != 0) {
      const int64_t length = sizes[docs[static_cast<size_t>(at)]] - offset;
      remaining -= length;
      if (remaining <= 0) {
        offset += remaining + length - 1;
        remaining = 0;
      } else if (at == last) {
        offset = sizes[docs[static_cast<size_t>(at)]] - 1;
        break;
      } else {
        ++at;
        offset = 0;
      }
    }
    starts[static_cast<size_t>(2 * s)] = at;
    starts[static_cast<size_t>(2 * s + 1)] = offset;
  }
  return starts;
}

// Megatron-Core's _build_shuffle_index: [0, first) shuffled, then [first, total) shuffled (in
// place: at a trillion tokens the index is gigabytes).
std::vector<int64_t> shuffle_index(int64_t first, int64_t total, NumpyRandomState& rs) {
  std::vector<int64_t> a(static_cast<size_t>(total));
  std::iota(a.begin(), a.end(), int64_t{0});
  rs.shuffle(a.data(), first);
  if (first < total) rs.shuffle(a.data() + first, total - first);
  return a;
}

}  // namespace

double numpy_sum(const std::vector<double>& v) { return pairwise_sum(v.data(), v.size()); }

std::vector<double> numpy_normalize(std::vector<double> v) {
  const double sum = numpy_sum(v);
  for (auto& x : v) x /= sum;
  return v;
}

uint64_t NumpyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  for (int shift : {1, 2, 4, 8, 16, 32}) mask |= mask >> shift;
  uint64_t value;
  if (max <= 0xffffffffull) {
    while ((value = (static_cast<uint64_t>(mt_()) & mask)) > max) {
    }
  } else {
    auto next64 = [this] {
      const uint64_t hi = mt_();
      return (hi << 32) | static_cast<uint64_t>(mt_());
    };
    while ((value = (next64() & mask)) > max) {
    }
  }
  return value;
}

std::array<std::optional<std::pair<int64_t, int64_t>>, 3> split_documents(
    const std::array<double, 3>& shares, int64_t n) {
  const auto v = numpy_normalize({shares[0], shares[1], shares[2]});
  std::array<std::optional<std::pair<int64_t, int64_t>>, 3> out;
  double lo = 0;
  for (size_t i = 0; i < 3; ++i) {
    const double hi = lo + v[i];
    if (hi > lo) {  // Python's round(): halves to even, as nearbyint in the default mode
      const double count = static_cast<double>(n);
      out[i] = std::make_pair(static_cast<int64_t>(std::nearbyint(lo * count)),
                              static_cast<int64_t>(std::nearbyint(hi * count)));
    }
    lo = hi;
  }
  return out;
}

std::vector<int64_t> blend_dataset_sizes(const std::vector<double>& weights, int64_t total,
                                         bool surplus) {
  std::vector<int64_t> sizes;
  for (double w : weights) {
    const double target = std::ceil(static_cast<double>(total) * w);
    sizes.push_back(static_cast<int64_t>(surplus ? std::ceil(target * (1 + 0.005)) : target));
  }
  return sizes;
}

GptIndex build_gpt_index(const DocSizes& sizes, int64_t begin, int64_t end,
                         std::optional<int64_t> samples, int64_t seq_len, uint32_t seed) {
  int64_t per_epoch = 0;
  for (int64_t d = begin; d < end; ++d) per_epoch += sizes[d];
  // Megatron-Core repeats a short split as many epochs as the samples need; with no sample count
  // (one epoch), or no tokens at all (where it loops forever), there is nothing to read.
  if (per_epoch < 2 || (!samples && per_epoch < seq_len + 1))
    throw std::invalid_argument(
        std::to_string(end - begin) + " documents hold " + std::to_string(per_epoch) +
        " tokens: not one sample of training.seq_len+1 = " + std::to_string(seq_len + 1) +
        " tokens");
  GptIndex ix;
  ix.epochs = 1;
  if (samples)
    for (int64_t tokens = per_epoch; tokens < *samples * seq_len + 1; tokens += per_epoch)
      ++ix.epochs;
  bool separate_last = false;
  int64_t before_last = 0;
  if (ix.epochs > 1) {
    before_last = ((ix.epochs - 1) * per_epoch - 1) / seq_len;
    const int64_t in_epoch = (per_epoch - 1) / seq_len;
    separate_last = *samples - before_last < static_cast<int64_t>(0.80 * in_epoch);
  }
  NumpyRandomState rs(seed);
  ix.documents = document_index(begin, end, ix.epochs, rs, separate_last);
  ix.starts = sample_index(sizes, ix.documents, seq_len, ix.epochs, per_epoch);
  const int64_t total = static_cast<int64_t>(ix.starts.size() / 2) - 1;
  ix.order = shuffle_index(separate_last ? before_last : total, total, rs);
  return ix;
}

GptView view_of(const GptIndex& ix) {
  return {ix.documents.data(), ix.starts.data(),
          ix.order.data(),     static_cast<int64_t>(ix.documents.size()),
          ix.size(),           ix.epochs};
}

std::string check_gpt_view(const GptView& ix, const DocSizes& sizes, int64_t begin, int64_t end,
                           int64_t seq_len) {
  if (begin < 0 || end > sizes.size() || begin >= end || seq_len < 1)
    return "documents " + std::to_string(begin) + " to " + std::to_string(end) + " of " +
           std::to_string(sizes.size());
  const int64_t span = end - begin;
  if (ix.epochs < 1 || ix.n_documents / span != ix.epochs || ix.n_documents % span != 0)
    return std::to_string(ix.n_documents) + " document entries for " + std::to_string(ix.epochs) +
           " epochs of " + std::to_string(span) + " documents";
  std::vector<int64_t> seen(static_cast<size_t>(span), 0);
  for (int64_t i = 0; i < ix.n_documents; ++i) {
    const int64_t d = ix.documents[i];
    if (d < begin || d >= end)
      return "document entry " + std::to_string(i) + " is document " + std::to_string(d) +
             ", outside " + std::to_string(begin) + " to " + std::to_string(end);
    if (++seen[static_cast<size_t>(d - begin)] > ix.epochs)
      return "document " + std::to_string(d) + " more than once per epoch";
  }
  // Sample j runs from start j to start j+1, both ends included: seq_len+1 tokens.
  for (int64_t j = 0; j <= ix.n_samples; ++j) {
    const int64_t p = ix.starts[2 * j], o = ix.starts[2 * j + 1];
    if (p < 0 || p >= ix.n_documents || o < 0 || (o > 0 && o >= sizes[ix.documents[p]]))
      return "sample start " + std::to_string(j) + " (" + std::to_string(p) + ", " +
             std::to_string(o) + ") is outside its document";
    if (j == 0) continue;
    const int64_t p0 = ix.starts[2 * j - 2], o0 = ix.starts[2 * j - 1];
    if (p < p0 || (p == p0 && o <= o0))
      return "sample " + std::to_string(j - 1) + " ends before it starts";
    int64_t tokens = p == p0 ? o - o0 + 1 : sizes[ix.documents[p0]] - o0;
    for (int64_t i = p0 + 1; i < p && tokens <= seq_len + 1; ++i) tokens += sizes[ix.documents[i]];
    if (p != p0) tokens += o + 1;
    if (tokens != seq_len + 1)
      return "sample " + std::to_string(j - 1) + " holds " + std::to_string(tokens) +
             " tokens, not seq_len+1 = " + std::to_string(seq_len + 1);
  }
  std::vector<bool> taken(static_cast<size_t>(ix.n_samples), false);
  for (int64_t k = 0; k < ix.n_samples; ++k) {
    const int64_t s = ix.order[k];
    if (s < 0 || s >= ix.n_samples || taken[static_cast<size_t>(s)])
      return "the shuffle's entry " + std::to_string(k) + " (" + std::to_string(s) +
             ") is not a permutation's";
    taken[static_cast<size_t>(s)] = true;
  }
  return "";
}

void gpt_sample(const GptView& ix, const DocSizes& sizes, int64_t k, std::vector<DocPiece>& out) {
  out.clear();
  const auto s = ix.order[k];
  const int64_t d0 = ix.starts[2 * s], o0 = ix.starts[2 * s + 1];
  const int64_t d1 = ix.starts[2 * s + 2], o1 = ix.starts[2 * s + 3];
  for (int64_t i = d0; i <= d1; ++i) {
    const int64_t doc = ix.documents[i];
    const int64_t offset = i == d0 ? o0 : 0;
    const int64_t tokens = i < d1 ? sizes[doc] - offset : o1 + 1 - offset;
    out.push_back({doc, offset, tokens});
  }
}

}  // namespace tessel::data
