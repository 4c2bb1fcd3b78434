#include "parallel/mesh.h"
#include "parallel/pp/schedule.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <array>
#include <cmath>
#include <cstdlib>
#include <map>
#include <numeric>
#include <sstream>

#include "device/cuda.h"

namespace tessel::parallel {
namespace {

// Which interface Gloo binds: GLOO_SOCKET_IFNAME when set (as in PyTorch); loopback when the job
// is on this machine (every rank local, or the master is a loopback address); else the address
// this host's name resolves to.
std::shared_ptr<::gloo::transport::Device> gloo_device(const WorldInfo& w) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  const bool loopback = w.local_world == w.world || w.master_addr == "localhost" ||
                        w.master_addr.rfind("127.", 0) == 0;
  return loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                  : c10d::ProcessGroupGloo::createDefaultDevice();
}

// TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown) unless the user chose otherwise; read by every
// ProcessGroupNCCL at construction, so set before the first.
std::string nccl_error_handling() {
  setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", /*overwrite=*/0);
  return std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING");
}

}  // namespace

const char* group_name(GroupKind k) {
  switch (k) {
    case GroupKind::kTp:
      return "tp";
    case GroupKind::kCp:
      return "cp";
    case GroupKind::kDp:
      return "dp";
    case GroupKind::kPp:
      return "pp";
    case GroupKind::kDpCp:
      return "dp_cp";
    case GroupKind::kMp:
      return "mp";
    case GroupKind::kEmbedding:
      return "embedding";
    case GroupKind::kEp:
      return "ep";
    case GroupKind::kEdpCp:
      return "edp_cp";
  }
  return "?";
}

const std::vector<GroupKind>& all_group_kinds() {
  static const std::vector<GroupKind> k = {
      GroupKind::kTp, GroupKind::kCp,        GroupKind::kDp, GroupKind::kPp,   GroupKind::kDpCp,
      GroupKind::kMp, GroupKind::kEmbedding, GroupKind::kEp, GroupKind::kEdpCp};
  return k;
}

Coord coord_of(int64_t rank, const Layout& l) {
  return {rank % l.tp, (rank / l.tp) % l.cp, (rank / (l.tp * l.cp)) % l.dp,
          rank / (l.tp * l.cp * l.dp)};
}

int64_t rank_of(const Coord& c, const Layout& l) {
  return c.tp + l.tp * (c.cp + l.cp * (c.dp + l.dp * c.pp));
}

std::vector<std::vector<int64_t>> group_ranks(GroupKind k, const Layout& l) {
  // Ranks that agree on every coordinate outside the group's axes form one group.
  auto key = [&](const Coord& c) -> std::array<int64_t, 4> {
    switch (k) {
      case GroupKind::kTp:
        return {-1, c.cp, c.dp, c.pp};
      case GroupKind::kCp:
        return {c.tp, -1, c.dp, c.pp};
      case GroupKind::kDp:
        return {c.tp, c.cp, -1, c.pp};
      case GroupKind::kPp:
        return {c.tp, c.cp, c.dp, -1};
      case GroupKind::kDpCp:
        return {c.tp, -1, -1, c.pp};
      case GroupKind::kMp:
        return {-1, c.cp, c.dp, -1};
      case GroupKind::kEmbedding:
        return {c.tp, c.cp, c.dp, -1};
      case GroupKind::kEp:  // the block of ep consecutive dp ranks (the -1 - block tells it apart)
        return {c.tp, c.cp, -1 - c.dp / l.ep, c.pp};
      case GroupKind::kEdpCp:  // the same place in every block, any cp
        return {c.tp, -1, c.dp % l.ep, c.pp};
    }
    return {};
  };
  if ((k == GroupKind::kEp || k == GroupKind::kEdpCp) && l.ep == 1) return {};
  std::map<std::array<int64_t, 4>, std::vector<int64_t>> groups;
  for (int64_t r = 0; r < l.world(); ++r) {
    Coord c = coord_of(r, l);
    if (k == GroupKind::kEmbedding && (l.pp == 1 || (c.pp != 0 && c.pp != l.pp - 1))) continue;
    groups[key(c)].push_back(r);
  }
  std::vector<std::vector<int64_t>> out;
  for (auto& [_, ranks] : groups) out.push_back(ranks);
  std::sort(out.begin(), out.end());
  return out;
}

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
  const bool chunked = p.pipeline_schedule == "interleaved" || p.pipeline_schedule == "zbv";
  problems.require(p.virtual_stages == 1 || (chunked && p.pp > 1),
                   fmt::format("parallel.pipeline.virtual_stages ({}) > 1 needs schedule "
                               "interleaved or zbv and parallel.pp > 1 (schedule {}, pp {})",
                               p.virtual_stages, p.pipeline_schedule, p.pp));
  problems.require(!chunked || p.pp > 1,
                   fmt::format("parallel.pipeline.schedule {} needs parallel.pp > 1 (pp is 1)",
                               p.pipeline_schedule));
  if (p.pp > 1) {  // the schedule's own needs (m >= p; interleaved: m % p == 0, v >= 2)
    try {
      pp::make_schedule(p.pipeline_schedule, p.pp,
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
  const bool hybrid = p.context_method == "hybrid";
  if (p.cp == 1 || (p.context_method != "alltoall" && !hybrid)) return;
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
      p.context_method, key, c.model.heads, p.tp, heads, key, a,
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
  const bool cuda = t.device == "cuda" || (t.device == "auto" && device::cuda_available());
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

std::string agent_store_prefix() {
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (!agent || std::string(agent) != "True") return "";
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return std::string("/tessel/attempt_") + (attempt ? attempt : "0");
}

c10::intrusive_ptr<c10d::Store> rendezvous(const WorldInfo& w, double timeout_s) {
  const std::string prefix = agent_store_prefix();
  const bool agent_store = !prefix.empty();
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(w.master_port);
  o.isServer = w.rank == 0 && !agent_store;
  o.numWorkers = w.world;
  o.waitWorkers = false;  // the start-up agreement waits, naming the ranks that do not come
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  try {
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(w.master_addr, o);
    if (!agent_store) return store;
    return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  } catch (const c10::Error& e) {
    throw UserError(fmt::format("rank {}: rendezvous at {}:{} failed: {}", w.rank, w.master_addr,
                                w.master_port, e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw UserError(fmt::format("rank {}: rendezvous at {}:{} failed: {}", w.rank, w.master_addr,
                                w.master_port, e.what()));
  }
}

int64_t Mesh::shutdown() {
  if (shut_down_) return 0;
  shut_down_ = true;
  if (world_->size() > 1) world_->barrier();
  int64_t n = 0;
  for (auto it = groups_.rbegin(); it != groups_.rend(); ++it) n += (*it)->shutdown();
  return n + world_->shutdown();
}

std::vector<const Group*> Mesh::groups() const {
  std::vector<const Group*> out{world_.get()};
  for (const auto& g : groups_) out.push_back(g.get());
  return out;
}

namespace {

// parallel.backend with auto resolved: NCCL on CUDA, Gloo on the CPU.
std::string choose_backend(const Config& c, const torch::Device& device) {
  std::string backend =
      c.parallel.backend == "auto" ? (device.is_cuda() ? "nccl" : "gloo") : c.parallel.backend;
  if (is_nccl_backend(backend) && !device.is_cuda())
    throw UserError(c.source + ": parallel.backend nccl needs training.device cuda");
  return backend;
}

// Makes this rank's Group of `ranks` named `name`: with a backend of its own, connected over
// the store under the group's name, when it has several ranks.
struct GroupMaker {
  const WorldInfo& w;
  const std::string& backend;
  c10::intrusive_ptr<c10d::Store> store;
  std::chrono::milliseconds timeout;
  const torch::Device& device;

  std::unique_ptr<Group> operator()(const std::string& name,
                                    const std::vector<int64_t>& ranks) const {
    c10::intrusive_ptr<c10d::Backend> made;
    if (ranks.size() > 1) {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
      const int my =
          static_cast<int>(std::find(ranks.begin(), ranks.end(), w.rank) - ranks.begin());
      const int n = static_cast<int>(ranks.size());
      if (backend == "gloo") {
        auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
        opts->devices.push_back(gloo_device(w));
        made = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, my, n, opts);
        made->setGroupDesc(name);
      } else {
        const auto* cuda = device::cuda_module();
        if (!cuda)
          throw UserError("parallel.backend nccl needs CUDA: " + device::cuda_unavailable_reason());
        made = cuda->make_nccl(prefixed, my, n, name, ranks, timeout, device);
      }
    }
    return std::make_unique<Group>(name, ranks, w.rank, made);
  }
};

// Every rank walks every group of every kind in the same order and joins the ones that hold it
// (a group of one, without a backend, when none of a kind does: embedding, off the first and
// last pipeline stage or without pipelining).
std::vector<std::unique_ptr<Group>> join_groups(const GroupMaker& make, const Layout& l,
                                                int64_t rank) {
  std::vector<std::unique_ptr<Group>> joined;
  for (auto k : all_group_kinds()) {
    std::unique_ptr<Group> mine;
    auto groups = group_ranks(k, l);
    for (size_t i = 0; i < groups.size(); ++i)
      if (std::find(groups[i].begin(), groups[i].end(), rank) != groups[i].end())
        mine = make(fmt::format("{}.{}", group_name(k), i), groups[i]);
    if (!mine)
      mine = std::make_unique<Group>(group_name(k), std::vector<int64_t>{rank}, rank, nullptr);
    joined.push_back(std::move(mine));
  }
  return joined;
}

// The pipeline group's point-to-point channels: one per direction between pipeline neighbours
// (stage i to i+1 and back, the last stage's wrap-around to the first included, which
// interleaved schedules use). Every rank of the group walks the same list in the same order.
void add_pipeline_channels(const GroupMaker& make, Group& pp) {
  const int64_t p = pp.size();
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t i = 0; i < p; ++i)
    for (auto pair : {std::pair{i, (i + 1) % p}, std::pair{(i + 1) % p, i}})
      if (std::find(pairs.begin(), pairs.end(), pair) == pairs.end()) pairs.push_back(pair);
  for (auto [from, to] : pairs)
    if (from == pp.rank() || to == pp.rank())
      pp.add_channel(from, to,
                     make(fmt::format("{}.p2p.{}to{}", pp.name(), from, to),
                          {pp.ranks()[from], pp.ranks()[to]}));
}

// Hybrid context parallelism's split of the cp group: all-to-all groups of `a` consecutive cp
// ranks, and rings of the ranks at the same place in every all-to-all group. Every rank of the
// cp group walks the same list in the same order.
void add_context_split(const GroupMaker& make, Group& cp, int64_t a) {
  const int64_t n = cp.size(), me = cp.rank();
  std::unique_ptr<Group> inner, outer;
  for (int64_t j = 0; j < n / a; ++j) {
    std::vector<int64_t> ranks(cp.ranks().begin() + j * a, cp.ranks().begin() + (j + 1) * a);
    if (me / a == j) inner = make(fmt::format("{}.a2a.{}", cp.name(), j), ranks);
  }
  for (int64_t i = 0; i < a; ++i) {
    std::vector<int64_t> ranks;
    for (int64_t j = 0; j < n / a; ++j) ranks.push_back(cp.ranks()[j * a + i]);
    if (me % a == i) outer = make(fmt::format("{}.ring.{}", cp.name(), i), ranks);
  }
  cp.set_split(std::move(inner), std::move(outer));
}

// What a group carries beside its own communicator, as the start-up log says it.
std::string extras(const Group& g) {
  std::string out;
  if (g.has_side()) out += " (+ a side channel)";
  if (g.channels()) out += fmt::format(" (+ {} p2p channels)", g.channels());
  if (g.inner())
    out += fmt::format(" (+ all-to-all over [{}], ring over [{}])",
                       fmt::join(g.inner()->ranks(), ","), fmt::join(g.outer()->ranks(), ","));
  return out;
}

// Every communicator exists now, created in this order on every rank.
void log_groups(const Mesh& mesh) {
  std::string created;
  for (const auto* g : mesh.groups()) {
    if (g->size() > 1)
      created += fmt::format("{}{}{} [{}]", created.empty() ? "" : ", ", g->name(), extras(*g),
                             fmt::join(g->ranks(), ","));
  }
  if (!created.empty())
    spdlog::info("process groups of this rank ({}, connected at start-up): {}", mesh.backend(),
                 created);
}

}  // namespace

std::unique_ptr<Mesh> Mesh::create(const Config& c, const WorldInfo& w, const torch::Device& device,
                                   c10::intrusive_ptr<c10d::Store> store) {
  auto mesh = std::unique_ptr<Mesh>(new Mesh());
  mesh->layout_ = check_layout(c, w.world, w.local_world);
  mesh->rank_ = w.rank;
  mesh->coord_ = coord_of(w.rank, mesh->layout_);
  mesh->device_ = device;
  mesh->backend_ = choose_backend(c, device);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c.parallel.timeout_s * 1000));
  if (w.world > 1 && !store) store = rendezvous(w, c.parallel.timeout_s);
  const GroupMaker make{w, mesh->backend_, store, timeout, device};
  if (is_nccl_backend(mesh->backend_) && w.world > 1) {
    const std::string handling = nccl_error_handling();  // before the first ProcessGroupNCCL
    spdlog::info(
        "NCCL on {}: timeout {} s (parallel.timeout_s), TORCH_NCCL_ASYNC_ERROR_HANDLING={}",
        device.str(), c.parallel.timeout_s, handling);
  }
  std::vector<int64_t> all(static_cast<size_t>(w.world));
  std::iota(all.begin(), all.end(), 0);
  mesh->world_ = make("world", all);
  mesh->store_ = store;
  mesh->groups_ = join_groups(make, mesh->layout_, w.rank);
  // ZeRO-3 gathers weights while backward reduce-scatters gradients, both over the data group:
  // on a side channel of their own they run beside each other instead of one behind the other.
  for (auto kind : {GroupKind::kDpCp, GroupKind::kEdpCp}) {  // (edp_cp: the MoE experts')
    auto& data = *mesh->groups_[static_cast<size_t>(kind)];
    if (c.parallel.zero == 3 && data.size() > 1)
      data.set_side(make(data.name() + ".gather", data.ranks()));
  }
  // Pipeline transfers go one way per channel, so that a stage waits on its receives only.
  auto& pp = *mesh->groups_[static_cast<size_t>(GroupKind::kPp)];
  if (pp.size() > 1) add_pipeline_channels(make, pp);
  auto& cp = *mesh->groups_[static_cast<size_t>(GroupKind::kCp)];
  if (cp.size() > 1 && c.parallel.context_method == "hybrid")
    add_context_split(make, cp, c.parallel.context_alltoall_size);
  log_groups(*mesh);
  return mesh;
}

}  // namespace tessel::parallel
