// The plan checked against the world before any communicator: the layout with dp auto resolved,
// every broken rule named with its values in one error, and the rank grid for --dry-run.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "core/device/cuda.h"
#include "parallel/mesh.h"
#include "parallel/pp/schedule.h"

namespace tessel::parallel {
namespace {

// Every broken rule of the plan against the world, each prefixed with the plan's source, so that
// one error names them all.
class Problems {
 public:
  explicit Problems(const std::string& source) : source_(source) {}
  void require(bool ok, const std::string& msg) {
    if (!ok) add(msg);
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
  const bool chunked = p.pipeline_schedule == PipelineSchedule::kInterleaved ||
                       p.pipeline_schedule == PipelineSchedule::kZbv;
  problems.require(p.virtual_stages == 1 || (chunked && p.pp > 1),
                   fmt::format("parallel.pipeline.virtual_stages ({}) > 1 needs schedule "
                               "interleaved or zbv and parallel.pp > 1 (schedule {}, pp {})",
                               p.virtual_stages, p.pipeline_schedule.name(), p.pp));
  problems.require(!chunked || p.pp > 1,
                   fmt::format("parallel.pipeline.schedule {} needs parallel.pp > 1 (pp is 1)",
                               p.pipeline_schedule.name()));
  if (p.pp > 1) {  // the schedule's own needs (m >= p; interleaved: m % p == 0, v >= 2)
    try {
      pp::make_schedule(p.pipeline_schedule.name(), p.pp,
                        t.global_batch / std::max<int64_t>(1, l.dp * t.micro_batch),
                        p.virtual_stages);
    } catch (const UserError& e) {
      problems.add(e.what());
    }
  }
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
  check_stage_layers(c, problems);
  check_schedule(c, l, problems);
  check_batch(c, l, problems);
  if (local_world > 0) check_devices(c, local_world, problems);
  problems.throw_if_any();
  return l;
}

std::string describe_grid(const Layout& l) {
  std::ostringstream s;
  s << fmt::format("rank grid: world {} = tp {} x cp {} x dp {} x pp {} (order tp-cp-dp-pp)\n",
                   l.world(), l.tp, l.cp, l.dp, l.pp);
  std::map<GroupKind, std::vector<std::vector<int64_t>>> groups;
  for (auto k : all_group_kinds()) groups[k] = group_ranks(k, l);
  for (int64_t r = 0; r < l.world(); ++r) {
    Coord c = coord_of(r, l);
    s << fmt::format("  rank {:>3}: tp {} cp {} dp {} pp {} |", r, c.tp, c.cp, c.dp, c.pp);
    for (auto k : all_group_kinds())
      for (const auto& g : groups[k])
        if (std::find(g.begin(), g.end(), r) != g.end())
          s << fmt::format(" {} [{}]", group_name(k), fmt::join(g, ","));
    s << "\n";
  }
  return s.str();
}

}  // namespace tessel::parallel
