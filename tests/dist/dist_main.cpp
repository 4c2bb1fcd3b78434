// main() of tessel-dist-tests: one process per rank under tessel-launch; the tests share one mesh
// whose tensor-parallel group spans the whole world.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "parallel/mesh.h"
#include "tests/dist/dist_env.h"

namespace tessel::parallel {
namespace {
std::unique_ptr<Mesh> g_mesh;
}  // namespace
Group& test_group() { return g_mesh->group(GroupKind::kTp); }
}  // namespace tessel::parallel

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = tessel::parallel::discover_world();
  auto c = tessel::load_config_text(
      "data: {path: none}\nmodel: {heads: 4}\ntraining: {global_batch: 1, micro_batch: 1, device: "
      "cpu}\n"
      "parallel: {timeout_s: 60, tp: " +
          std::to_string(world.world) + "}\n",
      "collectives_test");
  tessel::parallel::g_mesh = tessel::parallel::Mesh::create(c, world, torch::kCPU);
  int rc = RUN_ALL_TESTS();
  tessel::parallel::g_mesh->world_group().barrier();
  tessel::parallel::g_mesh.reset();
  return rc;
}
