// tessel-bench-comm: an nccl-tests-style table (size, time, algbw, busbw) for each collective over
// the world group, on Gloo (CPU) or NCCL (CUDA). Run it under tessel-launch:
//   tessel-launch --nproc-per-node 4 -- build/bin/tessel-bench-comm --backend gloo
#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>

#include "core/device/cuda.h"
#include "core/plan/config.h"
#include "parallel/mesh.h"

namespace {

using tessel::parallel::Group;

// nccl-tests: busbw = algbw × factor, the fraction of the data each rank must move.
double bus_factor(const std::string& op, int64_t n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;  // all_gather, reduce_scatter, all_to_all
}

double time_op(Group& g, const std::string& op, int64_t elems, int iters, int warmup,
               const torch::Device& dev) {
  const int64_t n = g.size();
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
  // nccl-tests sizes: the per-rank message for all_reduce/broadcast, the full buffer for the rest.
  auto small = torch::ones({std::max<int64_t>(1, elems / n)}, opts);
  auto big = torch::ones({std::max<int64_t>(1, elems / n) * n}, opts);
  auto whole = torch::ones({elems}, opts);
  auto big_out = torch::empty_like(big);  // all_to_all: input and output are distinct buffers
  auto once = [&] {
    tessel::parallel::Work w;
    if (op == "all_reduce")
      w = g.all_reduce(whole);
    else if (op == "broadcast")
      w = g.broadcast(whole, 0);
    else if (op == "all_gather")
      w = g.all_gather(big, small);
    else if (op == "reduce_scatter")
      w = g.reduce_scatter(small, big);
    else
      w = g.all_to_all(big_out, big);
    w.wait();
  };
  for (int i = 0; i < warmup; ++i) once();
  if (dev.is_cuda()) torch::cuda::synchronize(dev.index());  // this rank's device
  g.barrier();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) once();
  if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

struct Args {
  std::string backend_arg = "auto", ops = "all";  // --backend, --ops
  int64_t min_bytes = 1 << 10, max_bytes = 64 << 20;
  int iters = 20, warmup = 5;
};

// One collective's table, sizes doubling from --min-bytes to --max-bytes; rank 0 prints.
void bench_op(const Args& a, Group& g, const std::string& op, const torch::Device& dev,
              bool print) {
  if (print)
    std::printf("#\n# %s\n# %12s %12s %12s %12s %12s\n", op.c_str(), "size(B)", "count", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)");
  for (int64_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= 2) {
    const int64_t elems = std::max<int64_t>(1, bytes / 4);
    const double s = time_op(g, op, elems, a.iters, a.warmup, dev);
    const double algbw = static_cast<double>(elems * 4) / s / 1e9;
    if (print)
      std::printf("  %12lld %12lld %12.1f %12.3f %12.3f\n", static_cast<long long>(elems * 4),
                  static_cast<long long>(elems), s * 1e6, algbw, algbw * bus_factor(op, g.size()));
  }
}

void bench(const Args& a) {
  const auto world = tessel::parallel::discover_world();
  const bool cuda =
      a.backend_arg == "nccl" || (a.backend_arg == "auto" && tessel::device::cuda_available());
  const torch::Device dev =
      cuda ? torch::Device(torch::kCUDA, static_cast<int8_t>(world.local_rank)) : torch::kCPU;
  if (cuda) c10::cuda::set_device(dev.index());  // before any CUDA or NCCL work
  // A plan of defaults whose only layout is data parallelism over every process.
  tessel::plan::Config c = tessel::plan::load_config_text(
      fmt::format(
          "data: {{path: none}}\ntraining: {{global_batch: {}, micro_batch: 1, device: {}}}\n"
          "parallel: {{backend: {}}}\n",
          world.world, cuda ? "cuda" : "cpu", a.backend_arg),
      "tessel-bench-comm");
  auto mesh = tessel::parallel::Mesh::create(c, world, dev);
  auto& g = mesh->world_group();
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                  "all_to_all"};
  if (a.ops != "all") ops = {a.ops};
  if (world.rank == 0)
    std::printf("# tessel-bench-comm: %d ranks, %s, float32, %d iterations after %d warm-up\n",
                world.world, tessel::plan::name_of(mesh->backend()).c_str(), a.iters, a.warmup);
  for (const auto& op : ops) bench_op(a, g, op, dev, world.rank == 0);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tessel-bench-comm: collective bandwidth over the world group (run under tessel-launch)",
      "tessel-bench-comm"};
  Args a;
  app.add_option("--backend", a.backend_arg, "gloo, nccl, or auto (nccl when CUDA is available)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--ops", a.ops,
                 "all, or one of all_reduce, all_gather, reduce_scatter, broadcast, all_to_all");
  app.add_option("--min-bytes", a.min_bytes, "Smallest message")->check(CLI::PositiveNumber);
  app.add_option("--max-bytes", a.max_bytes, "Largest message (sizes double)")
      ->check(CLI::PositiveNumber);
  app.add_option("--iters", a.iters, "Timed iterations per size")->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "Untimed iterations per size")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    bench(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-bench-comm: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
