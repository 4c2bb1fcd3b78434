// Training data. Every format becomes one read-only token stream (documents back to back, each
// ending in its end-of-document token); the stream is cut into windows of seq_len+1 tokens
// (window i starts at token i·seq_len, so neighbours share one token: the last target of one is
// the first input of the next); the end of the stream is held out for validation.
// The global order of samples is a pure function of (seed, epoch), and a run's position is one
// counter (samples consumed), so a resumed run reads exactly what an uninterrupted one would.
#pragma once

#include <torch/types.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/plan/config.h"
#include "engine/data/blend.h"

namespace tessel::data {

constexpr int64_t kTextEod = 256;  // text format: bytes 0-255, then end-of-document
constexpr int64_t kTextVocab = 257;

/// One contiguous run of tokens inside a file (memory-mapped or owned).
struct Span {
  const void* data;
  int64_t tokens;
  int elem_size;  // 1, 2, 4 or 8 bytes, little-endian unsigned (signed for int16/32/64 data)
  bool is_signed;
  int file;            // index into TokenStream::files
  int64_t file_token;  // first token's index within that file (for messages)
};

/// Documents concatenated into one stream of token ids.
class TokenStream {
 public:
  int64_t size() const { return total_; }
  /// Copies tokens [begin, begin+n) into out.
  void read(int64_t begin, int64_t n, int64_t* out) const;
  /// "<file> (token <k>)" for the stream position, for messages.
  std::string where(int64_t pos) const;
  /// The first position in [begin, end) whose token id lies outside [0, vocab), or -1. Reads
  /// the mapped files in chunks with a vectorised max (and min, for signed data); only a chunk
  /// that holds a bad id is searched element by element.
  int64_t first_outside(int64_t begin, int64_t end, int64_t vocab) const;
  /// Bytes the files hold for positions [begin, end).
  int64_t bytes(int64_t begin, int64_t end) const;

  std::vector<std::string> files;
  void add(Span s);
  std::vector<std::shared_ptr<void>> storage;  // keeps mappings and buffers alive

 private:
  std::vector<Span> spans_;
  std::vector<int64_t> starts_;  // stream position of each span
  int64_t total_ = 0;
};

/// The files a path or glob names, sorted; UserError when none.
std::vector<std::string> expand(const std::string& pattern);
/// Index of the first invalid UTF-8 byte of p[0, n), or -1.
int64_t utf8_error(const uint8_t* p, int64_t n);

/// Opens the plan's data (text files/globs, megatron prefixes, or token files).
TokenStream open_stream(const plan::DataConfig& d);

/// The start-up scan of `tokens` and `megatron` data: rank `rank` of `world` checks its share of
/// the stream (the ranks agree on start-up, so one bad id anywhere stops every rank before any
/// work), and a token id outside [0, model.vocab_size) is a UserError naming the file, the
/// token's index in it and the value. Text data needs no scan (its 257 ids are checked with the
/// plan). Logs the share scanned and its speed.
void check_token_ids(const plan::Config& c, int64_t rank, int64_t world);
/// The same scan of one stream (one dataset of a blend).
void check_stream_ids(const plan::Config& c, const TokenStream& s, int64_t rank, int64_t world);

/// Megatron-LM MMapIndexedDataset: prefix.idx + prefix.bin. Errors name the file and what is wrong.
void add_megatron(TokenStream& s, const std::string& prefix);

/// Streams a Megatron-LM dataset: prefix.bin grows one document at a time; finish() writes
/// prefix.idx (version 1, one sequence per document) and renames both into place, so a prefix
/// is never left half-written. Tokens are uint16 (code 8) when the vocabulary fits, else int32
/// (code 4: what Megatron's own preprocessing writes; its format has no uint32 code).
class MegatronWriter {
 public:
  MegatronWriter(const std::string& prefix, int64_t vocab_size);
  ~MegatronWriter();  // unfinished: the temporary files are removed
  /// One document. An id at or above vocab_size is a UserError naming the document, the token
  /// and the value (never cut to 16 bits).
  void add(const uint32_t* tokens, int64_t n);
  void finish();
  int64_t documents() const { return static_cast<int64_t>(lens_.size()); }
  int64_t tokens() const { return tokens_; }
  int elem_size() const { return elem_; }

 private:
  std::string prefix_;
  int64_t vocab_;
  int elem_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lens_;
  std::vector<int64_t> ptrs_;
  int64_t tokens_ = 0, bytes_ = 0;
  std::vector<char> buf_;
};

/// Writes prefix.bin / prefix.idx (uint16 tokens, version 1) with one sequence per document.
void write_megatron(const std::string& prefix, const std::vector<std::vector<uint16_t>>& docs);

/// One dataset: the plan's data.path, or one entry of data.blend. Its stream's end is held out
/// for validation; its training windows are read in its own order.
struct Source {
  std::string name;  // its path(s), for messages and the log
  TokenStream stream;
  int64_t val_begin = 0, train_n = 0, val_n = 0;
  int64_t perm_epoch = -1;
  std::vector<int64_t> perm;
};

/// The plan's dataset weights, as given (data.blend's; one dataset of weight 1 for data.path).
std::vector<double> blend_weights(const plan::DataConfig& d);

class Dataset {
 public:
  Dataset(const plan::Config& c);
  int64_t train_samples() const;
  int64_t val_samples() const;
  int64_t train_tokens() const;
  /// The datasets (one without data.blend) and their normalised weights.
  const std::vector<Source>& sources() const { return sources_; }
  const std::vector<double>& weights() const { return blend_.weights(); }

  /// Rows at global positions [first, first+count) of the training order: [count, seq_len+1].
  torch::Tensor train_batch(int64_t first, int64_t count);
  /// Validation rows [first, first+count) (each dataset's in stream order, one after another,
  /// wrapping): [count, seq_len+1].
  torch::Tensor val_batch(int64_t first, int64_t count) const;

  /// Which window of the plan's only dataset the global position `pos` reads (pure in seed,
  /// epoch; exposed for tests).
  int64_t sample_at(int64_t pos) { return window_at(pos).second; }
  /// Global position `pos`: {dataset, the window of its stream it reads}.
  std::pair<int64_t, int64_t> window_at(int64_t pos);
  /// Samples each dataset gave to global positions [0, pos).
  std::vector<int64_t> taken(int64_t pos) { return blend_.taken(pos); }

 private:
  torch::Tensor windows(const std::vector<std::pair<int64_t, int64_t>>& starts,
                        int64_t first_label) const;

  std::vector<Source> sources_;
  Blend blend_;
  int64_t seq_len_, vocab_, seed_;
  bool shuffle_;
};

/// Which samples `tessel-train samples` writes: the training order, or the validation rows.
enum class SampleSplit { kTrain, kValid };

/// Writes samples [skip, skip + count) of `split`, in the order a run of plan `c` consumes them
/// (the global batch order, before any rank's share; validation from its first row at every
/// evaluation), to `out` as little-endian int32, seq_len + 1 tokens per sample (the inputs and
/// the next-token labels). Written beside and renamed, never half-written. Returns the samples
/// written. UserError for a split the plan has none of, naming the key.
int64_t write_samples(const plan::Config& c, SampleSplit split, int64_t skip, int64_t count,
                      const std::string& out);

/// The sample order of one epoch: a Fisher-Yates shuffle of [0, n) driven by splitmix64 seeded
/// from (seed, epoch). Our own generator, so the order never changes with the torch version.
std::vector<int64_t> epoch_permutation(int64_t n, int64_t seed, int64_t epoch);

}  // namespace tessel::data
