// What engine/data/data.cpp and engine/data/megatron.cpp share: files mapped read-only, Megatron's
// index magic, and the scan for token ids outside a vocabulary.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace tessel::data {

struct Mapping {
  void* ptr = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (ptr != MAP_FAILED && size) munmap(ptr, size);
  }
};

/// Maps a whole file read-only; an empty file maps to nothing. UserError naming `key` (the plan key
/// that gave the path, e.g. "data.path") and the file when it cannot be opened or mapped, or is
/// not a regular file (a folder, a FIFO, a device: refused at once, never waited on).
std::shared_ptr<Mapping> map_file(const std::string& path, const std::string& key = "data.path");

/// The file `path` opened read-only (O_CLOEXEC), or -1 when it does not exist; a UserError naming
/// `key` and the path when it exists but cannot be opened or is not a regular file. Opening does
/// not block on a FIFO (O_NONBLOCK while the kind is checked).
int open_regular(const std::string& path, const std::string& key);

/// What kind of file st_mode is when it is not a regular one ("a FIFO", "a character device"...).
const char* file_kind(unsigned mode);

/// The whole of the regular file `path`, or nullopt when it does not exist (errors as
/// open_regular).
std::optional<std::string> read_regular(const std::string& path, const std::string& key);

/// The first 9 bytes of a Megatron .idx file.
inline constexpr char kIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};

// Largest and smallest id of p[0, n), written so that the compiler vectorises the loop.
template <class T>
inline std::pair<int64_t, int64_t> min_max(const T* p, int64_t n) {
  T lo = std::numeric_limits<T>::max(), hi = std::numeric_limits<T>::min();
  for (int64_t i = 0; i < n; ++i) {
    lo = p[i] < lo ? p[i] : lo;
    hi = p[i] > hi ? p[i] : hi;
  }
  return {static_cast<int64_t>(lo), static_cast<int64_t>(hi)};
}

/// The first position of p[0, n) whose id is outside [0, vocab), or -1.
template <class T>
inline int64_t first_outside_typed(const T* p, int64_t n, int64_t vocab) {
  constexpr int64_t kChunk = 1 << 16;
  // An unsigned type whose every value is below vocab cannot hold a bad id.
  if (!std::is_signed_v<T> &&
      static_cast<uint64_t>(std::numeric_limits<T>::max()) < static_cast<uint64_t>(vocab))
    return -1;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t m = std::min(kChunk, n - c);
    const auto [lo, hi] = min_max(p + c, m);
    if (lo >= 0 && hi < vocab) continue;
    for (int64_t i = 0; i < m; ++i)
      if (static_cast<int64_t>(p[c + i]) < 0 || static_cast<int64_t>(p[c + i]) >= vocab)
        return c + i;
  }
  return -1;
}

}  // namespace tessel::data
