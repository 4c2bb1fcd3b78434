// faster_layout: the planner's own estimate over the layouts a plan could take on its world.
#include <fmt/format.h>

#include <algorithm>

#include "core/plan/user_error.h"
#include "engine/planner/planner.h"
#include "parallel/mesh.h"

namespace tessel::planner {
namespace {

// One layout faster_layout tries.
struct Candidate {
  int64_t tp, cp, pp, dp, zero, micro_batch;
  plan::PipelineSchedule schedule;  // 1f1b | interleaved (when pp > 1)
  int64_t zero_shard = 1;           // hybrid sharding's shard group (1: the whole data group)
};

// A pipeline schedule pp 1 takes: the plan's own, unless it needs stages (interleaved, zbv).
plan::PipelineSchedule single_stage_schedule(const plan::Config& c) {
  const plan::PipelineSchedule own(c.parallel.pipeline_schedule);
  return plan::schedule_shape(own).chunked ? plan::PipelineSchedule::k1F1B : own;
}

// The plan `c` on candidate `k`: sequence parallel with any tp, ring attention when cp is new,
// the even layer split.
plan::Config with_layout(const plan::Config& c, const Candidate& k) {
  plan::Config p = c;
  auto& par = p.parallel;
  par.tp = k.tp, par.cp = k.cp, par.pp = k.pp, par.dp = k.dp, par.zero = k.zero;
  par.zero_shard = plan::Sharding::of(k.zero).state ? k.zero_shard : 1;
  par.sequence_parallel = k.tp > 1;
  if (k.cp > 1 && c.parallel.cp == 1) par.context_method = plan::CpMethod::kRing;
  par.pipeline_schedule = k.pp > 1 ? k.schedule : single_stage_schedule(c);
  par.virtual_stages = k.pp > 1 && k.schedule == plan::PipelineSchedule::kInterleaved ? 2 : 1;
  par.layers_per_stage.clear();
  p.training.micro_batch = k.micro_batch;
  return p;
}

// The overrides that turn plan `c` into `p` (from with_layout): only the values that change.
std::vector<std::string> layout_overrides(const plan::Config& c, const plan::Config& p) {
  std::vector<std::string> sets;
  auto set = [&sets](const std::string& key, const auto& from, const auto& to) {
    if (from != to) sets.push_back(fmt::format("{}={}", key, to));
  };
  auto set_choice = [&sets](const std::string& key, const plan::ChoiceBase& from,
                            const plan::ChoiceBase& to) {
    if (from.index() != to.index()) sets.push_back(fmt::format("{}={}", key, to.name()));
  };
  const auto& was = c.parallel;
  const auto& par = p.parallel;
  set("parallel.tp", was.tp, par.tp);
  set("parallel.cp", was.cp, par.cp);
  set("parallel.pp", was.pp, par.pp);
  set("parallel.dp", was.dp, par.dp);
  set("parallel.zero", was.zero, par.zero);
  set("parallel.zero_shard", was.zero_shard, par.zero_shard);
  set("parallel.sequence_parallel", was.sequence_parallel, par.sequence_parallel);
  // pp 1 keeps the plan's schedule unless it needs stages: then the overrides change it too.
  set_choice("parallel.pipeline.schedule", was.pipeline_schedule, par.pipeline_schedule);
  set("parallel.pipeline.virtual_stages", was.virtual_stages, par.virtual_stages);
  if (par.cp > 1) set_choice("parallel.context.method", was.context_method, par.context_method);
  if (!was.layers_per_stage.empty()) sets.push_back("parallel.pipeline.layers_per_stage=[]");
  set("training.micro_batch", c.training.micro_batch, p.training.micro_batch);
  return sets;
}

// The plan's micro-batch, or the largest that divides this dp's share of the batch.
int64_t micro_batch_for(const plan::TrainingConfig& t, int64_t dp) {
  int64_t mb = std::min(t.micro_batch, t.global_batch / dp);
  while ((t.global_batch / dp) % mb != 0) --mb;
  return mb;
}

}  // namespace

std::optional<LayoutChoice> faster_layout(const plan::Config& c, int64_t world,
                                          const DeviceProfile& d, const PlanEstimate& current,
                                          double margin) {
  const auto& t = c.training;
  const double fits = 0.9 * d.memory_gib * 1024 * 1024 * 1024;
  std::optional<LayoutChoice> best;
  auto consider = [&](plan::Config p, std::vector<std::string> sets) {
    plan::Layout l;
    try {
      l = plan::check_layout(p, world, 0);
    } catch (const plan::UserError&) {
      return;  // not a layout this plan can take
    }
    p.parallel.dp = l.dp;
    auto e = estimate(p, l, d);
    for (const auto& r : e.ranks)
      if (r.total() > fits) return;
    if (!best || e.step_s < best->estimate.step_s)
      best = LayoutChoice{std::move(p), l, std::move(e), std::move(sets)};
  };
  for (int64_t tp = 1; tp <= std::min<int64_t>(d.gpus_per_node, world); tp *= 2)
    for (int64_t cp = 1; tp * cp <= world; cp *= 2)
      for (int64_t pp = 1; tp * cp * pp <= world && pp <= c.model.layers; pp *= 2) {
        const int64_t dp = world / (tp * cp * pp);
        if (dp * tp * cp * pp != world || t.global_batch % dp != 0) continue;
        const int64_t mb = micro_batch_for(t, dp);
        // Hybrid sharding as its users set it: ZeRO inside a node, replicas across nodes.
        const int64_t data = dp * cp, in_node = std::max<int64_t>(1, d.gpus_per_node / (tp * cp));
        const int64_t shard = in_node < data && data % in_node == 0 ? in_node : 1;
        for (const int64_t zero : plan::kZeroStages)
          for (const int64_t zs : {int64_t{1}, shard}) {
            if (zs > 1 && !plan::Sharding::of(zero).state) continue;
            for (const auto schedule :
                 {plan::PipelineSchedule::k1F1B, plan::PipelineSchedule::kInterleaved}) {
              if (pp == 1 && schedule == plan::PipelineSchedule::kInterleaved) continue;
              plan::Config p = with_layout(c, {tp, cp, pp, dp, zero, mb, schedule, zs});
              auto sets = layout_overrides(c, p);
              consider(std::move(p), std::move(sets));
            }
            if (shard == 1) break;  // no second sharding to try
          }
      }
  if (!best || best->estimate.step_s > (1 - margin) * current.step_s) return std::nullopt;
  return best;
}

}  // namespace tessel::planner
