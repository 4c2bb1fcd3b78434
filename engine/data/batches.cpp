// The Dataset's rows: training positions through the blend, validation and test rows dataset by
// dataset, and `tessel-train samples`.
#include <fmt/format.h>

#include <torch/torch.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

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

int64_t write_samples(const plan::Config& c, SampleSplit split, int64_t skip, int64_t count,
                      const std::string& out) {
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
  const std::string tmp = out + ".tmp";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) throw plan::UserError(out + ": cannot write: " + std::strerror(errno));
  constexpr int64_t kRows = 1024;  // read and written a block at a time, whatever `count`
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(kRows, count - done);
    const auto rows = batch(skip + done, n).to(torch::kInt32).contiguous();
    f.write(reinterpret_cast<const char*>(rows.data_ptr<int32_t>()),
            static_cast<std::streamsize>(rows.numel() * 4));
    done += n;
  }
  f.close();
  if (!f) {
    std::filesystem::remove(tmp);
    throw plan::UserError(out + ": cannot write: " + std::strerror(errno));
  }
  std::filesystem::rename(tmp, out);
  return count;
}

}  // namespace tessel::data
