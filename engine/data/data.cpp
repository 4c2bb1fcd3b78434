#include "engine/data/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>
#include <type_traits>

#include "core/observe/interrupt.h"
#include "engine/data/files.h"
#include "engine/io/safetensors.h"

namespace tessel::data {
namespace {

// Reports progress at most every two seconds while a long preparation runs.
class Progress {
 public:
  explicit Progress(std::string what) : what_(std::move(what)), last_(clock::now()) {}
  void tick(const std::function<std::string()>& status) {
    observe::stop_if_signalled("reading " + what_);
    if (clock::now() - last_ < std::chrono::seconds(2)) return;
    last_ = clock::now();
    spdlog::info("{}: {}", what_, status());
  }

 private:
  using clock = std::chrono::steady_clock;
  std::string what_;
  clock::time_point last_;
};

void add_text_files(TokenStream& s, const std::vector<std::string>& patterns) {
  std::vector<std::string> files;
  for (const auto& p : patterns)
    for (auto& f : expand(p)) files.push_back(std::move(f));
  // One owned buffer of uint16 tokens: every file's bytes followed by end-of-document.
  auto buf = std::make_shared<std::vector<uint16_t>>();
  Progress progress("data");
  std::vector<std::pair<int, int64_t>> bounds;  // (file, tokens) per file
  for (size_t i = 0; i < files.size(); ++i) {
    auto m = map_file(files[i]);
    const auto* bytes = static_cast<const uint8_t*>(m->ptr);
    if (int64_t bad = utf8_error(bytes, static_cast<int64_t>(m->size)); bad >= 0)
      throw plan::UserError(files[i] + ": not UTF-8 text (invalid byte at offset " +
                            std::to_string(bad) + "); data.format text reads UTF-8 files");
    buf->insert(buf->end(), bytes, bytes + m->size);
    buf->push_back(static_cast<uint16_t>(kTextEod));
    bounds.emplace_back(static_cast<int>(i), static_cast<int64_t>(m->size) + 1);
    progress.tick([&] {
      return fmt::format("read {}/{} files ({} tokens)", i + 1, files.size(), buf->size());
    });
  }
  int base = static_cast<int>(s.files.size());
  s.files.insert(s.files.end(), files.begin(), files.end());
  int64_t offset = 0;
  std::vector<int64_t> docs;
  for (auto [f, n] : bounds) {
    docs.push_back(s.size());
    s.add(Span{buf->data() + offset, n, 2, false, base + f, 0});
    offset += n;
  }
  s.add_docs(std::move(docs));
  s.storage.push_back(buf);
}

void add_token_files(TokenStream& s, const std::vector<std::string>& patterns, int elem) {
  for (const auto& p : patterns)
    for (const auto& f : expand(p)) {
      auto m = map_file(f);
      if (m->size % elem)
        throw plan::UserError(f + ": size " + std::to_string(m->size) +
                              " bytes is not a multiple of " + std::to_string(elem) +
                              " (data.token_dtype uint" + std::to_string(8 * elem) +
                              "): truncated or of another dtype");
      s.files.push_back(f);
      if (m->size)
        s.add(Span{m->ptr, static_cast<int64_t>(m->size) / elem, elem, false,
                   static_cast<int>(s.files.size()) - 1, 0});
      s.storage.push_back(m);
    }
}

}  // namespace

const char* file_kind(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFDIR:
      return "a folder";
    case S_IFIFO:
      return "a FIFO (named pipe)";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    case S_IFREG:
      return "a regular file";
    default:
      return "not a regular file";
  }
}

int open_regular(const std::string& path, const std::string& key) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) return -1;
  if (fd < 0) throw plan::UserError(key + ": " + path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    throw plan::UserError(key + ": " + path + " is " +
                          (S_ISREG(st.st_mode) ? std::string("unreadable: ") + std::strerror(err)
                                               : std::string(file_kind(st.st_mode))) +
                          ", not a regular file: give a file's path");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::optional<std::string> read_regular(const std::string& path, const std::string& key) {
  const int fd = open_regular(path, key);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[1 << 16];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  const int err = errno;
  ::close(fd);
  if (n < 0) throw plan::UserError(key + ": " + path + ": cannot read: " + std::strerror(err));
  return out;
}

std::shared_ptr<Mapping> map_file(const std::string& path, const std::string& key) {
  const int fd = open_regular(path, key);
  if (fd < 0) throw plan::UserError(key + ": " + path + ": cannot open: " + std::strerror(ENOENT));
  struct stat st {};
  ::fstat(fd, &st);
  auto m = std::make_shared<Mapping>();
  m->size = static_cast<size_t>(st.st_size);
  if (m->size) m->ptr = mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m->size && m->ptr == MAP_FAILED)
    throw plan::UserError(key + ": " + path + ": cannot map: " + std::strerror(errno));
  return m;
}

std::vector<std::string> expand(const std::string& pattern) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  std::sort(out.begin(), out.end());
  if (out.empty()) {
    // A relative path is read from the working directory, not from the plan's folder: say which.
    std::error_code ec;
    const bool relative = !pattern.empty() && pattern[0] != '/';
    const auto cwd = std::filesystem::current_path(ec);
    throw plan::UserError(
        "data.path: '" + pattern + "' matches no file" +
        (relative && !ec
             ? " (relative paths are read from the working directory, " + cwd.string() + ")"
             : ""));
  }
  return out;
}

int64_t utf8_error(const uint8_t* p, int64_t n) {
  // Well-formed sequences only (Unicode Table 3-7, RFC 3629), as Python's strict decoder takes
  // them: no overlong forms (C0, C1, E0 80-9F, F0 80-8F), surrogates (ED A0-BF) or code points
  // past U+10FFFF (F4 90-BF, F5-FF).
  for (int64_t i = 0; i < n;) {
    const uint8_t c = p[i];
    int len = 0;
    uint8_t lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (c < 0x80) {
      len = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    if (len == 0 || i + len > n) return i;
    if (len > 1 && (p[i + 1] < lo || p[i + 1] > hi)) return i;
    for (int k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return -1;
}

void TokenStream::add_docs(std::vector<int64_t> starts, const uint8_t* lens) {
  DocRun r;
  r.lens = lens;
  r.first = docs_;
  r.n = static_cast<int64_t>(starts.size());
  r.starts = std::move(starts);
  docs_ += r.n;
  doc_runs_.push_back(std::move(r));
}

void TokenStream::add_megatron_docs(int64_t n, int64_t base, const uint8_t* ptrs,
                                    const uint8_t* lens, int elem) {
  DocRun r;
  r.first = docs_;
  r.n = n;
  r.base = base;
  r.ptrs = ptrs;
  r.lens = lens;
  r.elem = elem;
  docs_ += n;
  doc_runs_.push_back(std::move(r));
}

int64_t TokenStream::doc_start(int64_t d) const {
  auto it = std::upper_bound(doc_runs_.begin(), doc_runs_.end(), d,
                             [](int64_t x, const DocRun& r) { return x < r.first; });
  const DocRun& r = *(it - 1);
  if (!r.ptrs) return r.starts[static_cast<size_t>(d - r.first)];  // owned
  int64_t ptr;
  std::memcpy(&ptr, r.ptrs + 8 * (d - r.first), 8);
  return r.base + ptr / r.elem;
}

DocSizes TokenStream::megatron_sizes() const {
  if (doc_runs_.size() != 1 || !doc_runs_[0].lens)
    throw std::logic_error("megatron_sizes: not a stream of one megatron prefix");
  return {doc_runs_[0].lens, doc_runs_[0].n};
}

void TokenStream::add(Span s) {
  starts_.push_back(total_);
  total_ += s.tokens;
  spans_.push_back(s);
}

void TokenStream::read(int64_t begin, int64_t n, int64_t* out) const {
  auto it = std::upper_bound(starts_.begin(), starts_.end(), begin);
  size_t k = static_cast<size_t>(it - starts_.begin()) - 1;
  int64_t off = begin - starts_[k];
  while (n > 0) {
    const Span& s = spans_[k];
    int64_t take = std::min(n, s.tokens - off);
    for (int64_t i = 0; i < take; ++i) {
      int64_t j = off + i;
      switch (s.elem_size) {
        case 1:
          out[i] = static_cast<const uint8_t*>(s.data)[j];
          break;
        case 2:
          out[i] = s.is_signed ? static_cast<const int16_t*>(s.data)[j]
                               : static_cast<const uint16_t*>(s.data)[j];
          break;
        case 4:  // not one ?: expression: int32 and uint32 would meet as uint32
          if (s.is_signed)
            out[i] = static_cast<const int32_t*>(s.data)[j];
          else
            out[i] = static_cast<const uint32_t*>(s.data)[j];
          break;
        default:
          out[i] = static_cast<const int64_t*>(s.data)[j];
          break;
      }
    }
    out += take;
    n -= take;
    off = 0;
    ++k;
  }
}

int64_t TokenStream::first_outside(int64_t begin, int64_t end, int64_t vocab) const {
  if (begin >= end) return -1;
  auto it = std::upper_bound(starts_.begin(), starts_.end(), begin);
  for (size_t k = static_cast<size_t>(it - starts_.begin()) - 1; k < spans_.size(); ++k) {
    const Span& s = spans_[k];
    const int64_t off = std::max<int64_t>(0, begin - starts_[k]);
    const int64_t n = std::min(s.tokens, end - starts_[k]) - off;
    if (n <= 0) break;
    int64_t bad = -1;
    switch (s.elem_size) {
      case 1:
        bad = first_outside_typed(static_cast<const uint8_t*>(s.data) + off, n, vocab);
        break;
      case 2:
        bad = s.is_signed
                  ? first_outside_typed(static_cast<const int16_t*>(s.data) + off, n, vocab)
                  : first_outside_typed(static_cast<const uint16_t*>(s.data) + off, n, vocab);
        break;
      case 4:
        bad = s.is_signed
                  ? first_outside_typed(static_cast<const int32_t*>(s.data) + off, n, vocab)
                  : first_outside_typed(static_cast<const uint32_t*>(s.data) + off, n, vocab);
        break;
      default:
        bad = first_outside_typed(static_cast<const int64_t*>(s.data) + off, n, vocab);
        break;
    }
    if (bad >= 0) return starts_[k] + off + bad;
  }
  return -1;
}

int64_t TokenStream::bytes(int64_t begin, int64_t end) const {
  int64_t out = 0;
  for (size_t k = 0; k < spans_.size(); ++k) {
    const int64_t lo = std::max(begin, starts_[k]),
                  hi = std::min(end, starts_[k] + spans_[k].tokens);
    if (hi > lo) out += (hi - lo) * spans_[k].elem_size;
  }
  return out;
}

std::string TokenStream::where(int64_t pos) const {
  auto it = std::upper_bound(starts_.begin(), starts_.end(), pos);
  size_t k = static_cast<size_t>(it - starts_.begin()) - 1;
  return files[spans_[k].file] + " (token " +
         std::to_string(spans_[k].file_token + pos - starts_[k]) + ")";
}

namespace {

// A Megatron prefix that is not one: what the user most likely meant.
std::string megatron_hint(const std::string& prefix) {
  namespace fs = std::filesystem;
  const auto ext = fs::path(prefix).extension().string();
  if (ext == ".bin" || ext == ".idx")
    return "; name the prefix without " + ext + " (" +
           fs::path(prefix).replace_extension().string() + ")";
  if (ext == ".jsonl" || ext == ".json" || ext == ".txt" ||
      prefix.find_first_of("*?[") != std::string::npos)
    return "; format megatron reads PREFIX.bin and PREFIX.idx: make them from text or JSONL with "
           "`tessel-data " +
           prefix + " --out PREFIX`, or use data.format text (raw text files)";
  return "";
}

}  // namespace

TokenStream open_stream(const plan::DataConfig& d) {
  TokenStream s;
  // Every error names the plan key (expand's "matches no file" already does).
  auto keyed = [](const plan::UserError& e) {
    const std::string what = e.what();
    return what.rfind("data.", 0) == 0 ? e : plan::UserError("data.path: " + what);
  };
  if (d.format == plan::DataFormat::kText) {
    try {
      add_text_files(s, d.path);
    } catch (const plan::UserError& e) {
      throw keyed(e);
    }
  } else if (d.format == plan::DataFormat::kTokens) {
    try {
      add_token_files(s, d.path, d.token_dtype == plan::TokenDtype::kUint16 ? 2 : 4);
    } catch (const plan::UserError& e) {
      throw keyed(e);
    }
  } else {
    for (const auto& prefix : d.path) {
      try {
        add_megatron(s, prefix);
      } catch (const plan::UserError& e) {  // the key, and the likely slip
        throw plan::UserError("data.path (format megatron): " + std::string(e.what()) +
                              megatron_hint(prefix));
      }
    }
  }
  return s;
}

void check_stream_ids(const plan::Config& c, const TokenStream& s, int64_t rank, int64_t world) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = s.size(), begin = n * rank / world, end = n * (rank + 1) / world;
  const int64_t vocab = c.model.vocab_size;
  // Spans are scanned a share at a time on this rank's threads.
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (end - begin) >> 20));
  std::vector<int64_t> bad(static_cast<size_t>(parts), -1);
  // std::thread, not at::parallel_for: ATen's is serial in files built without OpenMP.
  std::vector<std::thread> scanners;
  for (int64_t p = 0; p < parts; ++p)
    scanners.emplace_back([&, p] {
      bad[p] = s.first_outside(begin + (end - begin) * p / parts,
                               begin + (end - begin) * (p + 1) / parts, vocab);
    });
  for (auto& t : scanners) t.join();
  observe::stop_if_signalled("checking the data's token ids");
  for (int64_t pos : bad)
    if (pos >= 0) {
      int64_t id = 0;
      s.read(pos, 1, &id);
      throw plan::UserError(fmt::format(
          "data.path: {}: token id {} is outside model.vocab_size {} (ids run from 0 to {}); "
          "found by the start-up scan of the data, before any training",
          s.where(pos), id, vocab, vocab - 1));
    }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes = static_cast<double>(s.bytes(begin, end));
  if (rank == 0)
    spdlog::info(
        "data: token ids checked against model.vocab_size {}: {} tokens ({:.3g} MB{}) in "
        "{:.2f} s ({:.2f} GB/s)",
        vocab, end - begin, bytes / 1e6,
        world > 1 ? fmt::format(", this rank's share of {} tokens", n) : "", secs,
        bytes / 1e9 / std::max(secs, 1e-9));
}

}  // namespace tessel::data
