// Megatron-order sample indices built once and kept in a folder (data.index_cache; by default
// beside the data, as Megatron-Core keeps its own), keyed by everything that determines them:
// the index file (its path, size and time), the documents, samples, seq_len and seed. Every rank
// maps the same file; a file is written beside and renamed, so a reader sees a whole one or
// none, and it is checked on reuse (its description, its sizes and a checksum of its arrays): a
// file that fails is rebuilt, and the log says why.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "engine/data/gpt_index.h"

namespace tessel::data {

/// A GptView over a mapped cache file, kept alive with it.
struct MappedIndex {
  GptView view;
  std::shared_ptr<void> storage;
  bool built = false;  // built by this call (else reused)
  std::string path;
};

/// "" when a mapped index fits the data it is read with, else what is wrong (check_gpt_view).
using IndexCheck = std::function<std::string(const GptView&)>;

/// The index `description` names, from `folder` (created when missing), built by `build` when it
/// is not there or fails its checks (its checksum, which covers the description, and `check`).
/// UserError naming data.index_cache when the folder cannot be written, or the file or its lock
/// is there but not a regular file (a FIFO, a device, a symbolic link for the lock).
MappedIndex cached_index(const std::string& folder, const std::string& description,
                         const std::function<GptIndex()>& build, const IndexCheck& check);

/// 64-bit checksum of `n` bytes (words multiplied in; fast enough to check gigabytes at start-up).
uint64_t index_checksum(const void* p, size_t n);

}  // namespace tessel::data
