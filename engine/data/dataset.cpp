#include "engine/data/dataset.h"

#include <fmt/format.h>

#include <torch/torch.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <sys/stat.h>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>

#include "core/observe/interrupt.h"
#include "core/plan/data_split.h"
#include "engine/data/index_cache.h"

namespace tessel::data {
namespace {

// One dataset the plan names: its key, its files, its weight within its split.
struct Named {
  std::string key;
  plan::BlendSource item;
};

// The datasets of each split's own list: training (data.blend, or data.path: one dataset, or
// under data.order megatron one per prefix, as Megatron's --data-path reads them), data.valid,
// data.test.
std::vector<Named> named(const plan::DataConfig& d, SampleSplit s) {
  const auto& list = s == SampleSplit::kTrain   ? d.blend
                     : s == SampleSplit::kValid ? d.valid
                                                : d.test;
  const std::string key = s == SampleSplit::kTrain   ? "data.blend"
                          : s == SampleSplit::kValid ? "data.valid"
                                                     : "data.test";
  std::vector<Named> out;
  for (size_t i = 0; i < list.size(); ++i)
    out.push_back({fmt::format("{} item {}", key, i + 1), list[i]});
  if (s == SampleSplit::kTrain && d.blend.empty()) {
    if (d.order == plan::DataOrder::kMegatron && d.path.size() > 1)
      for (size_t i = 0; i < d.path.size(); ++i)
        out.push_back({fmt::format("data.path item {}", i + 1), {1.0, {d.path[i]}}});
    else
      out.push_back({"data.path", {1.0, d.path}});
  }
  return out;
}

// An error said of data.path (what reading one dataset's files says), said of dataset `n`.
plan::UserError rekeyed(const Named& n, const plan::UserError& e) {
  const std::string what = e.what();
  if (n.key == "data.path") return e;
  const size_t colon = what.find(':');
  return plan::UserError(n.key + (what.rfind("data.path", 0) == 0 && colon != std::string::npos
                                      ? what.substr(colon)
                                      : ": " + what));
}

// Dataset `n`'s stream; its errors name its key.
std::shared_ptr<const TokenStream> open_named(const plan::DataConfig& d, const Named& n) {
  plan::DataConfig one = d;
  one.path = n.item.path;
  try {
    return std::make_shared<const TokenStream>(open_stream(one));
  } catch (const plan::UserError& e) {
    throw rekeyed(n, e);
  }
}

std::string name_of(const TokenStream& s) {
  return s.files.size() == 1 ? s.files[0] : std::to_string(s.files.size()) + " files";
}

// The stream position of document-or-token `u` (a stream without documents is split by tokens).
int64_t unit_start(const TokenStream& s, int64_t u) {
  if (s.documents() == 0) return u;
  return u < s.documents() ? s.doc_start(u) : s.size();
}

// Where a megatron stream's indices are kept: data.index_cache, or beside its data.
std::string index_folder(const plan::DataConfig& d, const TokenStream& s) {
  if (!d.index_cache.empty()) return d.index_cache;
  return (std::filesystem::path(s.files[0]).parent_path() / "cache" / "tessel-indices").string();
}

// Everything that determines a GPTDataset's indices: the index file (path, size, time), the
// documents, the samples, seq_len and seed.
std::string index_description(const TokenStream& s, int64_t begin, int64_t end,
                              std::optional<int64_t> samples, int64_t seq_len, uint32_t seed) {
  const std::string bin = s.files[0], idx = bin.substr(0, bin.size() - 4) + ".idx";
  struct stat st {};
  ::stat(idx.c_str(), &st);
  nlohmann::json j = {
      {"tessel_gpt_index", 1},
      {"idx", std::filesystem::weakly_canonical(idx).string()},
      {"idx_bytes", static_cast<int64_t>(st.st_size)},
      {"idx_mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
      {"documents", {begin, end}},
      {"samples", samples ? nlohmann::json(*samples) : nlohmann::json()},
      {"seq_len", seq_len},
      {"seed", seed}};
  return j.dump();
}

// A dataset's samples of one split in data.order tessel: the windows of stream positions
// [begin, end).
Source tessel_source(const Named& n, std::shared_ptr<const TokenStream> stream, int64_t begin,
                     int64_t end, const plan::Config& c) {
  Source src;
  src.key = n.key;
  src.name = name_of(*stream);
  src.stream = std::move(stream);
  src.begin = begin;
  src.end = end;
  src.seq_len = c.training.seq_len;
  src.samples = std::max<int64_t>(0, (end - begin - 1) / src.seq_len);
  return src;
}

// A dataset's samples of one split in data.order megatron: Megatron-Core's GPTDataset over
// documents [begin, end), `samples` of them (nullopt: one epoch).
Source megatron_source(const Named& n, std::shared_ptr<const TokenStream> stream, SampleSplit s,
                       int64_t begin, int64_t end, std::optional<int64_t> samples,
                       const plan::Config& c) {
  Source src;
  src.key = n.key;
  src.name = name_of(*stream);
  src.stream = std::move(stream);
  src.begin = unit_start(*src.stream, begin);
  src.end = unit_start(*src.stream, end);
  src.seq_len = c.training.seq_len;
  src.sizes = src.stream->megatron_sizes();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const auto seed = static_cast<uint32_t>(c.run.seed);
    src.index = std::make_shared<const MappedIndex>(cached_index(
        index_folder(c.data, *src.stream),
        index_description(*src.stream, begin, end, samples, src.seq_len, seed),
        [&] { return build_gpt_index(src.sizes, begin, end, samples, src.seq_len, seed); },
        [&](const GptView& v) { return check_gpt_view(v, src.sizes, begin, end, src.seq_len); }));
  } catch (const std::invalid_argument& e) {
    throw plan::UserError(
        fmt::format("{}: the {} split of {} (documents {} to {} of {}{}): {}", n.key, split_name(s),
                    src.name, begin, end, src.stream->documents(),
                    c.data.split.empty() ? "" : ", data.split " + c.data.split, e.what()));
  }
  src.samples = src.index->view.size();
  spdlog::info("data: {} {} split: {} samples, indices {} in {:.2f} s: {}", n.key, split_name(s),
               src.samples, src.index->built ? "built" : "mapped",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               src.index->path);
  return src;
}

// Split s of a training dataset: its stream positions (data.order tessel) or documents
// (megatron) under data.split, or data.val_fraction's end of the stream; nullopt: none.
std::optional<std::pair<int64_t, int64_t>> cut(const plan::DataConfig& d, const TokenStream& st,
                                               SampleSplit s, bool documents) {
  if (d.split.empty() && d.val_fraction > 0) {
    const int64_t n = st.size(),
                  at = n - static_cast<int64_t>(static_cast<double>(n) * d.val_fraction);
    if (s == SampleSplit::kTest) return std::nullopt;
    return s == SampleSplit::kTrain ? std::make_pair(int64_t{0}, at) : std::make_pair(at, n);
  }
  std::array<double, 3> shares{};
  plan::parse_split(d.split, shares);  // the plan's rules have read it
  const int64_t units = st.documents() ? st.documents() : st.size();
  auto r = split_documents(shares, units)[static_cast<size_t>(s)];
  if (r && !documents) r = std::make_pair(unit_start(st, r->first), unit_start(st, r->second));
  return r;
}

}  // namespace

const char* split_name(SampleSplit s) {
  return s == SampleSplit::kTrain ? "train" : s == SampleSplit::kValid ? "valid" : "test";
}

std::vector<double> blend_weights(const plan::DataConfig& d) {
  std::vector<double> w;
  for (const auto& n : named(d, SampleSplit::kTrain)) w.push_back(n.item.weight);
  return w;
}

std::vector<std::pair<std::string, std::vector<std::string>>> named_datasets(
    const plan::DataConfig& d) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (auto s : {SampleSplit::kTrain, SampleSplit::kValid, SampleSplit::kTest})
    for (const auto& n : named(d, s)) out.emplace_back(n.key, n.item.path);
  return out;
}

void check_token_ids(const plan::Config& c, int64_t rank, int64_t world) {
  if (c.data.format == plan::DataFormat::kText) return;
  for (auto s : {SampleSplit::kTrain, SampleSplit::kValid, SampleSplit::kTest})
    for (const auto& n : named(c.data, s)) {
      const auto stream = open_named(c.data, n);
      try {
        check_stream_ids(c, *stream, rank, world);
      } catch (const plan::UserError& e) {
        throw rekeyed(n, e);
      }
    }
}

namespace {

// The shuffle of epoch_permutation into `perm` ([0, n) already): the same swaps whatever T.
template <class T>
void shuffle_epoch(std::vector<T>& perm, int64_t seed, int64_t epoch) {
  uint64_t state = static_cast<uint64_t>(seed) * 0x9e3779b97f4a7c15ull ^
                   (static_cast<uint64_t>(epoch) + 0x632be59bd9b4e019ull);
  auto next = [&state] {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int64_t i = static_cast<int64_t>(perm.size()) - 1; i > 0; --i) {
    // Lemire-free modulo: the bias is below 2^-40 for any n that fits in memory.
    const auto j = static_cast<size_t>(next() % static_cast<uint64_t>(i + 1));
    std::swap(perm[static_cast<size_t>(i)], perm[j]);
  }
}

}  // namespace

std::vector<int64_t> epoch_permutation(int64_t n, int64_t seed, int64_t epoch) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  shuffle_epoch(perm, seed, epoch);
  return perm;
}

int64_t Source::window(int64_t k) {
  const int64_t epoch = k / samples, i = k % samples;
  if (!shuffle) return i;
  if (epoch != perm_epoch_) {
    // 32-bit where the windows allow (any dataset under 2^31 windows: 8·10^12 tokens at 4096):
    // half the memory of each rank's epoch order, the same order.
    if (samples <= std::numeric_limits<int32_t>::max()) {
      perm_.clear();
      perm32_.resize(static_cast<size_t>(samples));
      std::iota(perm32_.begin(), perm32_.end(), int32_t{0});
      shuffle_epoch(perm32_, seed, epoch);
    } else {
      perm32_.clear();
      perm_ = epoch_permutation(samples, seed, epoch);
    }
    perm_epoch_ = epoch;
  }
  return perm_.empty() ? perm32_[static_cast<size_t>(i)] : perm_[static_cast<size_t>(i)];
}

void Source::pieces(int64_t k, std::vector<Piece>& out) {
  out.clear();
  if (!index) {
    out.push_back({begin + window(k) * seq_len, seq_len + 1});
    return;
  }
  if (k < 0 || k >= samples)
    throw std::logic_error(fmt::format("{}: sample {} of {} indexed", name, k, samples));
  gpt_sample(index->view, sizes, k, doc_pieces_);
  for (const auto& p : doc_pieces_)
    out.push_back({stream->doc_start(p.document) + p.offset, p.tokens});
}

}  // namespace tessel::data

namespace tessel::data {
namespace {

// A split the plan cut for a dataset holds at least one sample: else a UserError naming the key.
void require_samples(const Source& src, SampleSplit s, const plan::DataConfig& d, bool many) {
  if (src.samples > 0) return;
  const std::string need =
      fmt::format("not one sample of training.seq_len+1 = {} tokens", src.seq_len + 1);
  if (s == SampleSplit::kTrain)
    throw plan::UserError(fmt::format(
        "{}: {} hold {} training tokens{}: {}", src.key, src.name, src.end - src.begin,
        d.split.empty() ? "" : " under data.split " + d.split + " (its first share is training's)",
        need));
  if (d.split.empty() && s == SampleSplit::kValid && src.key.rfind("data.valid", 0) != 0)
    throw plan::UserError(fmt::format(
        "data.val_fraction: the {} held-out tokens of {}{} hold no "
        "sample of training.seq_len+1 = {} tokens",
        src.end - src.begin, src.name, many ? " (" + src.key + ")" : "", src.seq_len + 1));
  throw plan::UserError(fmt::format("{}: the {} split of {} holds {} tokens{}: {}", src.key,
                                    split_name(s), src.name, src.end - src.begin,
                                    d.split.empty() ? "" : " (data.split " + d.split + ")", need));
}

}  // namespace

Dataset::Dataset(const plan::Config& c, const std::vector<SampleSplit>& splits)
    : blend_(std::vector<double>{1.0}), seq_len_(c.training.seq_len), vocab_(c.model.vocab_size) {
  const auto& d = c.data;
  const bool megatron = d.order == plan::DataOrder::kMegatron;
  const int64_t run = c.training.steps * c.training.global_batch;
  const auto train = named(d, SampleSplit::kTrain);
  const auto normal = numpy_normalize(blend_weights(d));
  // Megatron-Core builds each dataset of a weighted blend for its share of the run, plus 0.5%.
  const auto built = blend_dataset_sizes(normal, run, /*surplus=*/true);
  const SampleSplit all[] = {SampleSplit::kTrain, SampleSplit::kValid, SampleSplit::kTest};
  auto wanted = [&](SampleSplit s) {
    return std::find(splits.begin(), splits.end(), s) != splits.end();
  };
  for (size_t i = 0; i < train.size(); ++i) {
    observe::stop_if_signalled("reading the data");
    const auto stream = open_named(d, train[i]);
    for (auto s : all) {
      if (s != SampleSplit::kTrain && !named(d, s).empty()) continue;  // its own datasets
      if (s != SampleSplit::kTrain && !wanted(s)) continue;
      const auto r = cut(d, *stream, s, megatron);
      if (!r) continue;
      Source src;
      if (megatron) {
        std::optional<int64_t> want;
        if (s == SampleSplit::kTrain && !d.blend.empty()) want = built[i];
        if (s == SampleSplit::kTrain && train.size() == 1 && d.blend.empty()) want = run;
        if (s == SampleSplit::kValid) want = c.training.eval_batches * c.training.global_batch;
        src = megatron_source(train[i], stream, s, r->first, r->second, want, c);
      } else {
        src = tessel_source(train[i], stream, r->first, r->second, c);
        // Each dataset its own order: the plan's only one (and a blend's first) by the run's seed.
        src.shuffle = s == SampleSplit::kTrain && d.shuffle;
        src.seed = static_cast<int64_t>(static_cast<uint64_t>(c.run.seed) ^
                                        (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull));
      }
      require_samples(src, s, d, train.size() > 1);
      split_[index(s)].push_back(std::move(src));
    }
  }
  for (auto s : {SampleSplit::kValid, SampleSplit::kTest}) {
    std::vector<double> own;
    for (const auto& n : named(d, s)) {
      if (!wanted(s)) break;
      const auto stream = open_named(d, n);
      // Validation sized for one evaluation's rows, as data.split's; test one epoch.
      const std::optional<int64_t> want =
          s == SampleSplit::kValid
              ? std::optional<int64_t>(c.training.eval_batches * c.training.global_batch)
              : std::nullopt;
      auto src = megatron ? megatron_source(n, stream, s, 0, stream->documents(), want, c)
                          : tessel_source(n, stream, 0, stream->size(), c);
      require_samples(src, s, d, true);
      split_[index(s)].push_back(std::move(src));
      own.push_back(n.item.weight);
    }
    weights_[index(s)] = own.empty() ? normal : numpy_normalize(own);
    if (split_[index(s)].empty()) weights_[index(s)].clear();
  }
  set_blend(c, normal);
}

void Dataset::set_blend(const plan::Config& c, const std::vector<double>& normal) {
  const int64_t run = c.training.steps * c.training.global_batch;
  const auto& train = split_[index(SampleSplit::kTrain)];
  weights_[index(SampleSplit::kTrain)] = normal;
  if (c.data.order == plan::DataOrder::kTessel) {
    blend_ = Blend(blend_weights(c.data));
    return;
  }
  if (!c.data.blend.empty()) {  // Megatron-Core's BlendedDataset: of the run's size per weight
    blend_ = Blend(normal, /*numpy_sum=*/true);  // normalised again, as BlendedDataset does
    train_limit_ = 0;
    for (int64_t n : blend_dataset_sizes(normal, run, /*surplus=*/false)) train_limit_ += n;
    check_blend_fits(train);
    return;
  }
  if (train.size() == 1) {
    train_limit_ = train[0].samples;
    return;
  }
  // Several prefixes without weights: each one epoch, blended by its samples (as Megatron's
  // --data-path A B), never repeated.
  std::vector<double> by_size;
  int64_t total = 0;
  for (const auto& s : train) by_size.push_back(static_cast<double>(s.samples)), total += s.samples;
  if (total < run)
    throw plan::UserError(fmt::format(
        "data.path: data.order megatron reads {} prefixes without weights as Megatron-Core does "
        "(each one epoch, blended by its size, never repeated): they hold {} samples, and "
        "training.steps {} x training.global_batch {} = {} are needed; give data.blend weights "
        "(each dataset is then repeated as its share needs) or fewer steps",
        train.size(), total, c.training.steps, c.training.global_batch, run));
  blend_ = Blend(by_size, /*numpy_sum=*/true);
  weights_[index(SampleSplit::kTrain)] = blend_.weights();
  train_limit_ = run;
  check_blend_fits(train);
}

// Megatron-Core's BlendedDataset refuses a blend that asks a dataset for more samples than it
// built (its surplus makes room); so does Tessel, before any work.
void Dataset::check_blend_fits(const std::vector<Source>& train) {
  const auto taken = blend_.taken(train_limit_);
  for (size_t d = 0; d < train.size(); ++d)
    if (taken[d] > train[d].samples)
      throw plan::UserError(fmt::format(
          "{}: the blend asks {} samples of {}, which holds {} (Megatron-Core refuses this "
          "too: its 0.5% surplus was not enough)",
          train[d].key, taken[d], train[d].name, train[d].samples));
}

}  // namespace tessel::data
