// Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx): read as a token stream, and written.
#include <fmt/format.h>

#include <unistd.h>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "engine/data/data.h"
#include "engine/data/files.h"
#include "engine/io/safetensors.h"

namespace tessel::data {
namespace {

constexpr size_t kIdxHead = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype code, counts

// What a Megatron .idx header says: sequence and document counts and the token type.
struct IdxHeader {
  uint64_t n_seq, n_doc;
  int elem;  // bytes per token
  bool is_signed;
};

plan::UserError corrupt_index(const std::string& idx, const std::string& why) {
  return plan::UserError(idx + ": corrupt Megatron index: " + why);
}

// Megatron's dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16.
void token_type(const std::string& idx, uint8_t code, int& elem, bool& is_signed) {
  is_signed = true;
  switch (code) {
    case 1:
      elem = 1;
      is_signed = false;
      break;
    case 3:
      elem = 2;
      break;
    case 4:
      elem = 4;
      break;
    case 5:
      elem = 8;
      break;
    case 8:
      elem = 2;
      is_signed = false;
      break;
    default:
      throw corrupt_index(idx, "token dtype code " + std::to_string(code) +
                                   " is not an integer type Tessel reads (1, 3, 4, 5, 8)");
  }
}

// Reads and checks the header of the mapped index `im` (named `idx` in messages), including that
// the file is exactly as long as its counts say.
IdxHeader read_idx_header(const std::string& idx, const Mapping& im) {
  const auto* p = static_cast<const uint8_t*>(im.ptr);
  if (im.size < kIdxHead)
    throw corrupt_index(idx, "file of " + std::to_string(im.size) + " bytes is shorter than the " +
                                 std::to_string(kIdxHead) + "-byte header");
  if (std::memcmp(p, kIdxMagic, 9) != 0) throw corrupt_index(idx, "bad magic (expected MMIDIDX)");
  uint64_t version;
  IdxHeader h{};
  std::memcpy(&version, p + 9, 8);
  if (version != 1) throw corrupt_index(idx, "version " + std::to_string(version) + ", expected 1");
  const uint8_t code = p[17];
  std::memcpy(&h.n_seq, p + 18, 8);
  std::memcpy(&h.n_doc, p + 26, 8);
  token_type(idx, code, h.elem, h.is_signed);
  const uint64_t want = kIdxHead + 4 * h.n_seq + 8 * h.n_seq + 8 * h.n_doc;
  if (h.n_seq > im.size || h.n_doc > im.size || im.size != want)
    throw corrupt_index(idx, std::to_string(h.n_seq) + " sequences and " + std::to_string(h.n_doc) +
                                 " document indices need " + std::to_string(want) +
                                 " bytes, the file has " + std::to_string(im.size));
  return h;
}

}  // namespace

void add_megatron(TokenStream& s, const std::string& prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  auto im = map_file(idx);
  const IdxHeader h = read_idx_header(idx, *im);
  const int elem = h.elem;
  auto bm = map_file(bin);
  const auto* p = static_cast<const uint8_t*>(im->ptr);
  const auto* lens = reinterpret_cast<const int32_t*>(p + kIdxHead);
  const auto* ptrs = reinterpret_cast<const int64_t*>(p + kIdxHead + 4 * h.n_seq);
  s.files.push_back(bin);
  const int file = static_cast<int>(s.files.size()) - 1;
  // Every sequence checked; a .bin whose sequences lie back to back from byte 0 (what Megatron's
  // and Tessel's writers make) is one span, its documents read from the mapped index in place.
  bool contiguous = true;
  uint64_t next = 0;
  for (uint64_t i = 0; i < h.n_seq; ++i) {
    int32_t len;
    int64_t ptr;
    std::memcpy(&len, lens + i, 4);  // the arrays need not be aligned in the mapping
    std::memcpy(&ptr, ptrs + i, 8);
    if (len < 0 || ptr < 0 || ptr % elem)
      throw corrupt_index(idx, "sequence " + std::to_string(i) + " has length " +
                                   std::to_string(len) + " at byte " + std::to_string(ptr));
    uint64_t end = static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len) * elem;
    if (end > bm->size)
      throw plan::UserError(bin + ": truncated: sequence " + std::to_string(i) + " of " + idx +
                            " needs bytes up to " + std::to_string(end) + ", the file has " +
                            std::to_string(bm->size));
    contiguous &= static_cast<uint64_t>(ptr) == next;
    next = end;
  }
  const auto* bytes = static_cast<const uint8_t*>(bm->ptr);
  if (contiguous) {
    const int64_t base = s.size();
    if (next) s.add(Span{bytes, static_cast<int64_t>(next) / elem, elem, h.is_signed, file, 0});
    s.add_megatron_docs(static_cast<int64_t>(h.n_seq), base, reinterpret_cast<const uint8_t*>(ptrs),
                        reinterpret_cast<const uint8_t*>(lens), elem);
  } else {  // sequences anywhere in the file: a span each
    std::vector<int64_t> starts;
    for (uint64_t i = 0; i < h.n_seq; ++i) {
      int32_t len;
      int64_t ptr;
      std::memcpy(&len, lens + i, 4);
      std::memcpy(&ptr, ptrs + i, 8);
      starts.push_back(s.size());
      if (len) s.add(Span{bytes + ptr, len, elem, h.is_signed, file, ptr / elem});
    }
    s.add_docs(std::move(starts), reinterpret_cast<const uint8_t*>(lens));
  }
  s.storage.push_back(im);
  s.storage.push_back(bm);
}

MegatronWriter::MegatronWriter(const std::string& prefix, int64_t vocab_size)
    : prefix_(prefix), vocab_(vocab_size), elem_(vocab_size <= 65536 ? 2 : 4) {
  bin_ = std::fopen((prefix + ".bin.tmp").c_str(), "wb");
  if (!bin_)
    throw plan::UserError(prefix + ".bin.tmp: cannot create (" + std::strerror(errno) + ")");
}

MegatronWriter::~MegatronWriter() {
  if (bin_) {
    std::fclose(bin_);
    std::remove((prefix_ + ".bin.tmp").c_str());
  }
}

void MegatronWriter::add(const uint32_t* tokens, int64_t n) {
  if (const int64_t bad = first_outside_typed(tokens, n, vocab_); bad >= 0)
    throw plan::UserError(fmt::format(
        "{}: document {} token {}: id {} is outside the vocabulary of {} ids (0 to {}); "
        "nothing was written",
        prefix_, documents(), bad, tokens[bad], vocab_, vocab_ - 1));
  buf_.resize(static_cast<size_t>(n) * elem_);
  if (elem_ == 2) {
    auto* o = reinterpret_cast<uint16_t*>(buf_.data());
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint16_t>(tokens[i]);
  } else {
    std::memcpy(buf_.data(), tokens, buf_.size());
  }
  if (n > 0 && std::fwrite(buf_.data(), 1, buf_.size(), bin_) != buf_.size())
    throw plan::UserError(prefix_ + ".bin.tmp: write failed (" + std::strerror(errno) + ")");
  ptrs_.push_back(bytes_);
  lens_.push_back(static_cast<int32_t>(n));
  bytes_ += static_cast<int64_t>(buf_.size());
  tokens_ += n;
}

void MegatronWriter::finish() {
  std::string idx;
  auto put = [&](const void* v, size_t n) { idx.append(static_cast<const char*>(v), n); };
  std::vector<int64_t> doc_idx(lens_.size() + 1);
  for (size_t i = 0; i < doc_idx.size(); ++i) doc_idx[i] = static_cast<int64_t>(i);
  uint64_t version = 1, n_seq = lens_.size(), n_doc = doc_idx.size();
  uint8_t code = elem_ == 2 ? 8 : 4;  // uint16 | int32
  put(kIdxMagic, 9);
  put(&version, 8);
  put(&code, 1);
  put(&n_seq, 8);
  put(&n_doc, 8);
  put(lens_.data(), 4 * lens_.size());
  put(ptrs_.data(), 8 * ptrs_.size());
  put(doc_idx.data(), 8 * doc_idx.size());
  const bool ok = std::fflush(bin_) == 0 && ::fsync(::fileno(bin_)) == 0;
  std::fclose(bin_);
  bin_ = nullptr;
  if (!ok) {
    std::remove((prefix_ + ".bin.tmp").c_str());
    throw plan::UserError(prefix_ + ".bin.tmp: write failed (" + std::strerror(errno) + ")");
  }
  // A reader opens the pair through .idx, so an older .idx goes first and the new one comes
  // last: a crash in between leaves no dataset, never a new .bin beside an old .idx.
  std::error_code ec;
  std::filesystem::remove(prefix_ + ".idx", ec);
  if (!ec) std::filesystem::rename(prefix_ + ".bin.tmp", prefix_ + ".bin", ec);
  if (ec) {
    std::remove((prefix_ + ".bin.tmp").c_str());
    throw plan::UserError(prefix_ + ".bin/.idx: cannot replace (" + ec.message() + ")");
  }
  io::write_file_atomic(prefix_ + ".idx", idx);
}

void write_megatron(const std::string& prefix, const std::vector<std::vector<uint16_t>>& docs) {
  MegatronWriter w(prefix, 65536);
  std::vector<uint32_t> ids;
  for (const auto& d : docs) {
    ids.assign(d.begin(), d.end());
    w.add(ids.data(), static_cast<int64_t>(ids.size()));
  }
  w.finish();
}

}  // namespace tessel::data
