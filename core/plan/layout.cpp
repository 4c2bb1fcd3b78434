// The plan checked against the world before any communicator: the layout with dp auto resolved,
// every broken rule named with its values in one error, each schedule's needs, and the CUDA
// device each process of a node uses.
#include "core/plan/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "core/device/cuda.h"
#include "core/plan/user_error.h"

namespace tessel::plan {
namespace {

class Problems {
 public:
  explicit Problems(const std::string& source) : source_(source) {}
  void require(bool ok, const std::string& msg) {
    if (!ok) add(msg);
  }
  void require_empty(const std::string& problem) {
    if (!problem.empty()) add(problem);
  }
  void add(const std::string& msg) { errors_.push_back(source_ + ": " + msg); }
  void throw_if_any() const {
    if (errors_.empty()) return;
    std::string all;
    for (const auto& e : errors_) all += (all.empty() ? "" : "\n") + e;
    throw UserError(all);
  }

 private:
  const std::string& source_;
  std::vector<std::string> errors_;
};

// The plan's layout with dp auto resolved, and the world size it must fill.
Layout resolve_layout(const Config& c, int64_t world, Problems& problems) {
  const auto& p = c.parallel;
  Layout l{p.tp, p.cp, p.dp, p.pp, p.ep};
  const int64_t model_parallel = p.tp * p.cp * p.pp;
  if (p.dp == 0) {
    problems.require(world % model_parallel == 0,
                     fmt::format("world size ({}) must be divisible by parallel.tp·cp·pp "
                                 "({}·{}·{} = {}) for parallel.dp: auto",
                                 world, p.tp, p.cp, p.pp, model_parallel));
    l.dp = std::max<int64_t>(1, world / model_parallel);
  } else {
    problems.require(world == l.world(),
                     fmt::format("world size ({}) must equal parallel.tp·cp·dp·pp "
                                 "({}·{}·{}·{} = {})",
                                 world, p.tp, p.cp, p.dp, p.pp, l.world()));
  }
  return l;
}

// Expert parallelism: ep ranks drawn from the data-parallel ones.
void check_experts(const Config& c, const Layout& l, Problems& problems) {
  const auto& p = c.parallel;
  if (p.ep == 1) return;
  problems.require(l.dp % p.ep == 0,
                   fmt::format("parallel.ep ({}) must divide parallel.dp ({}): the expert-parallel "
                               "ranks are drawn from the data-parallel ones (dp {} with ep {} runs "
                               "on {} process{})",
                               p.ep, l.dp, p.ep, p.ep, p.ep * p.tp * p.cp * p.pp,
                               p.ep * p.tp * p.cp * p.pp == 1 ? "" : "es"));
}

// Hybrid sharding: groups of parallel.zero_shard data ranks, each holding a whole ZeRO state;
// the experts' shards are groups of the expert data group with as many replicas.
void check_zero_shard(const Config& c, const Layout& l, Problems& problems) {
  const auto& p = c.parallel;
  const int64_t n = p.zero_shard, data = l.dp * l.cp;
  if (n == 1 || p.zero == 0) return;  // rules.cpp refuses zero_shard without ZeRO
  problems.require(data % n == 0,
                   fmt::format("parallel.zero_shard ({}) must divide the data group, parallel.dp x "
                               "parallel.cp ({} x {} = {}): each shard group holds a whole copy "
                               "of the ZeRO state",
                               n, l.dp, l.cp, data));
  problems.require(
      p.ep == 1 || n % p.ep == 0,
      fmt::format("parallel.zero_shard ({}) must be a multiple of parallel.ep ({}): the experts "
                  "shard over their own data group (dp/ep x cp = {} ranks) with as many replicas "
                  "as the rest ({} / {}), which needs ep to divide zero_shard",
                  n, p.ep, l.dp / p.ep * l.cp, data, n));
}

}  // namespace

ZeroSplit zero_split(const Config& c, const Layout& l) {
  const int64_t data = l.dp * l.cp, expert_data = l.dp / std::max<int64_t>(1, l.ep) * l.cp;
  if (c.parallel.zero == 0) return {};
  const int64_t n = c.parallel.zero_shard;
  if (n <= 1 || n >= data || data % n != 0) return {data, expert_data, 1};
  const int64_t replicas = data / n;
  return {n, expert_data / replicas, replicas};
}

namespace {

// The model's dimensions that tensor parallelism (and sequence parallelism) split.
void check_tensor_split(const Config& c, Problems& problems) {
  const auto& p = c.parallel;
  const auto& m = c.model;
  const auto& t = c.training;
  problems.require(
      m.heads % p.tp == 0,
      fmt::format("model.heads ({}) must be divisible by parallel.tp ({})", m.heads, p.tp));
  problems.require(m.kv_heads % p.tp == 0 || p.tp % m.kv_heads == 0,
                   fmt::format("model.kv_heads ({}) and parallel.tp ({}) must divide one another",
                               m.kv_heads, p.tp));
  problems.require(m.ffn_hidden % p.tp == 0,
                   fmt::format("model.ffn_hidden ({}) must be divisible by parallel.tp ({})",
                               m.ffn_hidden, p.tp));
  problems.require(
      !p.sequence_parallel || t.seq_len % (p.tp * p.cp) == 0,
      fmt::format("parallel.sequence_parallel: training.seq_len ({}) must be divisible by "
                  "parallel.tp ({}){}",
                  t.seq_len, p.tp,
                  p.cp > 1 ? fmt::format(" x parallel.cp ({}) (each cp rank's tokens are split "
                                         "over tp)",
                                         p.cp)
                           : ""));
}

// Enough layers for every stage, and an explicit split that covers them.
void check_stage_layers(const Config& c, Problems& problems) {
  const auto& p = c.parallel;
  const auto& m = c.model;
  problems.require(
      m.layers >= p.pp * p.virtual_stages,
      fmt::format("model.layers ({}) must be >= parallel.pp ({}) x pipeline.virtual_stages ({})",
                  m.layers, p.pp, p.virtual_stages));
  if (p.layers_per_stage.empty()) return;
  double sum = 0;
  std::string bad;  // the entries that are not positive integers, by position
  for (size_t i = 0; i < p.layers_per_stage.size(); ++i) {
    const double x = p.layers_per_stage[i];
    sum += x;
    if (!(x >= 1 && x == std::floor(x)))
      bad += fmt::format("{}entry {} is {}", bad.empty() ? "" : ", ", i, x);
  }
  problems.require(static_cast<int64_t>(p.layers_per_stage.size()) == p.pp * p.virtual_stages &&
                       bad.empty() && sum == static_cast<double>(m.layers),
                   fmt::format("parallel.pipeline.layers_per_stage must hold pp x virtual_stages "
                               "({}) positive integers summing to model.layers ({}); got {} "
                               "entries summing to {}{}",
                               p.pp * p.virtual_stages, m.layers, p.layers_per_stage.size(), sum,
                               bad.empty() ? "" : " (" + bad + ": every stage needs a layer)"));
}

// The pipeline schedule against pp, the micro-batch count and ZeRO.
void check_schedule(const Config& c, const Layout& l, Problems& problems) {
  const auto& p = c.parallel;
  const auto& t = c.training;
  const bool chunked = schedule_shape(p.pipeline_schedule).chunked;
  problems.require(p.virtual_stages == 1 || (chunked && p.pp > 1),
                   fmt::format("parallel.pipeline.virtual_stages ({}) > 1 needs schedule "
                               "interleaved or zbv and parallel.pp > 1 (schedule {}, pp {})",
                               p.virtual_stages, p.pipeline_schedule.name(), p.pp));
  problems.require(!chunked || p.pp > 1,
                   fmt::format("parallel.pipeline.schedule {} needs parallel.pp > 1 (pp is 1)",
                               p.pipeline_schedule.name()));
  if (p.pp > 1)
    problems.require_empty(schedule_problem(
        p.pipeline_schedule, p.pp, t.global_batch / std::max<int64_t>(1, l.dp * t.micro_batch),
        p.virtual_stages));
}

// alltoall and hybrid context parallelism split each tp rank's query heads over cp ranks (hybrid:
// over its all-to-all groups, which divide cp).
void check_context_heads(const Config& c, Problems& problems) {
  const auto& p = c.parallel;
  const int64_t heads = c.model.heads / std::max<int64_t>(1, p.tp);
  const bool hybrid = p.context_method == CpMethod::kHybrid;
  if (p.cp == 1 || (p.context_method != CpMethod::kAllToAll && !hybrid)) return;
  const int64_t a = hybrid ? p.context_alltoall_size : p.cp;
  if (hybrid && p.cp % a != 0) {
    problems.add(
        fmt::format("parallel.context.alltoall_size ({}) must divide parallel.cp ({})", a, p.cp));
    return;
  }
  if (heads % a == 0) return;
  std::vector<int64_t> fit;
  for (int64_t k = 2; k <= heads; ++k)
    if (heads % k == 0 && (hybrid ? p.cp % k == 0 : c.training.seq_len % (2 * k) == 0))
      fit.push_back(k);
  const std::string key = hybrid ? "parallel.context.alltoall_size" : "parallel.cp";
  problems.add(fmt::format(
      "parallel.context.method {} splits each tp rank's query heads over {}: model.heads ({}) / "
      "parallel.tp ({}) = {} heads are not divisible by {} ({}); {}or use "
      "parallel.context.method ring or allgather",
      p.context_method.name(), key, c.model.heads, p.tp, heads, key, a,
      fit.empty() ? "" : fmt::format("{} {} would divide them, ", key, fmt::join(fit, ", "))));
}

// The sequence's split over cp, and the global batch's over dp and micro-batches.
void check_batch(const Config& c, const Layout& l, Problems& problems) {
  const auto& p = c.parallel;
  const auto& t = c.training;
  problems.require(p.cp == 1 || t.seq_len % (2 * p.cp) == 0,
                   fmt::format("training.seq_len ({}) must be divisible by 2·parallel.cp "
                               "(2·{} = {}): each sequence is cut into 2·cp equal chunks",
                               t.seq_len, p.cp, 2 * p.cp));
  check_context_heads(c, problems);
  problems.require(t.global_batch % (l.dp * t.micro_batch) == 0,
                   fmt::format("training.global_batch ({}) must be divisible by "
                               "parallel.dp·training.micro_batch ({}·{} = {})",
                               t.global_batch, l.dp, t.micro_batch, l.dp * t.micro_batch));
  // The schedule holds a few actions per micro-batch for every stage (and --dry-run simulates
  // every rank's): bounded so that a huge batch is refused, not built until memory runs out.
  constexpr int64_t kMaxMicrobatches = 65536;
  const int64_t microbatches = t.global_batch / std::max<int64_t>(1, l.dp * t.micro_batch);
  problems.require(
      microbatches <= kMaxMicrobatches,
      fmt::format("training.global_batch ({}) / (parallel.dp·training.micro_batch = "
                  "{}) = {} micro-batches per step: at most {} (the schedule holds "
                  "actions for each); raise training.micro_batch",
                  t.global_batch, l.dp * t.micro_batch, microbatches, kMaxMicrobatches));
}

// The `local_world` processes of this node against its CUDA devices, when it trains on CUDA.
void check_devices(const Config& c, int64_t local_world, Problems& problems) {
  const auto& t = c.training;
  const bool cuda = t.device == TrainDevice::kCuda ||
                    (t.device == TrainDevice::kAuto && device::cuda_available());
  if (!cuda) return;
  try {  // the rule the device choice applies (one visible device each, or one per local rank)
    choose_cuda_device(static_cast<int>(device::cuda_device_count()), 0,
                       static_cast<int>(local_world), std::getenv("CUDA_VISIBLE_DEVICES"));
  } catch (const UserError& e) {
    problems.add(e.what());
  }
}

}  // namespace

Layout check_layout(const Config& c, int64_t world, int64_t local_world) {
  Problems problems(c.source);
  const Layout l = resolve_layout(c, world, problems);
  check_tensor_split(c, problems);
  check_experts(c, l, problems);
  check_zero_shard(c, l, problems);
  check_stage_layers(c, problems);
  check_schedule(c, l, problems);
  check_batch(c, l, problems);
  if (local_world > 0) check_devices(c, local_world, problems);
  problems.throw_if_any();
  return l;
}

ScheduleShape schedule_shape(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGpipe:
    case PipelineSchedule::k1F1B:
    case PipelineSchedule::kZbH1:
      return {false, false};
    case PipelineSchedule::kInterleaved:
      return {true, false};
    case PipelineSchedule::kZbv:
      return {true, true};
  }
  throw std::logic_error(
      fmt::format("schedule_shape: schedule {} has no shape", static_cast<int>(schedule)));
}

std::string schedule_problem(PipelineSchedule schedule, int64_t p, int64_t m, int64_t v) {
  const std::string& name = name_of(schedule);
  if (schedule == PipelineSchedule::kGpipe) return "";
  if (m < p)
    return fmt::format(
        "parallel.pipeline.schedule {} needs at least parallel.pp ({}) micro-batches per "
        "step, got {} (training.global_batch / (parallel.dp·training.micro_batch))",
        name, p, m);
  if (schedule == PipelineSchedule::kInterleaved && v < 2)
    return fmt::format(
        "parallel.pipeline.schedule interleaved needs parallel.pipeline.virtual_stages >= 2, "
        "got {}",
        v);
  if (schedule == PipelineSchedule::kInterleaved && m % p != 0)
    return fmt::format(
        "parallel.pipeline.schedule interleaved needs micro-batches per step ({}) divisible "
        "by parallel.pp ({})",
        m, p);
  if (schedule == PipelineSchedule::kZbv && v != 2)
    return fmt::format(
        "parallel.pipeline.schedule zbv needs parallel.pipeline.virtual_stages: 2, got {}", v);
  return "";
}

DeviceChoice choose_cuda_device(int visible, int local_rank, int local_world,
                                const char* visible_env) {
  const std::string seen = visible_env ? fmt::format("CUDA_VISIBLE_DEVICES={}", visible_env)
                                       : "CUDA_VISIBLE_DEVICES unset";
  if (visible < 1)
    throw UserError(
        fmt::format("training.device cuda: this process sees no CUDA device ({})", seen));
  if (visible == 1)
    return {0, fmt::format("the only device this process sees ({}; local rank {} of {})", seen,
                           local_rank, local_world)};
  if (visible >= local_world)
    return {local_rank, fmt::format("local rank {} of {} on {} visible devices ({})", local_rank,
                                    local_world, visible, seen)};
  throw UserError(fmt::format(
      "{} processes on this node but each sees {} CUDA devices ({}): give every process its own "
      "device (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES of one device per process), or "
      "make at least {} devices visible to all of them",
      local_world, visible, seen, local_world));
}

}  // namespace tessel::plan
