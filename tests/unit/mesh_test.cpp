#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/planner/planner.h"
#include "parallel/mesh.h"

namespace tessel::parallel {
namespace {

using Ranks = std::vector<std::vector<int64_t>>;

TEST(Mesh, RankOrderIsTpCpDpPp) {
  plan::Layout l{2, 1, 2, 2};  // tp, cp, dp, pp
  for (int64_t r = 0; r < l.world(); ++r) EXPECT_EQ(rank_of(coord_of(r, l), l), r);
  Coord c = coord_of(5, l);  // 5 = tp 1 + 2·(dp 0) + 4·(pp 1)... check each coordinate
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 0);
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(group_ranks(GroupKind::kTp, l), (Ranks{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(group_ranks(GroupKind::kDp, l), (Ranks{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(group_ranks(GroupKind::kPp, l), (Ranks{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(group_ranks(GroupKind::kCp, l), (Ranks{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(group_ranks(GroupKind::kMp, l), (Ranks{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(group_ranks(GroupKind::kEmbedding, l), (Ranks{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

TEST(Mesh, ContextAndDataShareTheGradientGroup) {
  plan::Layout l{1, 2, 2, 1};
  EXPECT_EQ(group_ranks(GroupKind::kCp, l), (Ranks{{0, 1}, {2, 3}}));
  EXPECT_EQ(group_ranks(GroupKind::kDpCp, l), (Ranks{{0, 1, 2, 3}}));
  EXPECT_TRUE(group_ranks(GroupKind::kEmbedding, l).empty());  // pp == 1: no embedding group
  plan::Layout deep{1, 1, 1, 4};
  EXPECT_EQ(group_ranks(GroupKind::kEmbedding, deep), (Ranks{{0, 3}}));  // first and last stage
}

plan::Config plan(const std::string& extra) {
  return plan::load_config_text(
      "data: {path: x}\nmodel: {layers: 4, hidden: 64, heads: 4}\n" + extra, "p.yaml");
}

// Which groups stay inside a node: with tp 2 innermost and ep consecutive data ranks, an expert
// group of 4 fits an 8-rank node (ranks 0, 2, 4, 6) and one of 8 spans two.
TEST(Mesh, NodePlacementSaysWhichGroupsCrossNodes) {
  const auto c = plan::load_config_text(
      "data: {path: x}\nmodel: {arch: llama, layers: 4, hidden: 64, heads: 4, moe: {experts: 8, "
      "ffn_hidden: "
      "64}}\nparallel: {tp: 2, pp: 4, ep: 4, sequence_parallel: true}\n",
      "p.yaml");
  plan::Layout l{2, 1, 8, 4, 4};
  EXPECT_EQ(node_placement(c, l, 8),
            "inside a node of 8 ranks: tp, ep; across nodes: pp (4 nodes), dp_cp (2 nodes), "
            "edp_cp (2 nodes)");
  l.ep = 8;
  EXPECT_EQ(node_placement(c, l, 8),
            "inside a node of 8 ranks: tp; across nodes: pp (4 nodes), dp_cp (2 nodes), ep (2 "
            "nodes)");
  EXPECT_EQ(node_placement(c, l, 64),
            "inside a node of 64 ranks: tp, pp, dp_cp, ep; across nodes: none");
}

void expect_layout_error(const plan::Config& c, int64_t world, const std::string& part) {
  try {
    plan::check_layout(c, world, world);
    FAIL() << "accepted; expected: " << part;
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// Rank 0's communicators for a plan on `world` processes, each as "name [ranks] (also ...)".
// `model`: more keys of model (", arch: gpt2").
std::vector<std::string> communicators(const std::string& model, const std::string& extra,
                                       int world) {
  WorldInfo w;
  w.world = world;
  w.local_world = world;
  std::vector<std::string> out;
  const bool batch = extra.find("training:") != std::string::npos;
  auto mesh =
      Mesh::plan(plan::load_config_text(
                     "data: {path: x}\nmodel: {layers: 4, hidden: 64, heads: 4" + model + "}\n" +
                         extra + (batch ? "" : "training: {global_batch: 8, micro_batch: 1}\n"),
                     "p.yaml"),
                 w);
  for (const auto& m : mesh->communicators()) {
    std::string s = m.name + " [" + fmt::format("{}", fmt::join(m.ranks, ",")) + "]";
    if (!m.shared_by.empty())
      s += " (also " + fmt::format("{}", fmt::join(m.shared_by, ", ")) + ")";
    out.push_back(s);
  }
  for (const auto* g : mesh->groups()) EXPECT_TRUE(g->size() == 1 || !g->connected()) << g->name();
  return out;
}

using Names = std::vector<std::string>;

// One communicator per member set (the model's groups apart from the data groups'), and none
// for the groups no step uses (dp, mp, an untied or zbv token table). The code before this test
// connected every group of several ranks: 3, 6, 9, 4 and 7 communicators for the first five
// plans below (world, dp and dp_cp at dp 2; mp and embedding beside pp; ...).
TEST(Mesh, OneCommunicatorPerMemberSet) {
  EXPECT_EQ(communicators("", "parallel: {dp: 2}\n", 2), (Names{"world [0,1] (also dp_cp.0)"}));
  EXPECT_EQ(communicators(", arch: gpt2", "parallel: {pp: 2}\n", 2),
            (Names{"world [0,1] (also pp.0, embedding.0)", "pp.0.p2p.0to1 [0,1]",
                   "pp.0.p2p.1to0 [1,0]"}));
  EXPECT_EQ(communicators(", arch: gpt2", "parallel: {tp: 2, pp: 2, dp: 2}\n", 8),
            (Names{"world [0,1,2,3,4,5,6,7]", "tp.0 [0,1]", "pp.0 [0,4] (also embedding.0)",
                   "dp_cp.0 [0,2]", "pp.0.p2p.0to1 [0,4]", "pp.0.p2p.1to0 [4,0]"}));
  const std::string moe = ", arch: llama, moe: {experts: 4}";
  EXPECT_EQ(communicators(moe, "parallel: {dp: 2, ep: 2}\n", 2),
            (Names{"world [0,1] (also dp_cp.0)", "ep.0 [0,1]"}));
  EXPECT_EQ(communicators(moe, "parallel: {dp: 4, ep: 2, zero: 3}\n", 4),
            (Names{"world [0,1,2,3] (also dp_cp.0)", "ep.0 [0,1]", "edp_cp.0 [0,2]",
                   "dp_cp.0.gather [0,1,2,3]", "edp_cp.0.gather [0,2]"}));
  // The model's groups keep their own: cp's ring beside the gradient reduction over dp_cp.
  EXPECT_EQ(
      communicators(
          "", "parallel: {cp: 2}\ntraining: {seq_len: 64, global_batch: 8, micro_batch: 1}\n", 2),
      (Names{"world [0,1] (also dp_cp.0)", "cp.0 [0,1]"}));
  // An untied table across stages, and zbv's both ends on one rank: no embedding group.
  EXPECT_EQ(communicators(", arch: llama", "parallel: {pp: 2}\n", 2).front(),
            "world [0,1] (also pp.0)");
  EXPECT_EQ(communicators(", arch: gpt2",
                          "parallel: {pp: 2, pipeline: {schedule: zbv, virtual_stages: 2}}\n", 2)
                .front(),
            "world [0,1] (also pp.0)");
}

// The planner counts each NCCL communicator's own buffers by the peers it connects to
// (engine/planner/comm_buffers.cpp): a ring two (one in a pair), a pipeline channel one, an
// expert group every other member; Gloo none. The communicators are those listed above.
TEST(Mesh, PlannerCountsNcclBuffersPerPeer) {
  auto buffers = [](const std::string& model, const std::string& extra, int64_t world,
                    const std::string& profile) {
    const auto c =
        plan::load_config_text("data: {path: x}\nmodel: {layers: 4, hidden: 64, heads: 4" + model +
                                   "}\n" + extra + "training: {global_batch: 8, micro_batch: 1}\n",
                               "p.yaml");
    const auto l = plan::check_layout(c, world, 0);
    auto d = planner::device_profile("h100", {});
    d.cpu = profile == "cpu";  // a measured CPU profile: the run's ranks talk over Gloo
    return planner::communicator_buffers(c, l, 0, d);
  };
  // world [0..7] 2, tp [0,1] 1, pp [0,4] 1, dp_cp [0,2] 1, two pipeline channels 1 each.
  auto b = buffers(", arch: gpt2", "parallel: {tp: 2, pp: 2, dp: 2}\n", 8, "h100");
  EXPECT_EQ(b.communicators, 6);
  EXPECT_EQ(b.peers, 7);
  EXPECT_EQ(b.bytes, 7 * 384.0 * 1024 * 1024);
  // An expert group of 4 connects every member: world 2 + ep 3 + edp_cp [0,4] 1.
  b = buffers(", arch: llama, moe: {experts: 4}", "parallel: {dp: 8, ep: 4}\n", 8, "h100");
  EXPECT_EQ(b.communicators, 3);
  EXPECT_EQ(b.peers, 6);
  EXPECT_EQ(buffers("", "parallel: {dp: 2}\n", 2, "cpu").bytes, 0);  // Gloo keeps none
  EXPECT_EQ(buffers("", "parallel: {dp: 2, backend: gloo}\n", 2, "h100").bytes, 0);
  EXPECT_EQ(buffers("", "", 1, "h100").communicators, 0);
}

// Hybrid sharding (parallel.zero_shard): each data group split into ZeRO's shard groups of N
// consecutive members and the replicas at the same place in every group; the experts' data group
// into as many replicas; ZeRO-3's side channel on the shard group.
TEST(Mesh, HybridShardingSplitsTheDataGroups) {
  EXPECT_EQ(split_ranks({0, 2, 4, 6, 8, 10}, 2).inner, (Ranks{{0, 2}, {4, 6}, {8, 10}}));
  EXPECT_EQ(split_ranks({0, 2, 4, 6, 8, 10}, 2).outer, (Ranks{{0, 4, 8}, {2, 6, 10}}));
  EXPECT_TRUE(split_ranks({0, 1, 2}, 2).inner.empty());
  EXPECT_EQ(communicators("", "parallel: {dp: 4, zero: 1, zero_shard: 2}\n", 4),
            (Names{"world [0,1,2,3] (also dp_cp.0)", "dp_cp.0.shard.0 [0,1]",
                   "dp_cp.0.replica.0 [0,2]"}));
  EXPECT_EQ(communicators(", arch: llama, moe: {experts: 4}",
                          "parallel: {dp: 8, ep: 2, zero: 3, zero_shard: 4}\n", 8),
            (Names{"world [0,1,2,3,4,5,6,7] (also dp_cp.0)", "ep.0 [0,1]", "edp_cp.0 [0,2,4,6]",
                   "dp_cp.0.shard.0 [0,1,2,3]", "dp_cp.0.replica.0 [0,4]",
                   "dp_cp.0.shard.0.gather [0,1,2,3]", "edp_cp.0.shard.0 [0,2]",
                   "edp_cp.0.replica.0 [0,4]", "edp_cp.0.shard.0.gather [0,2]"}));
  const auto c = plan(
      "parallel: {dp: 8, cp: 2, zero: 2, zero_shard: 4}\ntraining: {seq_len: 64, global_batch: 8, "
      "micro_batch: 1}\n");
  const auto split = plan::zero_split(c, plan::check_layout(c, 16, 16));
  EXPECT_EQ(split.shards, 4);
  EXPECT_EQ(split.replicas, 4);
  expect_layout_error(plan("parallel: {dp: 6, zero: 1, zero_shard: 4}\n"), 6,
                      "parallel.zero_shard (4) must divide the data group, parallel.dp x "
                      "parallel.cp (6 x 1 = 6)");
  expect_layout_error(
      plan::load_config_text("data: {path: x}\nmodel: {arch: llama, layers: 4, hidden: 64, heads: "
                             "4, moe: {experts: 4}}\nparallel: {dp: 8, ep: 4, zero: 1, "
                             "zero_shard: 2}\n",
                             "p.yaml"),
      8, "parallel.zero_shard (2) must be a multiple of parallel.ep (4)");
}

TEST(Mesh, PlanChecksNameTheValues) {
  EXPECT_EQ(plan::check_layout(plan("training: {global_batch: 8, micro_batch: 2}\n"), 4, 4).dp, 4);
  expect_layout_error(plan("parallel: {dp: 2, tp: 2}\n"), 8,
                      "world size (8) must equal parallel.tp·cp·dp·pp (2·1·2·1 = 4)");
  expect_layout_error(plan("parallel: {tp: 3}\n"), 3,
                      "model.heads (4) must be divisible by parallel.tp (3)");
  expect_layout_error(plan("parallel: {pp: 8}\n"), 8,
                      "model.layers (4) must be >= parallel.pp (8) x pipeline.virtual_stages (1)");
  expect_layout_error(
      plan("parallel: {pp: 2, pipeline: {virtual_stages: 2}}\n"), 2,
      "parallel.pipeline.virtual_stages (2) > 1 needs schedule interleaved or zbv and "
      "parallel.pp > 1 (schedule 1f1b, pp 2)");
  expect_layout_error(plan("parallel: {pipeline: {schedule: interleaved, virtual_stages: 2}}\n"), 1,
                      "parallel.pipeline.schedule interleaved needs parallel.pp > 1 (pp is 1)");
  expect_layout_error(
      plan("parallel: {pp: 2, pipeline: {schedule: interleaved, virtual_stages: 2}}\n"
           "training: {global_batch: 3, micro_batch: 1}\n"),
      2, "interleaved needs micro-batches per step (3) divisible by parallel.pp (2)");
  expect_layout_error(plan("parallel: {cp: 3}\ntraining: {seq_len: 64}\n"), 3,
                      "training.seq_len (64) must be divisible by 2·parallel.cp (2·3 = 6)");
  expect_layout_error(
      plan("training: {global_batch: 8, micro_batch: 4}\n"), 4,
      "training.global_batch (8) must be divisible by parallel.dp·training.micro_batch (4·4 = 16)");
  expect_layout_error(
      plan("parallel: {tp: 4}\n"), 6,
      "world size (6) must be divisible by parallel.tp·cp·pp (4·1·1 = 4) for parallel.dp: auto");
}

TEST(World, SlurmHostList) {
  EXPECT_EQ(first_slurm_host("node[3-5,7]"), "node3");
  EXPECT_EQ(first_slurm_host("a1,b2"), "a1");
  EXPECT_EQ(first_slurm_host("gpu[010-012]-ib,cpu1"), "gpu010-ib");
  EXPECT_EQ(first_slurm_host("n1"), "n1");
}

// Every variable discover_world() reads: cleared before and after the test.
void clear_world_env() {
  for (const char* k : {"RANK",
                        "WORLD_SIZE",
                        "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                        "SLURM_PROCID",
                        "SLURM_NTASKS",
                        "SLURM_LOCALID",
                        "SLURM_JOB_NODELIST",
                        "SLURM_NTASKS_PER_NODE",
                        "SLURM_STEP_TASKS_PER_NODE",
                        "SLURM_TASKS_PER_NODE",
                        "SLURM_NODEID",
                        "SLURM_JOB_ID",
                        "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK",
                        "OMPI_COMM_WORLD_LOCAL_SIZE",
                        "TESSEL_RESTART_COUNT"})
    unsetenv(k);
}

TEST(World, DiscoveryPrefersTorchrunThenSlurmThenOpenMpi) {
  clear_world_env();
  EXPECT_EQ(discover_world().world, 1);
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  auto w = discover_world();
  EXPECT_EQ(w.source, "Open MPI");
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.master_addr, "127.0.0.1");
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NTASKS_PER_NODE", "2(x2)", 1);
  setenv("SLURM_JOB_NODELIST", "n[7-8]", 1);
  w = discover_world();
  EXPECT_EQ(w.source, "Slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.local_world, 2);
  EXPECT_EQ(w.master_addr, "n7");
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "1234", 1);
  w = discover_world();
  EXPECT_EQ(w.source, "torchrun-style environment");
  EXPECT_EQ(w.master_port, 1234);
  setenv("RANK", "2", 1);
  EXPECT_THROW(discover_world(), plan::UserError);  // rank 2 of 2
  clear_world_env();
}

// The local world from every form Slurm gives it: `srun -N2 -n16 --gpus-per-task=1` sets no
// SLURM_NTASKS_PER_NODE, only SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("8(x2)"), and
// nodes may hold different counts ("3,1": SLURM_NODEID picks this node's).
TEST(World, SlurmTaskCountsInEveryForm) {
  EXPECT_EQ(slurm_tasks_per_node("8(x2)", "V"), (std::vector<int>{8, 8}));
  EXPECT_EQ(slurm_tasks_per_node("2(x3),1", "V"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(slurm_tasks_per_node("4,3,4", "V"), (std::vector<int>{4, 3, 4}));
  EXPECT_EQ(slurm_tasks_per_node("16", "V"), (std::vector<int>{16}));
  for (const char* bad : {"", "x", "2(x", "2(x0)", "0", "2;3", "2(x2)3"})
    EXPECT_THROW(slurm_tasks_per_node(bad, "SLURM_TASKS_PER_NODE"), plan::UserError) << bad;
  try {
    slurm_tasks_per_node("2(x", "SLURM_TASKS_PER_NODE");
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("SLURM_TASKS_PER_NODE='2(x'"), std::string::npos)
        << e.what();
  }

  clear_world_env();
  setenv("SLURM_PROCID", "9", 1);
  setenv("SLURM_NTASKS", "16", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NODEID", "1", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)", 1);
  setenv("SLURM_TASKS_PER_NODE", "8(x2)", 1);
  auto w = discover_world();
  EXPECT_EQ(w.local_world, 8);
  EXPECT_EQ(w.local_rank, 1);
  unsetenv("SLURM_STEP_TASKS_PER_NODE");  // the job's count alone
  EXPECT_EQ(discover_world().local_world, 8);
  // Heterogeneous nodes: 3 tasks on node 0, 1 on node 1.
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_LOCALID", "2", 1);
  setenv("SLURM_NODEID", "0", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "3,1", 1);
  EXPECT_EQ(discover_world().local_world, 3);
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_LOCALID", "0", 1);
  setenv("SLURM_NODEID", "1", 1);
  EXPECT_EQ(discover_world().local_world, 1);
  setenv("SLURM_NODEID", "2", 1);
  EXPECT_THROW(discover_world(), plan::UserError);  // no third node
  unsetenv("SLURM_NODEID");
  EXPECT_THROW(discover_world(), plan::UserError);  // which node's count? not knowable
  // --ntasks-per-node given: the step's own count still wins.
  setenv("SLURM_NODEID", "0", 1);
  setenv("SLURM_NTASKS_PER_NODE", "2", 1);
  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_LOCALID", "2", 1);
  EXPECT_EQ(discover_world().local_world, 3);
  clear_world_env();
}

// The CUDA device of a process, from what Slurm or the user left visible to it.
TEST(Device, OneVisibleDeviceEachIsDeviceZero) {
  clear_world_env();
  // srun --ntasks-per-node=4 --gpus-per-task=1: task 3 sees only its own GPU (Slurm sets
  // CUDA_VISIBLE_DEVICES to one entry), so it is cuda:0, not cuda:3.
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "3", 1);
  setenv("SLURM_NTASKS_PER_NODE", "4", 1);
  setenv("SLURM_JOB_NODELIST", "n1", 1);
  setenv("CUDA_VISIBLE_DEVICES", "3", 1);
  auto w = discover_world();
  auto d =
      plan::choose_cuda_device(1, w.local_rank, w.local_world, std::getenv("CUDA_VISIBLE_DEVICES"));
  EXPECT_EQ(d.index, 0);
  EXPECT_NE(d.why.find("CUDA_VISIBLE_DEVICES=3"), std::string::npos) << d.why;
  // Every GPU visible to every task: the local rank's.
  setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3", 1);
  d = plan::choose_cuda_device(4, w.local_rank, w.local_world, std::getenv("CUDA_VISIBLE_DEVICES"));
  EXPECT_EQ(d.index, 3);
  d = plan::choose_cuda_device(8, w.local_rank, w.local_world, nullptr);
  EXPECT_EQ(d.index, 3);
  // Two devices for four processes: they would share; the message names both counts.
  try {
    plan::choose_cuda_device(2, w.local_rank, w.local_world, "0,1");
    ADD_FAILURE() << "2 devices for 4 local processes was accepted";
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("4 processes"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sees 2 CUDA devices"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan::choose_cuda_device(0, 0, 1, ""), plan::UserError);
  unsetenv("CUDA_VISIBLE_DEVICES");
  clear_world_env();
}

}  // namespace
}  // namespace tessel::parallel
