// The plan's datasets, cut into training, validation and test samples. Each dataset is a token
// stream (engine/data/data.h) with its documents; data.split cuts each by documents (or the end
// of the stream is held out, data.val_fraction); data.valid / data.test name datasets of their
// own. The samples of each split come in one of two orders (data.order):
// - tessel: windows of seq_len+1 tokens cut back to back (window i starts at token i·seq_len, so
//   neighbours share one token), each epoch shuffled by (seed, epoch); positions run on forever.
// - megatron: Megatron-Core's GPTDataset samples (engine/data/gpt_index.h), sized for the run's
//   steps × global_batch samples as Megatron sizes them.
// Training draws each global sample from a dataset by the blend's rule (engine/data/blend.h). A
// run's position is one counter (samples consumed), so a resumed run reads exactly what an
// uninterrupted one would, under any layout.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/plan/config.h"
#include "engine/data/blend.h"
#include "engine/data/data.h"
#include "engine/data/gpt_index.h"
#include "engine/data/index_cache.h"

namespace tessel::data {

enum class SampleSplit { kTrain, kValid, kTest };
const char* split_name(SampleSplit s);  // "train", "valid", "test"

/// Where a sample's tokens lie in its stream: pieces in reading order, seq_len+1 tokens in all.
struct Piece {
  int64_t pos, tokens;
};

/// One dataset's samples of one split.
class Source {
 public:
  std::string key;   // the plan key that names it: "data.path", "data.blend item 2", ...
  std::string name;  // its path(s), for messages and the log
  std::shared_ptr<const TokenStream> stream;
  int64_t begin = 0, end = 0;  // the stream positions it reads (its documents)
  int64_t samples = 0;         // tessel: windows per epoch; megatron: the samples indexed
  /// Sample k's pieces (tessel: k of any epoch; megatron: k < samples).
  void pieces(int64_t k, std::vector<Piece>& out);
  /// The window sample k reads (tessel order; exposed for tests).
  int64_t window(int64_t k);

  // tessel order
  bool shuffle = false;
  int64_t seed = 0, seq_len = 0;
  // megatron order
  std::shared_ptr<const MappedIndex> index;
  DocSizes sizes;  // its stream's document lengths (mapped)

 private:
  int64_t perm_epoch_ = -1;
  std::vector<int64_t> perm_;    // the epoch's order, or
  std::vector<int32_t> perm32_;  // it in 32 bits where the windows allow
  std::vector<DocPiece> doc_pieces_;
};

/// The plan's training dataset weights, as given (data.blend's; one of weight 1 for data.path).
std::vector<double> blend_weights(const plan::DataConfig& d);

/// The start-up scan of every dataset of the plan (train, validation, test) for token ids
/// outside [0, model.vocab_size) (check_stream_ids); text data needs none.
void check_token_ids(const plan::Config& c, int64_t rank, int64_t world);

/// Every dataset the plan names (training, data.valid, data.test) as (its plan key, its paths):
/// ("data.path", ...), ("data.blend item 2", ...), ("data.valid item 1", ...).
std::vector<std::pair<std::string, std::vector<std::string>>> named_datasets(
    const plan::DataConfig& d);

class Dataset {
 public:
  /// The training samples and those of `splits` (a split no one reads is not built: a plan whose
  /// test share is too small to hold a sample still trains).
  explicit Dataset(const plan::Config& c, const std::vector<SampleSplit>& splits = {
                                              SampleSplit::kValid, SampleSplit::kTest});
  /// A split's datasets (none for a split the plan holds no data for) and their normalised
  /// weights.
  const std::vector<Source>& sources(SampleSplit s) const { return split_[index(s)]; }
  const std::vector<double>& weights(SampleSplit s) const { return weights_[index(s)]; }
  const std::vector<Source>& sources() const { return sources(SampleSplit::kTrain); }
  const std::vector<double>& weights() const { return weights(SampleSplit::kTrain); }
  int64_t train_samples() const;  // one epoch of every training dataset (megatron: indexed)
  /// The training positions the run may read: train_samples(), or under data.order megatron the
  /// samples its indices were sized for (training.steps x global_batch), where that is fewer.
  int64_t readable_train_samples() const {
    return train_limit_ >= 0 ? std::min(train_limit_, train_samples()) : train_samples();
  }
  int64_t val_samples() const;  // one epoch of every validation dataset
  int64_t train_tokens() const;
  /// How many training samples the run may read (megatron: the blend's size); -1: unbounded.
  int64_t train_limit() const { return train_limit_; }

  /// Rows at global positions [first, first+count) of the training order: [count, seq_len+1].
  torch::Tensor train_batch(int64_t first, int64_t count);
  /// Rows [first, first+count) of split `s`'s dataset `d` (validation and test in stream order;
  /// wrapping past its samples): [count, seq_len+1].
  torch::Tensor split_batch(SampleSplit s, int64_t d, int64_t first, int64_t count);

  /// The window of the plan's only dataset that global position `pos` reads (tessel order).
  int64_t sample_at(int64_t pos) { return window_at(pos).second; }
  /// Global position `pos`: {dataset, its sample (tessel: the window of its stream)}.
  std::pair<int64_t, int64_t> window_at(int64_t pos);
  /// Samples each dataset gave to global positions [0, pos).
  std::vector<int64_t> taken(int64_t pos) { return blend_.taken(pos); }
  std::vector<int64_t> shares(int64_t pos, bool* exact) { return blend_.shares(pos, exact); }
  /// Datasets the training samples are blended from.
  size_t blend_size() const { return blend_.size(); }

 private:
  static size_t index(SampleSplit s) { return static_cast<size_t>(s); }
  void set_blend(const plan::Config& c, const std::vector<double>& normal);
  void check_blend_fits(const std::vector<Source>& train);
  void check_limit(int64_t pos) const;  // data.order megatron's bound, as a UserError
  torch::Tensor rows(const std::vector<std::pair<Source*, int64_t>>& at, int64_t first_label);

  std::vector<Source> split_[3];
  std::vector<double> weights_[3];
  Blend blend_;
  int64_t train_limit_ = -1;
  int64_t seq_len_, vocab_;
};

/// Writes samples [skip, skip + count) of `split`, in the order a run of plan `c` consumes them,
/// to `out` as little-endian int32, seq_len + 1 tokens per sample (the inputs and the next-token
/// labels). Training: the global batch order, before any rank's share. Validation and test: each
/// dataset's samples in turn (an evaluation reads the first training.eval_batches ×
/// global_batch of each validation dataset). Written beside and renamed, never
/// half-written; nothing is left beside when it fails. Returns the samples written. UserError for
/// a split the plan has none of, naming the keys; before anything is read or written, for an
/// `out` that is a folder, FIFO or device, one of the plan's inputs, or an existing file
/// without `force`.
int64_t write_samples(const plan::Config& c, SampleSplit split, int64_t skip, int64_t count,
                      const std::string& out, bool force = false);

/// The sample order of one epoch: a Fisher-Yates shuffle of [0, n) driven by splitmix64 seeded
/// from (seed, epoch). Our own generator, so the order never changes with the torch version.
std::vector<int64_t> epoch_permutation(int64_t n, int64_t seed, int64_t epoch);

}  // namespace tessel::data
