// The rank grid and every process group, built once from the plan (order tp-cp-dp-pp: tp varies
// fastest, so tensor-parallel peers share a node; pp slowest). One Mesh is passed explicitly
// (const Mesh&) to everything that communicates; there are no global groups.
#pragma once

#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>
#include <vector>

#include "core/plan/config.h"
#include "core/plan/layout.h"
#include "parallel/comm.h"
#include "parallel/world.h"

namespace tessel::parallel {

struct Coord {
  int64_t tp, cp, dp, pp;
};

/// The kinds of groups, in the order every rank creates them.
enum class GroupKind { kTp, kCp, kDp, kPp, kDpCp, kMp, kEmbedding, kEp, kEdpCp };
const char* group_name(GroupKind k);
const std::vector<GroupKind>& all_group_kinds();

Coord coord_of(int64_t rank, const plan::Layout& l);
int64_t rank_of(const Coord& c, const plan::Layout& l);
/// Every group of a kind (each a sorted list of global ranks), ordered by their first rank.
///   tp, cp, dp, pp: ranks that differ only in that coordinate
///   dp_cp: differ in dp and cp (gradient reduction); mp: differ in tp and pp (one model replica,
///   for norms); embedding: first and last pipeline stage (tied weights; empty when pp == 1);
///   ep: ep consecutive dp ranks (dp / ep of them: rank's dp // ep) that split an MoE layer's
///   experts; edp_cp: the ranks holding the same experts, differing in dp // ep and cp (expert
///   gradients are summed over it). Both empty when ep == 1 (dp_cp is then the expert data group).
std::vector<std::vector<int64_t>> group_ranks(GroupKind k, const plan::Layout& l);

/// Whether a step of the plan uses groups of kind `k`: dp and mp are described (--dry-run's grid)
/// but never connected; embedding only where a tied token table sits on two stages.
bool group_used(GroupKind k, const plan::Config& c, const plan::Layout& l);
/// A tied token table held by two pipeline stages, the first (embedding) and the last (head),
/// whose gradients the embedding group sums: pp > 1, tied, and not zbv (which keeps both ends
/// on one rank).
bool table_on_two_stages(const plan::Config& c, const plan::Layout& l);

/// One communicator of this rank: the group that made it, its members, and the groups of the
/// same members that use it too (Mesh::create says which groups share).
struct Communicator {
  std::string name;
  std::vector<int64_t> ranks;
  std::vector<std::string> shared_by;
};

/// Text of the rank grid: every rank's coordinates and its group members (for --dry-run).
std::string describe_grid(const plan::Layout& l);

/// Which of the plan's groups (those used, of more than one rank) stay inside a node of
/// `ranks_per_node` consecutive ranks and which cross nodes, with the most nodes one group of
/// the kind spans: "inside a node of 8 ranks: tp, ep; across nodes: dp (2 nodes), pp (4
/// nodes)". The rank order (tp innermost, then cp, dp, pp; ep consecutive data ranks) keeps a
/// group inside a node when the ranks between its members fit in one.
std::string node_placement(const plan::Config& c, const plan::Layout& l, int64_t ranks_per_node);

/// A two-level split of a group's `members` (in their order): blocks of `block` consecutive
/// members (`inner`), and the members at the same place in every block (`outer`). Empty when
/// `block` does not divide them. Hybrid context parallelism and hybrid sharding split so.
struct SplitRanks {
  std::vector<std::vector<int64_t>> inner, outer;
};
SplitRanks split_ranks(const std::vector<int64_t>& members, int64_t block);

/// Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE=True) MASTER_PORT is the
/// agent's own store: every rank is its client, and each restart attempt keeps its keys under
/// this prefix ("/tessel/attempt_<TORCHELASTIC_RESTART_COUNT>"). Empty otherwise.
std::string agent_store_prefix();
/// The rendezvous store: a TCPStore at master_addr:master_port served by rank 0 (which does not
/// wait for the others here); the others connect, retrying up to timeout_s. Throws UserError.
c10::intrusive_ptr<c10d::Store> rendezvous(const WorldInfo& w, double timeout_s);

class Mesh {
 public:
  /// Every process group, created and connected at once, in the same order on every rank, over
  /// `store` (null: a rendezvous of its own, when there are several processes). Gloo on CPU;
  /// NCCL on CUDA (bound to `device`, parallel.timeout_s, asynchronous error handling).
  /// One communicator per member set: a group whose members match an earlier group's uses its
  /// communicator, except that the model's groups (tp, cp, ep) never share with the data groups
  /// (world, pp, embedding, dp_cp, edp_cp), whose gradient reductions overlap them; ZeRO-3's side
  /// channels, the pipeline's channels and hybrid CP's split have their own. Groups no step uses
  /// (group_used) are not connected. The start-up log lists the communicators.
  static std::unique_ptr<Mesh> create(const plan::Config& c, const WorldInfo& w,
                                      const torch::Device& device,
                                      c10::intrusive_ptr<c10d::Store> store = {});
  /// The groups create() makes for rank w.rank, none connected; communicators() lists the ones
  /// create() would connect (tests, and counting without processes).
  static std::unique_ptr<Mesh> plan(const plan::Config& c, const WorldInfo& w);

  const plan::Layout& layout() const { return layout_; }
  const Coord& coord() const { return coord_; }
  int64_t rank() const { return rank_; }
  int64_t world() const { return layout_.world(); }
  const torch::Device& device() const { return device_; }
  /// parallel.backend, resolved (gloo or nccl) when the mesh is connected; as the plan says
  /// (auto too) for Mesh::plan.
  plan::Backend backend() const { return backend_; }

  Group& world_group() const { return *world_; }
  Group& group(GroupKind k) const { return *groups_[static_cast<size_t>(k)]; }
  Group& dp_cp() const { return group(GroupKind::kDpCp); }
  /// The expert-parallel group (a group of one when parallel.ep is 1).
  Group& ep() const { return group(GroupKind::kEp); }
  /// The ranks that hold the same experts: their gradients are summed over it (dp_cp when ep is 1).
  Group& expert_data() const { return layout_.ep > 1 ? group(GroupKind::kEdpCp) : dp_cp(); }
  /// The ranks ZeRO shards a bucket over: the data group (expert: the expert data group), or
  /// under hybrid sharding (parallel.zero_shard) this rank's shard group of it.
  Group& zero_shards(bool expert) const;
  /// Under hybrid sharding, the ranks holding the same ZeRO pieces as this one (one per shard
  /// group): the pieces' gradients are summed over it. Null otherwise.
  Group* zero_replicas(bool expert) const;
  /// This rank's groups in creation order (world first), the same order on every rank.
  std::vector<const Group*> groups() const;
  /// This rank's communicators in creation order (those that shared ones name their users).
  const std::vector<Communicator>& communicators() const { return communicators_; }
  /// The rendezvous store (rank 0 serves it); null in a one-process run.
  c10d::Store* store() const { return store_.get(); }
  /// The end of a run that ends together (finished, or stopped on a signal): a world barrier
  /// after the last collective, so that no rank leaves while another still waits on one, then
  /// every communicator shut down (NCCL's would otherwise be aborted by their destructors).
  /// Once; no collective after it. A failing rank does not call it (its peers are told through
  /// the store, engine/run/startup.h). Returns the communicators shut down.
  int64_t shutdown();

 private:
  static std::unique_ptr<Mesh> build(const plan::Config& c, const WorldInfo& w,
                                     const torch::Device& device,
                                     c10::intrusive_ptr<c10d::Store> store, bool connect);
  plan::Layout layout_;
  Coord coord_{};
  int64_t rank_ = 0;
  torch::Device device_{torch::kCPU};
  plan::Backend backend_ = plan::Backend::kAuto;
  std::unique_ptr<Group> world_;
  std::vector<std::unique_ptr<Group>> groups_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::vector<Communicator> communicators_;
  bool shut_down_ = false;
};

}  // namespace tessel::parallel
