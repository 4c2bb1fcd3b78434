// The Dataset's rows: training positions through the blend, validation and test rows dataset by
// dataset, and `tessel-train samples`.
#include <fmt/format.h>

#include <torch/torch.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/data/dataset.h"

namespace tessel::data {

int64_t Dataset::train_samples() const {
  int64_t n = 0;
  for (const auto& s : sources(SampleSplit::kTrain)) n += s.samples;
  return n;
}

int64_t Dataset::val_samples() const {
  int64_t n = 0;
  for (const auto& s : sources(SampleSplit::kValid)) n += s.samples;
  return n;
}

int64_t Dataset::train_tokens() const {
  int64_t n = 0;
  for (const auto& s : sources(SampleSplit::kTrain)) n += s.end - s.begin;
  return n;
}

void Dataset::check_limit(int64_t pos) const {
  if (train_limit_ >= 0 && pos >= train_limit_)
    throw plan::UserError(fmt::format(
        "training sample {}: data.order megatron holds {} training samples (Megatron-Core sizes "
        "its indices for training.steps x training.global_batch samples)",
        pos, train_limit_));
}

std::pair<int64_t, int64_t> Dataset::window_at(int64_t pos) {
  check_limit(pos);
  const auto [d, k] = blend_.at(pos);
  auto& s = split_[index(SampleSplit::kTrain)][static_cast<size_t>(d)];
  return {d, s.index ? k : s.window(k)};
}

torch::Tensor Dataset::rows(const std::vector<std::pair<Source*, int64_t>>& at,
                            int64_t first_label) {
  auto out = torch::empty({static_cast<int64_t>(at.size()), seq_len_ + 1}, torch::kInt64);
  int64_t* p = out.data_ptr<int64_t>();
  std::vector<Piece> pieces;
  for (size_t r = 0; r < at.size(); ++r) {
    auto& src = *at[r].first;
    src.pieces(at[r].second, pieces);
    int64_t* row = p + static_cast<int64_t>(r) * (seq_len_ + 1);
    int64_t filled = 0;
    for (const auto& piece : pieces) {
      src.stream->read(piece.pos, piece.tokens, row + filled);
      for (int64_t j = 0; j < piece.tokens; ++j)
        if (row[filled + j] < 0 || row[filled + j] >= vocab_)
          throw plan::UserError(
              fmt::format("{}: token id {} is outside model.vocab_size {} (sample {})",
                          src.stream->where(piece.pos + j), row[filled + j], vocab_,
                          first_label + static_cast<int64_t>(r)));
      filled += piece.tokens;
    }
    if (filled != seq_len_ + 1)  // the indices are built for full samples only
      throw std::logic_error(fmt::format("sample {} of {} holds {} tokens, not {}", at[r].second,
                                         src.name, filled, seq_len_ + 1));
  }
  return out;
}

torch::Tensor Dataset::train_batch(int64_t first, int64_t count) {
  std::vector<std::pair<Source*, int64_t>> at;
  auto& train = split_[index(SampleSplit::kTrain)];
  for (int64_t i = 0; i < count; ++i) {
    check_limit(first + i);
    const auto [d, k] = blend_.at(first + i);
    at.push_back({&train[static_cast<size_t>(d)], k});
  }
  return rows(at, first);
}

torch::Tensor Dataset::split_batch(SampleSplit s, int64_t d, int64_t first, int64_t count) {
  auto& src = split_[index(s)].at(static_cast<size_t>(d));
  std::vector<std::pair<Source*, int64_t>> at;
  for (int64_t i = 0; i < count; ++i) at.push_back({&src, (first + i) % src.samples});
  return rows(at, first);
}

namespace {

constexpr int64_t kBlendReach = int64_t{1} << 27;

// The files plan `c` reads: the plan, every dataset's files (a megatron prefix's .bin, .idx and
// vocabulary record), model.init_from.
std::vector<std::string> plan_inputs(const plan::Config& c) {
  std::vector<std::string> in = {c.source, c.model.init_from};
  for (const auto& [key, paths] : named_datasets(c.data))
    for (const auto& p : paths) {
      if (c.data.format == plan::DataFormat::kMegatron) {
        for (const char* ext : {".bin", ".idx", ".tessel.json"}) in.push_back(p + ext);
        continue;
      }
      try {
        for (auto& f : expand(p)) in.push_back(std::move(f));
      } catch (const plan::UserError&) {  // matches nothing: Dataset names it
      }
    }
  return in;
}

// `out` may be written: not a folder, FIFO or device; not an existing file unless `force`; never
// one of the plan's own inputs. Checked before anything is read or written.
void check_output(const plan::Config& c, const std::string& out, bool force) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(out, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_regular_file(st))
    throw plan::UserError(fmt::format(
        "samples --out: {} is {}, not a file to write: give a file's path", out,
        fs::is_directory(st) ? "a folder" : "not a regular file (a FIFO, a device or a socket)"));
  for (const auto& in : plan_inputs(c))
    if (!in.empty() && fs::equivalent(out, in, ec))
      throw plan::UserError(fmt::format("samples --out: {} is {}: write the samples elsewhere", out,
                                        in == c.source ? "the plan file"
                                        : in == out    ? "one of the plan's inputs"
                                                       : in + ", one of the plan's inputs"));
  if (!force)
    throw plan::UserError(
        fmt::format("samples --out: {} exists: give another path, or --force to replace it", out));
}

}  // namespace

int64_t write_samples(const plan::Config& c, SampleSplit split, int64_t skip, int64_t count,
                      const std::string& out, bool force) {
  check_output(c, out, force);
  Dataset data(c, {split});
  const auto& sets = data.sources(split);
  if (split != SampleSplit::kTrain && sets.empty())
    throw plan::UserError(fmt::format(
        "{}: the plan holds no {} samples: give data.split (e.g. 969,30,1) or data.{}{}", c.source,
        split == SampleSplit::kValid ? "validation" : "test",
        split == SampleSplit::kValid ? "valid" : "test",
        split == SampleSplit::kValid ? " (or data.val_fraction)" : ""));
  // Validation and test: each dataset's samples in turn, wrapping (an evaluation reads the first
  // eval_batches x global_batch of each validation dataset).
  // A blend's position is found by walking Megatron's rule (BlendedDataset builds
  // its whole index the same way, about 10^8 samples a second here): bounded by the samples the
  // plan's run reads, or 2^27 (a second's walk) where that is more.
  const int64_t run = c.training.steps * c.training.global_batch,
                reach = std::max(run, kBlendReach);
  if (split == SampleSplit::kTrain && data.blend_size() > 1 &&
      (skip > reach || count > reach - skip))
    throw plan::UserError(fmt::format(
        "samples --skip {} --count {}: the plan's run reads training.steps {} x "
        "training.global_batch {} = {} samples of its blend, and samples looks at most {} "
        "ahead; ask for samples within them (or --set training.steps=N to see further)",
        skip, count, c.training.steps, c.training.global_batch, run, reach));
  int64_t total = 0;
  for (const auto& s : sets) total += s.samples;
  auto batch = [&](int64_t first, int64_t n) {
    if (split == SampleSplit::kTrain) return data.train_batch(first, n);
    std::vector<torch::Tensor> parts;
    for (int64_t p = first; p < first + n; ++p) {
      int64_t d = 0, r = p % total;
      while (r >= sets[static_cast<size_t>(d)].samples) r -= sets[static_cast<size_t>(d++)].samples;
      parts.push_back(data.split_batch(split, d, r, 1));
    }
    return torch::cat(parts);
  };
  // Written beside under a name of this process's, and removed whatever fails on the way.
  const std::string tmp = fmt::format("{}.tmp.{}", out, ::getpid());
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) throw plan::UserError(out + ": cannot write: " + std::strerror(errno));
  try {
    constexpr int64_t kRows = 1024;  // read and written a block at a time, whatever `count`
    for (int64_t done = 0; done < count;) {
      const int64_t n = std::min(kRows, count - done);
      const auto rows = batch(skip + done, n).to(torch::kInt32).contiguous();
      f.write(reinterpret_cast<const char*>(rows.data_ptr<int32_t>()),
              static_cast<std::streamsize>(rows.numel() * 4));
      done += n;
    }
    f.close();
    if (!f) throw plan::UserError(out + ": cannot write: " + std::strerror(errno));
  } catch (...) {
    f.close();
    std::filesystem::remove(tmp);
    throw;
  }
  std::filesystem::rename(tmp, out);
  return count;
}

}  // namespace tessel::data
