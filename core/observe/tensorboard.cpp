#include "core/observe/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/plan/config.h"

namespace tessel::observe {
namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

// Protocol-buffer wire format: just what Event{wall_time=1 double, step=2 int64,
// file_version=3 string, summary=5 Summary{value=1 Value{tag=1 string, simple_value=2 float}}}
// needs.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) {
  varint(out, static_cast<uint64_t>(field << 3 | wire));
}
void bytes_field(std::string& out, int field, const std::string& b) {
  key(out, field, 2);
  varint(out, b.size());
  out += b;
}
template <class T>
void fixed(std::string& out, int field, T v) {
  key(out, field, sizeof(T) == 8 ? 1 : 5);
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));  // little-endian hosts
}

std::string event_head(double wall_time, int64_t step) {
  std::string e;
  fixed(e, 1, wall_time);
  key(e, 2, 0);
  varint(e, static_cast<uint64_t>(step));
  return e;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& t = crc_table();
  uint32_t c = 0xffffffffu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const double t = now_s();
  path_ = (std::filesystem::path(dir) /
           ("events.out.tfevents." + std::to_string(static_cast<int64_t>(t)) + "." + host + "." +
            std::to_string(::getpid())))
              .string();
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_)
    throw plan::UserError(path_ + ": cannot write TensorBoard events: " + std::strerror(errno));
  std::string e = event_head(t, 0);
  bytes_field(e, 3, "brain.Event:2");
  record(e);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::scalars(int64_t step, const std::map<std::string, double>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    fixed(value, 2, static_cast<float>(v));
    bytes_field(summary, 1, value);
  }
  std::string e = event_head(now_s(), step);
  bytes_field(e, 5, summary);
  record(e);
}

void TensorBoardWriter::record(const std::string& payload) {
  const uint64_t len = payload.size();
  const uint32_t len_crc = masked(crc32c(&len, 8));
  const uint32_t data_crc = masked(crc32c(payload.data(), payload.size()));
  bool ok = std::fwrite(&len, 8, 1, f_) == 1 && std::fwrite(&len_crc, 4, 1, f_) == 1 &&
            std::fwrite(payload.data(), 1, payload.size(), f_) == payload.size() &&
            std::fwrite(&data_crc, 4, 1, f_) == 1 && std::fflush(f_) == 0;
  if (!ok)
    throw plan::UserError(path_ + ": cannot write TensorBoard events: " + std::strerror(errno));
}

}  // namespace tessel::observe
