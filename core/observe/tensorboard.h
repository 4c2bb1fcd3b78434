// TensorBoard event files written directly (no TensorFlow or protobuf library): TFRecord framing
// (length, masked CRC-32C, payload, masked CRC-32C) around hand-encoded `Event` protos holding
// scalar summaries. `tensorboard --logdir <run.output_dir>/tensorboard` reads them.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace tessel::observe {

class TensorBoardWriter {
 public:
  /// Creates <dir>/events.out.tfevents.<unix time>.<host>.<pid> (the name TensorBoard looks for).
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  /// One event at `step` with a scalar per tag ("train/loss", ...); flushed at once.
  void scalars(int64_t step, const std::map<std::string, double>& values);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& payload);
  std::string path_;
  std::FILE* f_ = nullptr;
};

/// CRC-32C (Castagnoli), as TFRecord frames use it (exposed for tests).
uint32_t crc32c(const void* data, size_t n);

}  // namespace tessel::observe
