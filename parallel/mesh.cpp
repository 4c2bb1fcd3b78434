#include "parallel/mesh.h"

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
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "core/device/cuda.h"

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

Coord coord_of(int64_t rank, const plan::Layout& l) {
  return {rank % l.tp, (rank / l.tp) % l.cp, (rank / (l.tp * l.cp)) % l.dp,
          rank / (l.tp * l.cp * l.dp)};
}

int64_t rank_of(const Coord& c, const plan::Layout& l) {
  return c.tp + l.tp * (c.cp + l.cp * (c.dp + l.dp * c.pp));
}

std::vector<std::vector<int64_t>> group_ranks(GroupKind k, const plan::Layout& l) {
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

SplitRanks split_ranks(const std::vector<int64_t>& members, int64_t block) {
  SplitRanks out;
  const int64_t n = static_cast<int64_t>(members.size());
  if (block < 1 || n % block != 0) return out;
  for (int64_t j = 0; j < n / block; ++j)
    out.inner.emplace_back(members.begin() + j * block, members.begin() + (j + 1) * block);
  for (int64_t i = 0; i < block; ++i) {
    out.outer.emplace_back();
    for (int64_t j = 0; j < n / block; ++j) out.outer.back().push_back(members[j * block + i]);
  }
  return out;
}

Group& Mesh::zero_shards(bool expert) const {
  Group& data = expert ? expert_data() : dp_cp();
  return data.inner() ? *data.inner() : data;
}

Group* Mesh::zero_replicas(bool expert) const { return (expert ? expert_data() : dp_cp()).outer(); }

std::string agent_store_prefix() {
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (!agent || std::string(agent) != "True") return "";
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return std::string("/tessel/attempt_") + (attempt ? attempt : "0");
}

namespace {

// Under tessel-launch each worker knows its job (TESSEL_JOB_ID): rank 0 posts it, the others
// read it before they write anything, so that a rank which reached another job's store (two jobs
// given one --master-port) stops naming the port rather than joining, and disturbing, that job.
void check_job(c10d::Store& store, const WorldInfo& w) {
  const char* job = std::getenv("TESSEL_JOB_ID");
  if (!job || !*job) return;
  const std::string key = "tessel/job";
  if (w.rank == 0 && w.master_port > 0) {
    store.set(key, std::vector<uint8_t>(job, job + std::strlen(job)));
    return;
  }
  const auto v = store.get(key);  // waits for rank 0 (the store's timeout)
  const std::string theirs(v.begin(), v.end());
  if (theirs != job)
    throw plan::UserError(fmt::format(
        "rank {}: the rendezvous at {}:{} belongs to another job ({}; this is job {}): two jobs "
        "were given one --master-port on this node; stop this one and give it another port",
        w.rank, w.master_addr, w.master_port, theirs, job));
}

}  // namespace

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
    check_job(*store, w);
    if (!agent_store) return store;
    return c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  } catch (const plan::UserError&) {
    throw;
  } catch (const c10::Error& e) {
    throw plan::UserError(fmt::format("rank {}: rendezvous at {}:{} failed: {}", w.rank,
                                      w.master_addr, w.master_port, e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw plan::UserError(fmt::format("rank {}: rendezvous at {}:{} failed: {}", w.rank,
                                      w.master_addr, w.master_port, e.what()));
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
plan::Backend choose_backend(const plan::Config& c, const torch::Device& device) {
  const plan::Backend backend =
      c.parallel.backend == plan::Backend::kAuto
          ? (device.is_cuda() ? plan::Backend::kNccl : plan::Backend::kGloo)
          : plan::Backend(c.parallel.backend);
  if (backend == plan::Backend::kNccl && !device.is_cuda())
    throw plan::UserError(c.source + ": parallel.backend nccl needs training.device cuda");
  return backend;
}

// Which groups may share a communicator. On NCCL one communicator is one stream, so groups that
// share one run one behind the other: the model's groups (tp, cp, ep: collectives inside forward
// and backward) keep theirs apart from the data groups' (gradient reductions that overlap
// backward, and the step's own sums), and the channels made for overlap (ZeRO-3's side channel,
// the pipeline's one-way channels, hybrid context parallelism's split) share with nothing.
enum class Lane { kAlone, kModel, kData };

Lane lane_of(GroupKind k) {
  return k == GroupKind::kTp || k == GroupKind::kCp || k == GroupKind::kEp ? Lane::kModel
                                                                           : Lane::kData;
}

// Makes this rank's Group of `ranks` named `name`. With several ranks it needs a communicator:
// the one an earlier group of the same members and lane made (every rank creates its groups in
// the same order, so the same groups share on every rank), else one of its own, connected over
// the store under the group's name. Without `connect` (Mesh::plan) nothing is connected: the
// communicators are only listed.
class GroupMaker {
 public:
  GroupMaker(const WorldInfo& w, plan::Backend backend, c10::intrusive_ptr<c10d::Store> store,
             std::chrono::milliseconds timeout, const torch::Device& device, bool connect)
      : w_(w),
        backend_(backend),
        store_(std::move(store)),
        timeout_(timeout),
        device_(device),
        connect_(connect) {}

  std::unique_ptr<Group> operator()(const std::string& name, const std::vector<int64_t>& ranks,
                                    Lane lane = Lane::kAlone) {
    if (ranks.size() <= 1) return std::make_unique<Group>(name, ranks, w_.rank, nullptr);
    if (lane != Lane::kAlone) {
      for (auto& made : made_)
        if (made.lane == lane && made.ranks == ranks) {
          listed_[made.index].shared_by.push_back(name);
          return std::make_unique<Group>(name, ranks, w_.rank, made.backend, /*owner=*/false);
        }
    }
    auto backend = connect_ ? connect(name, ranks) : c10::intrusive_ptr<c10d::Backend>();
    made_.push_back({lane, ranks, backend, listed_.size()});
    listed_.push_back({name, ranks, {}});
    return std::make_unique<Group>(name, ranks, w_.rank, backend);
  }

  /// A group described but not connected (no step of the plan uses it).
  std::unique_ptr<Group> unused(const std::string& name, const std::vector<int64_t>& ranks) const {
    return std::make_unique<Group>(name, ranks, w_.rank, nullptr);
  }

  const std::vector<Communicator>& listed() const { return listed_; }

 private:
  c10::intrusive_ptr<c10d::Backend> connect(const std::string& name,
                                            const std::vector<int64_t>& ranks) const {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store_);
    const int my = static_cast<int>(std::find(ranks.begin(), ranks.end(), w_.rank) - ranks.begin());
    const int n = static_cast<int>(ranks.size());
    if (backend_ == plan::Backend::kGloo) {
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout_);
      opts->devices.push_back(gloo_device(w_));
      auto made = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, my, n, opts);
      made->setGroupDesc(name);
      return made;
    }
    const auto* cuda = device::cuda_module();
    if (!cuda)
      throw plan::UserError("parallel.backend nccl needs CUDA: " +
                            device::cuda_unavailable_reason());
    return cuda->make_nccl(prefixed, my, n, name, ranks, timeout_, device_);
  }

  struct Made {
    Lane lane;
    std::vector<int64_t> ranks;
    c10::intrusive_ptr<c10d::Backend> backend;
    size_t index;  // in listed_
  };
  const WorldInfo& w_;
  plan::Backend backend_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  const torch::Device& device_;
  bool connect_;
  std::vector<Made> made_;
  std::vector<Communicator> listed_;
};

// Every rank walks every group of every kind in the same order and joins the ones that hold it
// (a group of one when none of a kind does: embedding, off the first and last pipeline stage or
// without pipelining). The kinds no step of the plan uses are described, not connected.
std::vector<std::unique_ptr<Group>> join_groups(GroupMaker& make, const plan::Config& c,
                                                const plan::Layout& l, int64_t rank) {
  std::vector<std::unique_ptr<Group>> joined;
  for (auto k : all_group_kinds()) {
    std::unique_ptr<Group> mine;
    auto groups = group_ranks(k, l);
    for (size_t i = 0; i < groups.size(); ++i)
      if (std::find(groups[i].begin(), groups[i].end(), rank) != groups[i].end()) {
        const auto name = fmt::format("{}.{}", group_name(k), i);
        mine =
            group_used(k, c, l) ? make(name, groups[i], lane_of(k)) : make.unused(name, groups[i]);
      }
    if (!mine) mine = make(group_name(k), {rank});
    joined.push_back(std::move(mine));
  }
  return joined;
}

// The pipeline group's point-to-point channels: one per direction between pipeline neighbours
// (stage i to i+1 and back, the last stage's wrap-around to the first included, which
// interleaved schedules use). Every rank of the group walks the same list in the same order.
void add_pipeline_channels(GroupMaker& make, Group& pp) {
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

// A two-level split of `group` (Group::set_split): blocks of `a` consecutive members named
// "<group>.<inner>.<j>", and the members at the same place in every block, "<group>.<outer>.<i>".
// Hybrid context parallelism: all-to-all blocks and rings; hybrid sharding: ZeRO's shard groups
// and their replicas. Every rank of the group walks the same list in the same order.
void add_split(GroupMaker& make, Group& group, int64_t a, const char* inner_tag,
               const char* outer_tag) {
  const auto blocks = split_ranks(group.ranks(), a);
  const int64_t me = group.rank();
  std::unique_ptr<Group> inner, outer;
  for (size_t j = 0; j < blocks.inner.size(); ++j)
    if (me / a == static_cast<int64_t>(j))
      inner = make(fmt::format("{}.{}.{}", group.name(), inner_tag, j), blocks.inner[j]);
  for (size_t i = 0; i < blocks.outer.size(); ++i)
    if (me % a == static_cast<int64_t>(i))
      outer = make(fmt::format("{}.{}.{}", group.name(), outer_tag, i), blocks.outer[i]);
  group.set_split(std::move(inner), std::move(outer));
}

// Every communicator exists now, created in this order on every rank; the groups that use one
// made by an earlier group are named beside it.
void log_communicators(const Mesh& mesh) {
  std::vector<std::string> listed, unused;
  for (const auto& m : mesh.communicators())
    listed.push_back(fmt::format(
        "{} [{}]{}", m.name, fmt::join(m.ranks, ","),
        m.shared_by.empty() ? "" : fmt::format(" (also {})", fmt::join(m.shared_by, ", "))));
  for (const auto* g : mesh.groups())
    if (g->size() > 1 && !g->connected()) unused.push_back(g->name());
  if (!listed.empty())
    spdlog::info("communicators of this rank ({}, connected at start-up): {}",
                 plan::name_of(mesh.backend()), fmt::join(listed, ", "));
  if (!unused.empty())
    spdlog::info("groups no step of this plan uses (not connected): {}", fmt::join(unused, ", "));
}

}  // namespace

bool table_on_two_stages(const plan::Config& c, const plan::Layout& l) {
  return l.pp > 1 && c.model.tied() && !plan::schedule_shape(c.parallel.pipeline_schedule).v_shape;
}

bool group_used(GroupKind k, const plan::Config& c, const plan::Layout& l) {
  switch (k) {
    case GroupKind::kDp:  // gradients are reduced over dp_cp, which is dp when cp is 1
    case GroupKind::kMp:  // norms are summed over the world
      return false;
    case GroupKind::kEmbedding:
      return table_on_two_stages(c, l);
    default:
      return true;
  }
}

std::unique_ptr<Mesh> Mesh::build(const plan::Config& c, const WorldInfo& w,
                                  const torch::Device& device,
                                  c10::intrusive_ptr<c10d::Store> store, bool connect) {
  auto mesh = std::unique_ptr<Mesh>(new Mesh());
  mesh->layout_ = plan::check_layout(c, w.world, w.local_world);
  mesh->rank_ = w.rank;
  mesh->coord_ = coord_of(w.rank, mesh->layout_);
  mesh->device_ = device;
  mesh->backend_ = connect ? choose_backend(c, device) : plan::Backend(c.parallel.backend);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c.parallel.timeout_s * 1000));
  if (connect && w.world > 1 && !store) store = rendezvous(w, c.parallel.timeout_s);
  GroupMaker make{w, mesh->backend_, store, timeout, device, connect};
  if (connect && mesh->backend_ == plan::Backend::kNccl && w.world > 1) {
    const std::string handling = nccl_error_handling();  // before the first ProcessGroupNCCL
    spdlog::info(
        "NCCL on {}: timeout {} s (parallel.timeout_s), TORCH_NCCL_ASYNC_ERROR_HANDLING={}",
        device.str(), c.parallel.timeout_s, handling);
  }
  std::vector<int64_t> all(static_cast<size_t>(w.world));
  std::iota(all.begin(), all.end(), 0);
  mesh->world_ = make("world", all, Lane::kData);
  mesh->store_ = store;
  mesh->groups_ = join_groups(make, c, mesh->layout_, w.rank);
  // Hybrid sharding: each data group split into ZeRO's shard groups and their replicas. ZeRO-3
  // gathers weights while backward reduce-scatters gradients, both over the shard group: on a
  // side channel of their own they run beside each other instead of one behind the other.
  const auto split = plan::zero_split(c, mesh->layout_);
  for (auto kind : {GroupKind::kDpCp, GroupKind::kEdpCp}) {  // (edp_cp: the MoE experts')
    auto& data = *mesh->groups_[static_cast<size_t>(kind)];
    if (split.hybrid() && data.size() > 1)
      add_split(make, data, kind == GroupKind::kDpCp ? split.shards : split.expert_shards, "shard",
                "replica");
    auto& shards = data.inner() ? *data.inner() : data;
    if (plan::sharding(c).weights && shards.size() > 1)
      shards.set_side(make(shards.name() + ".gather", shards.ranks()));
  }
  // Pipeline transfers go one way per channel, so that a stage waits on its receives only.
  auto& pp = *mesh->groups_[static_cast<size_t>(GroupKind::kPp)];
  if (pp.size() > 1) add_pipeline_channels(make, pp);
  auto& cp = *mesh->groups_[static_cast<size_t>(GroupKind::kCp)];
  if (cp.size() > 1 && c.parallel.context_method == plan::CpMethod::kHybrid)
    add_split(make, cp, c.parallel.context_alltoall_size, "a2a", "ring");
  mesh->communicators_ = make.listed();
  if (connect) log_communicators(*mesh);
  return mesh;
}

std::unique_ptr<Mesh> Mesh::create(const plan::Config& c, const WorldInfo& w,
                                   const torch::Device& device,
                                   c10::intrusive_ptr<c10d::Store> store) {
  return build(c, w, device, std::move(store), /*connect=*/true);
}

std::unique_ptr<Mesh> Mesh::plan(const plan::Config& c, const WorldInfo& w) {
  return build(c, w, torch::Device(torch::kCPU), {}, /*connect=*/false);
}

std::string node_placement(const plan::Config& c, const plan::Layout& l, int64_t ranks_per_node) {
  std::vector<std::string> inside, across;
  for (auto k : all_group_kinds()) {
    if (!group_used(k, c, l)) continue;
    size_t most = 0, members = 0;
    for (const auto& g : group_ranks(k, l)) {
      std::set<int64_t> nodes;
      for (int64_t r : g) nodes.insert(r / ranks_per_node);
      most = std::max(most, nodes.size()), members = std::max(members, g.size());
    }
    if (members < 2) continue;
    if (most <= 1)
      inside.push_back(group_name(k));
    else
      across.push_back(fmt::format("{} ({} nodes)", group_name(k), most));
  }
  return fmt::format("inside a node of {} ranks: {}; across nodes: {}", ranks_per_node,
                     inside.empty() ? "none" : fmt::format("{}", fmt::join(inside, ", ")),
                     across.empty() ? "none" : fmt::format("{}", fmt::join(across, ", ")));
}

std::string describe_grid(const plan::Layout& l) {
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
