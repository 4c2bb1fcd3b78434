#include "engine/data/index_cache.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/plan/user_error.h"
#include "engine/data/files.h"

namespace tessel::data {
namespace {

// 2: the checksum covers the header and the description too (a file whose arrays were
// recomputed for other data no longer passes).
constexpr char kMagic[9] = "TSLGPTX2";
struct Header {
  char magic[8];
  int64_t desc_bytes, n_documents, n_samples, epochs;
  uint64_t checksum;
};

int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

// Byte offsets of the arrays after the header and description.
struct Layout {
  int64_t documents, starts, order, end;
};
Layout layout_of(const Header& h) {
  Layout l{};
  l.documents = static_cast<int64_t>(sizeof(Header)) + pad8(h.desc_bytes);
  l.starts = l.documents + pad8(4 * h.n_documents);
  l.order = l.starts + 16 * (h.n_samples + 1);
  l.end = l.order + 8 * h.n_samples;
  return l;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The file's checksum: its key (the description: data, split, samples, seq_len, seed), its
// header's counts and its three arrays (each read where it lies: no copy to write or check).
uint64_t file_checksum(const std::string& description, const Header& h, const void* documents,
                       const void* starts, const void* order) {
  const int64_t counts[3] = {h.n_documents, h.n_samples, h.epochs};
  const uint64_t k = fnv1a(description) ^ index_checksum(counts, sizeof counts);
  const uint64_t a = index_checksum(documents, static_cast<size_t>(4 * h.n_documents));
  const uint64_t b = index_checksum(starts, static_cast<size_t>(16 * (h.n_samples + 1)));
  const uint64_t c = index_checksum(order, static_cast<size_t>(8 * h.n_samples));
  return k ^ (a << 3 | a >> 61) ^ (b << 1 | b >> 63) ^ (c << 2 | c >> 62);
}

// The mapped file `path` if it holds `description` whole and intact; else "" and why.
// A path that exists but is not a regular file (a FIFO, a device, a folder) is refused: it is
// not the cache's to replace.
MappedIndex try_map(const std::string& path, const std::string& description,
                    const IndexCheck& check, std::string& why) {
  MappedIndex m;
  const int fd = open_regular(path, "data.index_cache");
  if (fd < 0) return why = "not built yet", m;
  ::close(fd);
  std::shared_ptr<Mapping> map;
  try {
    map = map_file(path, "data.index_cache");
  } catch (const plan::UserError& e) {
    why = e.what();
    return m;
  }
  Header h{};
  if (map->size < sizeof(Header)) return why = "shorter than its header", m;
  std::memcpy(&h, map->ptr, sizeof(Header));
  const auto* base = static_cast<const uint8_t*>(map->ptr);
  if (std::memcmp(h.magic, kMagic, 8) != 0) return why = "not a Tessel index file", m;
  const auto size = static_cast<int64_t>(map->size);  // bounds each count before any product
  if (h.desc_bytes < 0 || h.n_documents < 0 || h.n_samples < 0 || h.desc_bytes > size ||
      h.n_documents > size / 4 || h.n_samples > size / 16)
    return why = "a damaged header", m;
  const Layout l = layout_of(h);
  if (static_cast<uint64_t>(l.end) != map->size)
    return why = fmt::format("{} bytes where its header says {}", map->size, l.end), m;
  if (std::string(reinterpret_cast<const char*>(base + sizeof(Header)),
                  static_cast<size_t>(h.desc_bytes)) != description)
    return why = "made for other data or settings (its description differs)", m;
  if (file_checksum(description, h, base + l.documents, base + l.starts, base + l.order) !=
      h.checksum)
    return why = "it fails its checksum (damaged, or not this data's)", m;
  m.view = {reinterpret_cast<const int32_t*>(base + l.documents),
            reinterpret_cast<const int64_t*>(base + l.starts),
            reinterpret_cast<const int64_t*>(base + l.order),
            h.n_documents,
            h.n_samples,
            h.epochs};
  // Checked once where it is mapped: every later read of it is then within the dataset.
  if (const std::string bad = check(m.view); !bad.empty()) {
    why = "its indices do not fit the data: " + bad;
    return MappedIndex{};
  }
  m.storage = map;
  return m;
}

void write_index(const std::string& path, const std::string& description, const GptIndex& ix) {
  Header h{};
  std::memcpy(h.magic, kMagic, 8);
  h.desc_bytes = static_cast<int64_t>(description.size());
  h.n_documents = static_cast<int64_t>(ix.documents.size());
  h.n_samples = ix.size();
  h.epochs = ix.epochs;
  h.checksum =
      file_checksum(description, h, ix.documents.data(), ix.starts.data(), ix.order.data());
  const std::string tmp = fmt::format("{}.tmp.{}.{}", path, ::getpid(), std::random_device{}());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    const std::vector<char> zeros(8, 0);
    auto put = [&](const void* p, int64_t n) {
      f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
      f.write(zeros.data(), static_cast<std::streamsize>(pad8(n) - n));
    };
    f.write(reinterpret_cast<const char*>(&h), sizeof(h));
    put(description.data(), h.desc_bytes);
    put(ix.documents.data(), 4 * h.n_documents);
    put(ix.starts.data(), 8 * static_cast<int64_t>(ix.starts.size()));
    put(ix.order.data(), 8 * h.n_samples);
    f.close();
    if (!f) {
      std::filesystem::remove(tmp);
      throw plan::UserError(
          fmt::format("data.index_cache: cannot write {}: {}", tmp, std::strerror(errno)));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);  // whole, or not there
  if (ec) {
    std::filesystem::remove(tmp);
    throw plan::UserError(
        fmt::format("data.index_cache: cannot rename {} to {}: {}", tmp, path, ec.message()));
  }
}

}  // namespace

uint64_t index_checksum(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t h[4] = {0x9e3779b97f4a7c15ull, 0xbf58476d1ce4e5b9ull, 0x94d049bb133111ebull, 1};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)  // four independent lanes
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, b + i + 8 * k, 8);
      h[k] = (h[k] ^ w) * 0x100000001b3ull;
    }
  uint64_t out = h[0] ^ (h[1] << 1) ^ (h[2] << 2) ^ (h[3] << 3);
  for (; i < n; ++i) out = (out ^ b[i]) * 0x100000001b3ull;
  return out ^ n;
}

MappedIndex cached_index(const std::string& folder, const std::string& description,
                         const std::function<GptIndex()>& build, const IndexCheck& check) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec || ::access(folder.c_str(), W_OK) != 0)
    throw plan::UserError(fmt::format(
        "data.index_cache: cannot write the sample indices to {} ({}): set data.index_cache to "
        "a writable folder (it is shared by runs over the same data)",
        folder, ec ? ec.message() : std::strerror(errno)));
  const std::string path = fmt::format("{}/gpt-{:016x}.tix", folder, fnv1a(description));
  std::string why = "not built yet";
  if (auto m = try_map(path, description, check, why); m.storage) {
    m.path = path;
    return m;
  }
  // One builder at a time where the file system locks (a node's ranks): the others wait, then
  // find the file. Where it does not, each builds and renames the same bytes into place.
  struct Lock {
    int fd;
    ~Lock() {
      if (fd >= 0) ::close(fd);  // releases it
    }
  } lock{::open((path + ".lock").c_str(), O_CREAT | O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0644)};
  if (lock.fd < 0 && errno == ELOOP)  // a link would make us create or lock what it names
    throw plan::UserError(fmt::format(
        "data.index_cache: {}.lock is a symbolic link: the cache's lock is a plain file it "
        "makes itself (remove the link)",
        path));
  if (lock.fd >= 0) {
    struct stat st {};
    if (::fstat(lock.fd, &st) != 0 || !S_ISREG(st.st_mode))
      throw plan::UserError(
          fmt::format("data.index_cache: {}.lock is {}, not a regular file "
                      "(remove it)",
                      path, file_kind(st.st_mode)));
    ::flock(lock.fd, LOCK_EX);
  }
  MappedIndex m = try_map(path, description, check, why);
  if (!m.storage) {
    if (why.find("No such file") == std::string::npos && why != "not built yet")
      spdlog::warn("data.index_cache: {}: {}; rebuilding it", path, why);
    write_index(path, description, build());
    m = try_map(path, description, check, why);
    m.built = true;
  }
  if (!m.storage)
    throw plan::UserError(
        fmt::format("data.index_cache: {} was written and reads back wrong: {}", path, why));
  m.path = path;
  return m;
}

}  // namespace tessel::data
