// The plan against the world: the layout it resolves to for a number of processes (dp auto
// resolved), every rule it breaks against that world, the needs of each pipeline schedule, and
// which CUDA device a process uses. Runs before any communicator (and for --dry-run, with none).
#pragma once

#include <cstdint>
#include <string>

#include "core/plan/config.h"

namespace tessel::plan {

/// The parallel layout of a run: the rank grid's factors, order tp-cp-dp-pp (parallel/mesh.h).
struct Layout {
  int64_t tp = 1, cp = 1, dp = 1, pp = 1;
  int64_t ep = 1;  // expert parallelism: blocks of ep consecutive dp ranks (not a world factor)
  int64_t world() const { return tp * cp * dp * pp; }
};

/// What ZeRO (parallel.zero) shards over the data ranks, cumulatively: from stage 1 the
/// optimizer state (with the fp32 master weights), from 2 also the gradients, at 3 also the
/// weights. The one reading of the stage's number: the rest of Tessel asks which of these holds
/// (tests/structure/check_owners.py: no stage comparison outside plan code and parallel/dp).
struct Sharding {
  bool state = false, grads = false, weights = false;
  static Sharding of(int64_t stage) { return {stage >= 1, stage >= 2, stage >= 3}; }
  int64_t stage() const { return weights ? 3 : grads ? 2 : state ? 1 : 0; }
  /// Only the optimizer state (ZeRO-1): the gradients are whole until the update.
  bool state_only() const { return state && !grads; }
};
inline Sharding sharding(const Config& c) { return Sharding::of(c.parallel.zero); }
/// parallel.zero's values, in order.
constexpr int64_t kZeroStages[] = {0, 1, 2, 3};

/// ZeRO's split of the data groups (hybrid sharding, parallel.zero_shard): each bucket is
/// sharded over `shards` consecutive ranks of the data group (dp×cp, in rank order) and
/// replicated over `replicas` such groups; an MoE layer's experts over `expert_shards`
/// consecutive ranks of the expert data group (dp/ep×cp), with as many replicas. Without ZeRO
/// the shards are 1; with zero_shard 1 (or the whole group) the replicas are 1.
struct ZeroSplit {
  int64_t shards = 1, expert_shards = 1, replicas = 1;
  bool hybrid() const { return replicas > 1; }
};
ZeroSplit zero_split(const Config& c, const Layout& l);

/// The plan's layout for `world` processes (dp auto resolved), with every check of the plan
/// against the world in one UserError; messages name the keys and their values.
/// `local_world`: processes on this node, checked against its CUDA devices (0: not checked).
Layout check_layout(const Config& c, int64_t world, int64_t local_world);

/// Why `schedule` cannot run `p` stages over `m` micro-batches per step with `v` chunks per rank,
/// naming the keys and values; empty when it can (all but gpipe need m >= p; interleaved also
/// m % p == 0 and v >= 2; zbv v == 2). The one statement of each schedule's needs: the plan's
/// check and parallel::pp::make_schedule both read it.
std::string schedule_problem(PipelineSchedule schedule, int64_t p, int64_t m, int64_t v);

/// What the rest of a run needs to know of a pipeline schedule beyond its action lists, declared
/// once per schedule (a switch: a new schedule is flagged by the compiler).
struct ScheduleShape {
  bool chunked = false;  // several model chunks per rank (parallel.pipeline.virtual_stages > 1)
  bool v_shape = false;  // a rank's second chunk runs the stages back up, so rank 0 holds both
                         // ends of the model (the token table and the head)
};
ScheduleShape schedule_shape(PipelineSchedule schedule);

/// Which CUDA device a process uses, and why (for the start-up log).
struct DeviceChoice {
  int index = 0;
  std::string why;
};
/// From the number of devices this process sees (after CUDA_VISIBLE_DEVICES, which Slurm's
/// --gpus-per-task or a site's binding sets per task): exactly one -> device 0 whatever the local
/// rank (each process was given its own); at least local_world -> the local rank's; otherwise a
/// UserError naming both counts (several processes would share, or miss, a device).
/// `visible_env`: CUDA_VISIBLE_DEVICES as set (null: unset), named in the reason.
DeviceChoice choose_cuda_device(int visible, int local_rank, int local_world,
                                const char* visible_env);

}  // namespace tessel::plan
