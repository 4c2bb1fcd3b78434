#include "core/optim/flat_layout.h"

#include <algorithm>
#include <stdexcept>

namespace tessel::optim {

std::string unit_of(const std::string& name) {
  if (name.rfind("layers.", 0) != 0) return "root";
  return name.substr(0, name.find('.', 7));
}

namespace {
int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }
}  // namespace

FlatLayout::FlatLayout(const std::vector<ParamEntry>& params, const LayoutOptions& o) : o_(o) {
  auto close = [&] {  // pad the open bucket to kAlignElements pieces, one per shard rank
    auto& b = buckets_.back();
    b.end = b.begin + round_up(b.end - b.begin, kAlignElements * b.shards);
    b.shard_offset = shard_numel_;
    shard_numel_ += piece_numel(b);
    numel_ = b.end;
  };
  std::string previous;
  for (const auto& p : params) {
    const std::string unit = unit_of(p.name);
    const bool alone =
        o_.isolate_embedding && (p.name == "embed.weight" || previous == "embed.weight");
    const bool full = !o_.sharding.weights && !buckets_.empty() &&
                      buckets_.back().end - buckets_.back().begin >= o_.bucket_elements;
    if (buckets_.empty() || full || alone || buckets_.back().chunk != p.chunk ||
        buckets_.back().expert != p.expert ||
        (o_.sharding.weights && buckets_.back().unit != unit)) {
      if (!buckets_.empty()) close();
      buckets_.push_back({numel_, numel_, p.chunk, 0, unit, 0, p.expert,
                          p.expert ? o_.expert_shards : o_.shards,
                          p.expert ? o_.expert_shard_rank : o_.shard_rank});
    }
    auto& b = buckets_.back();
    b.end = b.begin + round_up(b.end - b.begin, kAlignElements);  // every slot starts aligned
    slots_.push_back({p.name, b.end, p.numel, static_cast<int64_t>(buckets_.size()) - 1});
    b.end += p.numel;
    ++b.params;
    previous = p.name;
  }
  if (!buckets_.empty()) close();
}

std::vector<Piece> FlatLayout::pieces(const Slot& s) const {
  const auto& b = buckets_[static_cast<size_t>(s.bucket)];
  const int64_t begin = std::max(s.offset, piece_flat(b));
  const int64_t end = std::min(s.offset + s.numel, piece_flat(b) + piece_numel(b));
  if (end <= begin) return {};
  return {{begin - s.offset, begin, b.shard_offset + (begin - piece_flat(b)), end - begin}};
}

const Slot& FlatLayout::slot(const std::string& name) const {
  for (const auto& s : slots_)
    if (s.name == name) return s;
  throw std::out_of_range("flat layout: no parameter " + name);
}

}  // namespace tessel::optim
