#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "core/plan/config.h"
#include "engine/io/checksum.h"

namespace tessel::io {
namespace {

constexpr uint64_t kMaxHeader = 100ull << 20;  // the reference implementation's limit

const std::map<std::string, torch::ScalarType>& dtypes() {
  static const std::map<std::string, torch::ScalarType> m = {
      {"F64", torch::kFloat64},   {"F32", torch::kFloat32}, {"F16", torch::kFloat16},
      {"BF16", torch::kBFloat16}, {"I64", torch::kInt64},   {"I32", torch::kInt32},
      {"I16", torch::kInt16},     {"I8", torch::kInt8},     {"U8", torch::kUInt8},
      {"BOOL", torch::kBool}};
  return m;
}

std::string dtype_name(torch::ScalarType t) {
  for (const auto& [name, type] : dtypes())
    if (type == t) return name;
  throw std::invalid_argument(std::string("safetensors: unsupported dtype ") + c10::toString(t));
}

void fsync_path(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes through `write` into <path>.tmp, fsyncs it, renames it over `path` and fsyncs the folder:
// a reader sees the old file or the whole new one, never a part.
void write_atomic(const std::string& path, const std::function<bool(FILE*)>& write) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw plan::UserError(tmp + ": cannot write: " + std::strerror(errno));
  bool ok = write(f) && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw plan::UserError(path + ": write failed: " + std::strerror(errno));
  }
  std::filesystem::rename(tmp, path);
  const auto dir = std::filesystem::path(path).parent_path().string();
  fsync_path(dir.empty() ? "." : dir, O_RDONLY | O_DIRECTORY);
}

plan::UserError invalid_file(const std::string& path, const std::string& why) {
  return plan::UserError(path + ": not a valid safetensors file: " + why);
}

// Maps `path` read-only into (data, size); data stays MAP_FAILED for an empty file.
void map_file(const std::string& path, void*& data, size_t& size) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw plan::UserError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  fstat(fd, &st);
  size = static_cast<size_t>(st.st_size);
  if (size > 0) data = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (size < 8)
    throw invalid_file(path, "file of " + std::to_string(size) +
                                 " bytes is shorter than its 8-byte header length");
  if (data == MAP_FAILED) throw plan::UserError(path + ": cannot map: " + std::strerror(errno));
}

// The header's length (the file's first 8 bytes), checked against the limit and the file size.
uint64_t header_length(const std::string& path, const uint8_t* bytes, size_t size) {
  uint64_t n = 0;
  std::memcpy(&n, bytes, 8);  // little-endian host (x86_64, aarch64)
  if (n > kMaxHeader)
    throw invalid_file(path, "header of " + std::to_string(n) + " bytes exceeds the 100 MB limit");
  if (8 + n > size)
    throw invalid_file(path, "header length " + std::to_string(n) +
                                 " runs past the end of the file (" + std::to_string(size) +
                                 " bytes)");
  return n;
}

// The `n`-byte JSON header at `begin`: an object without duplicate keys.
nlohmann::json parse_header(const std::string& path, const uint8_t* begin, uint64_t n) {
  // Duplicate keys are refused: nlohmann keeps the last silently, so watch the parser's key events.
  std::set<std::string> seen;
  std::string dup;
  nlohmann::json::parser_callback_t cb = [&](int depth, nlohmann::json::parse_event_t ev,
                                             nlohmann::json& parsed) {
    if (ev == nlohmann::json::parse_event_t::key && depth == 1 &&
        !seen.insert(parsed.get<std::string>()).second)
      dup = parsed.get<std::string>();
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(begin, begin + n, cb);
  } catch (const nlohmann::json::exception& e) {
    throw invalid_file(path, std::string("header is not JSON: ") + e.what());
  }
  if (!dup.empty()) throw invalid_file(path, "duplicate tensor name '" + dup + "'");
  if (!header.is_object()) throw invalid_file(path, "header is not a JSON object");
  return header;
}

// One tensor's header entry, validated: [begin, end) in the data section.
struct HeaderEntry {
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

HeaderEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& e,
                        uint64_t data_size) {
  auto what = [&](const std::string& w) {
    return invalid_file(path, "tensor '" + name + "': " + w);
  };
  if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
    throw what("needs dtype, shape and data_offsets");
  auto dt = dtypes().find(e["dtype"].is_string() ? e["dtype"].get<std::string>() : "");
  if (dt == dtypes().end()) throw what("unsupported dtype " + e["dtype"].dump());
  std::vector<int64_t> shape;
  uint64_t numel = 1;
  for (const auto& d : e["shape"]) {
    if (!d.is_number_unsigned())
      throw what("shape " + e["shape"].dump() + " is not a list of non-negative integers");
    shape.push_back(d.get<int64_t>());
    numel *= d.get<uint64_t>();
  }
  const auto& off = e["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    throw what("data_offsets " + off.dump() + " is not [begin, end]");
  uint64_t b = off[0], en = off[1];
  if (b > en || en > data_size)
    throw what("data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
               "] out of range of the " + std::to_string(data_size) + "-byte data section");
  uint64_t want = numel * c10::elementSize(dt->second);
  if (en - b != want)
    throw what("holds " + std::to_string(en - b) + " bytes but its shape and dtype need " +
               std::to_string(want));
  return {dt->second, std::move(shape), b, en};
}

// Refuses tensors whose byte ranges (begin, end, name) overlap.
void check_no_overlap(const std::string& path,
                      std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (std::get<0>(ranges[i]) < std::get<1>(ranges[i - 1]))
      throw invalid_file(path, "tensors '" + std::get<2>(ranges[i - 1]) + "' and '" +
                                   std::get<2>(ranges[i]) + "' overlap");
}

std::pair<int, int> device_key(const c10::Device& d) {
  return {static_cast<int>(d.type()), d.index()};
}

// Host copies of `tensors`, contiguous, in order. CPU tensors stay where they are (copied only
// when not contiguous). Device tensors land in one pinned buffer, each copy queued without waiting
// and only the last of each device's waiting: that one wait covers every earlier copy queued on
// the device's stream, where one blocking copy per tensor would stall the device once per tensor.
std::vector<torch::Tensor> host_copies(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  constexpr int64_t kAlign = 64;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  std::map<std::pair<int, int>, size_t> last;  // per device (type, index), its last tensor
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i].second;
    offsets.push_back(total);
    if (!t.device().is_cpu()) {
      total += (static_cast<int64_t>(t.nbytes()) + kAlign - 1) / kAlign * kAlign;
      last[device_key(t.device())] = i;
    }
  }
  torch::Tensor pinned;
  if (total > 0) pinned = torch::empty({total}, torch::dtype(torch::kUInt8).pinned_memory(true));
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto t = tensors[i].second.detach();
    if (t.device().is_cpu()) {
      out.push_back(t.contiguous());
      continue;
    }
    auto host = pinned.narrow(0, offsets[i], static_cast<int64_t>(t.nbytes()))
                    .view(t.scalar_type())
                    .view(t.sizes());
    host.copy_(t, /*non_blocking=*/last.at(device_key(t.device())) != i);
    out.push_back(host);
  }
  return out;
}

}  // namespace

MappedSafetensors::MappedSafetensors(const std::string& path) : path_(path) {
  map_file(path, data_, size_);
  const auto* bytes = static_cast<const uint8_t*>(data_);
  const uint64_t n = header_length(path, bytes, size_);
  const uint64_t data_size = size_ - 8 - n;
  data_offset_ = 8 + n;
  nlohmann::json header = parse_header(path, bytes + 8, n);

  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  for (auto& [name, e] : header.items()) {
    if (name == "__metadata__") {
      if (!e.is_object()) throw invalid_file(path, "__metadata__ is not an object");
      for (auto& [k, v] : e.items())
        if (v.is_string()) metadata_[k] = v.get<std::string>();
      continue;
    }
    HeaderEntry entry = parse_entry(path, name, e, data_size);
    ranges.emplace_back(entry.begin, entry.end, name);
    entries_.emplace(
        name, Entry{entry.dtype, std::move(entry.shape), entry.begin, entry.end - entry.begin});
  }
  check_no_overlap(path, std::move(ranges));
}

MappedSafetensors::~MappedSafetensors() {
  if (data_ != MAP_FAILED && size_) munmap(data_, size_);
}

std::vector<std::string> MappedSafetensors::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

torch::Tensor MappedSafetensors::view(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return {};
  const auto& e = it->second;
  if (e.size == 0) return torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
  auto* at = static_cast<uint8_t*>(data_) + data_offset_ + e.begin;
  return torch::from_blob(at, e.shape, torch::TensorOptions().dtype(e.dtype));
}

void MappedSafetensors::release(const void* ptr, size_t n) const {
  if (n == 0) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t lo = begin / page * page, hi = begin + n;
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // a hint: failure is harmless
}

std::string MappedSafetensors::checksum() const {
  // Through a small buffer with pread, not the mapping: the file's pages stay out of this
  // process's resident set (only the tensors read later are mapped in).
  int fd = ::open(path_.c_str(), O_RDONLY);
  if (fd < 0) throw plan::UserError(path_ + ": cannot open: " + std::strerror(errno));
  Checksum sum;
  std::vector<uint8_t> buf(8 << 20);
  off_t at = 0;
  while (true) {
    const ssize_t got = ::pread(fd, buf.data(), buf.size(), at);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      throw plan::UserError(path_ + ": cannot read: " + std::strerror(err));
    }
    if (got == 0) break;
    sum.update(buf.data(), static_cast<size_t>(got));
    at += got;
  }
  ::close(fd);
  return sum.hex();
}

SafetensorsFile read_safetensors(const std::string& path) {
  MappedSafetensors f(path);
  SafetensorsFile out;
  out.metadata = f.metadata();
  out.bytes = f.bytes();
  Checksum sum;
  sum.update(f.data(), f.bytes());
  out.checksum = sum.hex();
  for (const auto& name : f.names()) out.tensors.emplace(name, f.view(name).clone());
  return out;
}

WrittenFile write_safetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  const std::vector<torch::Tensor> cpu = host_copies(tensors);
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& name = tensors[i].first;
    const auto& c = cpu[i];
    uint64_t bytes = c.numel() * c.element_size();
    header[name] = {{"dtype", dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
  Checksum sum;
  WrittenFile out;
  auto put = [&](const void* p, size_t bytes, FILE* f) {
    sum.update(p, bytes);
    out.bytes += bytes;
    return bytes == 0 || std::fwrite(p, 1, bytes, f) == bytes;
  };
  write_atomic(path, [&](FILE* f) {
    const uint64_t n = h.size();
    bool ok = put(&n, 8, f) && put(h.data(), h.size(), f);
    for (const auto& c : cpu) ok = ok && put(c.data_ptr(), c.numel() * c.element_size(), f);
    return ok;
  });
  out.checksum = sum.hex();
  return out;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  write_atomic(path,
               [&](FILE* f) { return std::fwrite(text.data(), 1, text.size(), f) == text.size(); });
}

}  // namespace tessel::io
