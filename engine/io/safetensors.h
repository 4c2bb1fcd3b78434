// Safetensors (https://github.com/huggingface/safetensors): 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets}}, then raw little-endian bytes. No pickle.
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tessel::io {

struct SafetensorsFile {
  std::map<std::string, torch::Tensor> tensors;  // CPU, contiguous
  std::map<std::string, std::string> metadata;   // "__metadata__"
  uint64_t bytes = 0;                            // the file's size
  std::string checksum;                          // of every byte of the file (engine/io/checksum.h)
};

/// What write_safetensors wrote.
struct WrittenFile {
  uint64_t bytes = 0;
  std::string checksum;  // as SafetensorsFile::checksum
};

/// A safetensors file mapped read-only, its header parsed and validated as read_safetensors does;
/// tensors are views of the mapping (valid while it lives, never written): reading one touches
/// only its pages.
class MappedSafetensors {
 public:
  explicit MappedSafetensors(const std::string& path);
  ~MappedSafetensors();
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;

  const std::string& path() const { return path_; }
  uint64_t bytes() const { return size_; }
  const void* data() const { return data_; }
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// A CPU tensor over the mapping (undefined when absent); copy what you keep.
  torch::Tensor view(const std::string& name) const;
  /// Drops the mapping's pages under [ptr, ptr + n) (a part of a view) from memory; they are
  /// read again from the file if touched later.
  void release(const void* ptr, size_t n) const;
  /// The checksum of every byte of the file, read through a small buffer (not kept resident).
  std::string checksum() const;

 private:
  struct Entry {
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, size = 0;  // in the data section
  };
  std::string path_;
  void* data_ = reinterpret_cast<void*>(-1);  // MAP_FAILED
  size_t size_ = 0;
  uint64_t data_offset_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
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

}  // namespace tessel::io
