// ZeRO-3 without kept units inside a pipeline: the gatherer (parallel/dp/zero3.h) replayed over a
// rank's schedule, for the planner's memory (memory.cpp: the units held at each pass) and bytes
// (traffic.cpp: how often each unit is gathered in a step).
#include <limits>
#include <map>
#include <set>

#include "engine/planner/basis.h"
#include "models/registry.h"

namespace tessel::planner {

// ZeRO-3 without kept units inside a pipeline, the rank's units played over its timeline by
// parallel/dp/zero3.h's rules. A forward gathers the root unit (embeddings, final norm, head),
// then each block, prefetching the next one the rank holds and freeing each after it but the
// rank's last; a backward (or B) gathers each block and prefetches the one before; a unit is
// freed once its gradients are in: in its backward, or at its W under zero-bubble schedules (the
// root once every chunk holding its parameters has handed them over: the head's at the start of
// its backward, the embeddings' at the end). `held`: bytes gathered at each slot's peak;
// `gathers`: how often each unit (kRoot, or a layer) is gathered in the step.
UnitReplay replay_units(const std::vector<parallel::pp::Simulation::Slot>& timeline,
                        const PlanBasis& b, const plan::Layout& l, const models::StagePart& part,
                        double root) {
  using parallel::pp::Op;
  constexpr int64_t kRoot = UnitReplay::kRoot;
  std::map<int64_t, double> size{{kRoot, root}};  // the rank's units
  for (const auto& [begin, end] : part.chunks)
    for (int64_t i = begin; i < end; ++i)
      size[i] = b.w * static_cast<double>(models::block_parameters(b.m, l.tp, i, l.ep));
  const int64_t last = size.rbegin()->first, chunks = static_cast<int64_t>(part.chunks.size());
  auto root_in = [&](int64_t c) {
    return (part.first && c == 0) || (part.last && c == chunks - 1);
  };
  const int64_t root_chunks = (part.first ? 1 : 0) + (part.last && (!part.first || chunks > 1));
  int64_t root_done = 0;
  std::set<int64_t> resident;
  UnitReplay r;
  auto held = [&] {
    double sum = 0;
    for (int64_t i : resident) sum += size[i];
    return sum;
  };
  auto gather = [&](int64_t i) {
    if (size.count(i) && (i != kRoot || root > 0) && resident.insert(i).second) ++r.gathers[i];
  };
  auto root_handed = [&] {
    if (++root_done < root_chunks) return;
    resident.erase(kRoot);
    root_done = 0;
  };
  for (const auto& slot : timeline) {
    const int64_t c = slot.action.chunk;
    const auto [begin, end] = part.chunks.at(static_cast<size_t>(c));
    const Op op = slot.action.op;
    const bool head = part.last && c == chunks - 1;
    double most = held();
    if (op == Op::kForward) {
      gather(kRoot);
      for (int64_t i = begin; i < end; ++i) {
        gather(i), gather(i + 1), most = std::max(most, held());
        if (i != last) resident.erase(i);
      }
    } else if (op == Op::kBackward || op == Op::kBackwardInput) {
      if (op == Op::kBackward && head) root_handed();
      for (int64_t i = end - 1; i >= begin; --i) {
        gather(i), gather(i - 1), most = std::max(most, held());
        if (op == Op::kBackward) resident.erase(i);
      }
      if (op == Op::kBackward && root_in(c) && !head) root_handed();
    } else if (op == Op::kBackwardWeight) {
      for (int64_t i = begin; i < end; ++i) resident.erase(i);
      if (root_in(c)) root_handed();
    }
    r.held.push_back(most);
  }
  return r;
}

// The stage's parameters outside its blocks (the root unit's), on one rank.
double root_parameters(const PlanBasis& b, const plan::Layout& l, const models::StagePart& part) {
  double root = static_cast<double>(models::parameters_on_rank(b.m, l.tp, part, l.ep));
  for (const auto& [begin, end] : part.chunks)
    for (int64_t i = begin; i < end; ++i)
      root -= static_cast<double>(models::block_parameters(b.m, l.tp, i, l.ep));
  return root;
}

ZeroGathers zero3_gathers(const plan::Layout& l, const PlanBasis& b, int64_t stage,
                          const models::StagePart& part) {
  const auto replay = replay_units(b.sim.timeline.at(static_cast<size_t>(stage)), b, l, part,
                                   root_parameters(b, l, part));
  ZeroGathers g;
  for (const auto& [unit, n] : replay.gathers)
    (unit == UnitReplay::kRoot ? g.root : g.blocks[unit]) = n;
  return g;
}

}  // namespace tessel::planner
