// main() of tessel-dist-tests: one process per rank under tessel-launch; the tests share one mesh
// whose tensor-parallel group spans the whole world, and a second whose context-parallel group
// spans it with hybrid's split (all-to-all over pairs of ranks, ring across the pairs).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "core/device/cpu.h"
#include "parallel/mesh.h"
#include "tests/dist/dist_env.h"

namespace tessel::parallel {
namespace {
std::unique_ptr<Mesh> g_mesh, g_cp_mesh;
}  // namespace
Group& test_group() { return g_mesh->group(GroupKind::kTp); }
Group& test_hybrid_group() { return g_cp_mesh->group(GroupKind::kCp); }
}  // namespace tessel::parallel

int main(int argc, char** argv) {
  tessel::device::reproducible_cpu_blas();
  ::testing::InitGoogleTest(&argc, argv);
  auto world = tessel::parallel::discover_world();
  auto c = tessel::plan::load_config_text(
      "data: {path: none}\nmodel: {heads: 4}\ntraining: {global_batch: 1, micro_batch: 1, device: "
      "cpu}\n"
      "parallel: {timeout_s: 60, tp: " +
          std::to_string(world.world) + "}\n",
      "collectives_test");
  tessel::parallel::g_mesh = tessel::parallel::Mesh::create(c, world, torch::kCPU);
  auto cp = tessel::plan::load_config_text(
      "data: {path: none}\nmodel: {heads: 4, max_seq_len: 16}\ntraining: {global_batch: 1, "
      "micro_batch: 1, seq_len: 16, device: cpu}\nparallel: {timeout_s: 60, cp: " +
          std::to_string(world.world) + ", context: {method: hybrid, alltoall_size: 2}}\n",
      "collectives_test");
  tessel::parallel::g_cp_mesh = tessel::parallel::Mesh::create(
      cp, world, torch::kCPU,
      c10::make_intrusive<c10d::PrefixStore>(
          "hybrid",
          c10::intrusive_ptr<c10d::Store>::reclaim_copy(tessel::parallel::g_mesh->store())));
  int rc = RUN_ALL_TESTS();
  tessel::parallel::g_mesh->world_group().barrier();
  tessel::parallel::g_cp_mesh.reset();
  tessel::parallel::g_mesh.reset();
  return rc;
}
