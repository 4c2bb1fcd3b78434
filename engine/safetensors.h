// Safetensors (https://github.com/huggingface/safetensors): 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets}}, then raw little-endian bytes. No pickle.
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tessel {

struct SafetensorsFile {
  std::map<std::string, torch::Tensor> tensors;  // CPU, contiguous
  std::map<std::string, std::string> metadata;   // "__metadata__"
  uint64_t bytes = 0;                            // the file's size
  std::string checksum;                          // of every byte of the file (engine/checksum.h)
};

/// What write_safetensors wrote.
struct WrittenFile {
  uint64_t bytes = 0;
  std::string checksum;  // as SafetensorsFile::checksum
};

/// Reads and validates a whole file. Refuses (UserError naming the file and tensor) headers over
/// 100 MB, bad JSON, duplicate keys, unknown dtypes, sizes that disagree with shapes, and
/// overlapping or out-of-range offsets.
SafetensorsFile read_safetensors(const std::string& path);

/// Writes atomically: a temporary file in the same folder, fsynced, then renamed into place.
WrittenFile write_safetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

/// Writes `text` to `path` atomically (temporary file, fsync, rename, fsync of the folder).
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace tessel
