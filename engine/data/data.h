// Training data. Every format becomes one read-only token stream (documents back to back, each
// ending in its end-of-document token); the stream is cut into windows of seq_len+1 tokens
// (window i starts at token i·seq_len, so neighbours share one token: the last target of one is
// the first input of the next); the end of the stream is held out for validation.
// The global order of samples is a pure function of (seed, epoch), and a run's position is one
// counter (samples consumed), so a resumed run reads exactly what an uninterrupted one would.
#pragma once

#include <torch/types.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/plan/config.h"
#include "engine/data/gpt_index.h"

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
  /// Documents, where the format marks them (a megatron index's sequences, empty ones included;
  /// text files); none in tokens files. A megatron file's are read from its mapped index, never
  /// copied: a trillion-token dataset costs no memory per document.
  int64_t documents() const { return docs_; }
  int64_t doc_start(int64_t d) const;  // its stream position
  int64_t doc_end(int64_t d) const { return d + 1 < docs_ ? doc_start(d + 1) : total_; }
  /// The documents' lengths as a megatron index holds them (int32, mapped): a stream of exactly
  /// one megatron prefix. std::logic_error otherwise.
  DocSizes megatron_sizes() const;
  /// Documents [docs, docs+n) begin at `starts` (owned), or for a megatron prefix at `base` plus
  /// its mapped pointers (bytes, `elem` bytes a token) with `lens` its mapped lengths.
  void add_docs(std::vector<int64_t> starts, const uint8_t* lens = nullptr);
  void add_megatron_docs(int64_t n, int64_t base, const uint8_t* ptrs, const uint8_t* lens,
                         int elem);
  std::vector<std::shared_ptr<void>> storage;  // keeps mappings and buffers alive

 private:
  std::vector<Span> spans_;
  std::vector<int64_t> starts_;  // stream position of each span
  int64_t total_ = 0;
  // Runs of documents: owned starts, or a megatron index's mapped pointers and lengths.
  struct DocRun {
    int64_t first = 0, n = 0, base = 0;
    std::vector<int64_t> starts;
    const uint8_t* ptrs = nullptr;
    const uint8_t* lens = nullptr;
    int elem = 1;
  };
  std::vector<DocRun> doc_runs_;
  int64_t docs_ = 0;
};

/// The files a path or glob names, sorted; UserError when none.
std::vector<std::string> expand(const std::string& pattern);
/// Index of the first invalid UTF-8 byte of p[0, n), or -1.
int64_t utf8_error(const uint8_t* p, int64_t n);

/// Opens the plan's data (text files/globs, megatron prefixes, or token files).
TokenStream open_stream(const plan::DataConfig& d);

/// The start-up scan of one stream of `tokens` and `megatron` data: rank `rank` of `world` checks
/// its share (the ranks agree on start-up, so one bad id anywhere stops every rank before any
/// work), and a token id outside [0, model.vocab_size) is a UserError naming the file, the
/// token's index in it and the value. Logs the share scanned and its speed.
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

}  // namespace tessel::data
