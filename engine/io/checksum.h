// A fast streaming 64-bit checksum of file bytes (four independent lanes of 8-byte words,
// multiply-rotate rounds, an avalanche at the end): catches torn, truncated and bit-flipped
// checkpoint files. Not cryptographic. The value depends only on the byte stream, not on how it
// was split into update() calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace tessel::io {

class Checksum {
 public:
  void update(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    total_ += n;
    if (buffered_ > 0) {  // complete a buffered stripe first
      const size_t take = n < kStripe - buffered_ ? n : kStripe - buffered_;
      std::memcpy(buf_ + buffered_, p, take);
      buffered_ += take;
      p += take;
      n -= take;
      if (buffered_ < kStripe) return;
      stripe(buf_);
      buffered_ = 0;
    }
    for (; n >= kStripe; p += kStripe, n -= kStripe) stripe(p);
    std::memcpy(buf_, p, n);
    buffered_ = n;
  }

  uint64_t digest() const {
    uint64_t h = total_ * kP5;
    for (int i = 0; i < 4; ++i) h = (h ^ round(0, lane_[i])) * kP1 + kP4;
    for (size_t i = 0; i < buffered_; ++i) h = rotl((h ^ (buf_[i] * kP5)) * kP1, 11);
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
  }

  std::string hex() const {
    static const char* digits = "0123456789abcdef";
    std::string s(16, '0');
    uint64_t v = digest();
    for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 15];
    return s;
  }

 private:
  static constexpr size_t kStripe = 32;
  static constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                            kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                            kP5 = 0x27D4EB2F165667C5ull;
  static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t round(uint64_t acc, uint64_t word) { return rotl(acc + word * kP2, 31) * kP1; }
  void stripe(const uint8_t* p) {
    for (int i = 0; i < 4; ++i) {
      uint64_t w;
      std::memcpy(&w, p + 8 * i, 8);
      lane_[i] = round(lane_[i], w);
    }
  }
  uint64_t lane_[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  uint8_t buf_[kStripe] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

}  // namespace tessel::io
