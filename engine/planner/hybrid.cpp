// Hybrid sharding's choices (parallel.zero_shard) for --dry-run: each shard size the plan's
// layout accepts, estimated as the plan itself is.

#include <algorithm>

#include "core/plan/layout.h"
#include "engine/planner/planner.h"
#include "parallel/mesh.h"

namespace tessel::planner {
namespace {

// Whether the first shard group of `shards` data ranks (the whole data group at its size) sits
// on one node of `per_node` ranks.
bool shards_in_node(const plan::Layout& l, int64_t shards, int64_t per_node) {
  const auto data = parallel::group_ranks(parallel::GroupKind::kDpCp, l)[0];
  const auto group = shards >= static_cast<int64_t>(data.size())
                         ? data
                         : parallel::split_ranks(data, shards).inner[0];
  return group.front() / per_node == group.back() / per_node;
}

}  // namespace

std::vector<ShardChoice> zero_shard_choices(const plan::Config& c, const plan::Layout& l,
                                            const DeviceProfile& d) {
  std::vector<ShardChoice> out;
  const int64_t data = l.dp * l.cp;
  if (!plan::sharding(c).state || data < 2) return out;
  const double fits = 0.9 * d.memory_gib * 1024 * 1024 * 1024;
  for (int64_t n = 2; n <= data; ++n) {
    if (data % n != 0 || (l.ep > 1 && n % l.ep != 0)) continue;
    plan::Config p = c;
    p.parallel.zero_shard = n;
    const auto e = estimate(p, l, d);
    ShardChoice k{n, n == data};
    for (const auto& r : e.ranks) {
      k.peak_bytes = std::max(k.peak_bytes, r.total());
      double inside = 0, across = 0;
      for (const auto* g : {"dp_cp", "edp_cp"}) {
        const double all = r.comm.count(g) ? r.comm.at(g) : 0.0;
        const double rep = r.replica_comm.count(g) ? r.replica_comm.at(g) : 0.0;
        inside += all - rep, across += rep;
      }
      k.inside_bytes = std::max(k.inside_bytes, inside);
      k.across_bytes = std::max(k.across_bytes, across);
    }
    k.step_s = e.step_s;
    k.in_node = d.gpus_per_node > 0 && shards_in_node(l, n, d.gpus_per_node);
    k.fits = d.memory_gib <= 0 || k.peak_bytes <= fits;
    out.push_back(k);
  }
  // The best: the fastest that fits (within 1%, the one that shards over more ranks, which holds
  // less); when none fits, the one that holds least.
  const ShardChoice* best = nullptr;
  for (const auto& k : out) {
    if (!best) {
      best = &k;
      continue;
    }
    if (k.fits != best->fits) {
      if (k.fits) best = &k;
      continue;
    }
    const bool faster = k.fits ? k.step_s < 0.99 * best->step_s ||
                                     (k.step_s <= 1.01 * best->step_s && k.shards > best->shards)
                               : k.peak_bytes < best->peak_bytes;
    if (faster) best = &k;
  }
  for (auto& k : out) k.best = &k == best;
  return out;
}

}  // namespace tessel::planner
