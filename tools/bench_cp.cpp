// tessel-bench-cp: context-parallel attention alone, forward + backward, over the world group as
// the cp group, beside dense causal attention on the whole sequence in one process. Prints per
// method the median time, the bytes this rank moved (collective payloads and p2p sends, from the
// group's counters) and the theory for them. Run it under tessel-launch:
//   tessel-launch --nproc-per-node 2 -- build/bin/tessel-bench-cp --seq 1024
#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "core/device/cuda.h"
#include "core/plan/config.h"
#include "parallel/cp/attention.h"
#include "parallel/mesh.h"

namespace {

namespace cp = tessel::parallel::cp;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per forward + backward of `fn` (median of `iters` after one warm-up).
template <typename F>
double time_fwd_bwd(F fn, const std::vector<torch::Tensor>& inputs, const torch::Tensor& w,
                    int iters) {
  std::vector<double> t;
  for (int i = 0; i <= iters; ++i) {
    for (auto x : inputs) x.mutable_grad() = torch::Tensor();
    const auto t0 = std::chrono::steady_clock::now();
    (fn() * w).sum().backward();
    if (inputs[0].is_cuda()) torch::cuda::synchronize(inputs[0].device().index());
    if (i > 0)
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

struct Args {
  int64_t seq = 1024, batch = 1, heads = 8, kv_heads = 4, head_dim = 32;
  int iters = 5;
};

// The whole sequence's q, k, v, and w, the weights that turn the attention output into a loss.
struct Inputs {
  torch::Tensor q, k, v, w;
};

Inputs random_inputs(const Args& a, const torch::Device& dev) {
  torch::manual_seed(3);
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
  Inputs in;
  in.q = torch::randn({a.batch, a.heads, a.seq, a.head_dim}, opts);
  in.k = torch::randn({a.batch, a.kv_heads, a.seq, a.head_dim}, opts);
  in.v = torch::randn({a.batch, a.kv_heads, a.seq, a.head_dim}, opts);
  in.w = torch::randn({a.batch, a.heads, a.seq, a.head_dim}, opts);
  return in;
}

// Whether hybrid runs too: all-to-all over pairs, ring across at least two pairs.
bool hybrid_ranks(const Args& a, int64_t n) { return n >= 4 && n % 2 == 0 && a.heads % 2 == 0; }

// A plan whose only layout is context parallelism over every process (split for hybrid when it
// runs).
tessel::plan::Config cp_config(const Args& a, bool cuda, int64_t n) {
  return tessel::plan::load_config_text(
      fmt::format("data: {{path: none}}\nmodel: {{heads: 4, max_seq_len: {}}}\n"
                  "training: {{global_batch: 1, micro_batch: 1, device: {}, seq_len: {}}}\n"
                  "parallel: {{cp: {}, dp: 1, context: {{method: {}, alltoall_size: 2}}}}\n",
                  a.seq, cuda ? "cuda" : "cpu", a.seq, n, hybrid_ranks(a, n) ? "hybrid" : "ring"),
      "tessel-bench-cp");
}

void print_header(const Args& a, int64_t n, const std::string& backend) {
  std::printf(
      "# tessel-bench-cp: %lld ranks (%s), b %lld, seq %lld, heads %lld/%lld, d %lld, "
      "fp32, forward + backward, median of %d\n"
      "| method | cp | ms | collective payload B/rank | p2p sent B/rank | theory B/rank |\n"
      "|---|---|---|---|---|---|\n",
      static_cast<long long>(n), backend.c_str(), static_cast<long long>(a.batch),
      static_cast<long long>(a.seq), static_cast<long long>(a.heads),
      static_cast<long long>(a.kv_heads), static_cast<long long>(a.head_dim), a.iters);
}

// Dense causal attention, one process, the whole sequence.
void bench_dense(const Args& a, const Inputs& in) {
  auto qd = in.q.clone().requires_grad_(), kd = in.k.clone().requires_grad_(),
       vd = in.v.clone().requires_grad_();
  const double s = time_fwd_bwd(
      [&] {
        return at::scaled_dot_product_attention(qd, kd, vd, {}, 0.0, true, std::nullopt,
                                                a.kv_heads != a.heads);
      },
      {qd, kd, vd}, in.w, a.iters);
  std::printf("| dense | 1 | %.2f | 0 | 0 | 0 |\n", s * 1e3);
}

// The bytes one rank moves per forward + backward. `kv_all`: one K or V of the whole sequence,
// bytes; a local block is 1/n of it. allgather: all-gather K and V (payload = the whole gathered
// tensor) and reduce-scatter dK, dV (payload = the whole input); ring: n-1 K/V blocks forward,
// n-1 K/V blocks and n dK/dV blocks backward, each block 2·kv_all/n; alltoall: forward sends this
// rank's q, k, v (key/value heads repeated to a multiple of n) and the output, backward their
// gradients: 2·(2·q + 2·kv carried)/n, q_all being one Q of the whole sequence.
double theory_bytes(tessel::plan::CpMethod method, int64_t n, double q_all, double kv_all,
                    const Args& a) {
  const double ranks = static_cast<double>(n);
  if (method == tessel::plan::CpMethod::kAllGather) return 4 * kv_all;
  if (method == tessel::plan::CpMethod::kRing) return (3.0 * ranks - 2) * 2 * kv_all / ranks;
  const int64_t group =
      method == tessel::plan::CpMethod::kHybrid ? 2 : n;  // ranks of one all-to-all
  const double repeat = static_cast<double>(cp::alltoall_kv_heads(a.kv_heads, group)) /
                        static_cast<double>(a.kv_heads);
  const double exchanged = 2 * (2 * q_all + 2 * kv_all * repeat) / ranks;
  if (method == tessel::plan::CpMethod::kAllToAll) return exchanged;
  // hybrid: plus ring's blocks (the pair's tokens of its heads) across the pairs
  const double ring = ranks / static_cast<double>(group);
  return exchanged + (3 * ring - 2) * 2 * kv_all * repeat / ranks;
}

// The plan's name of the method; hybrid as this benchmark runs it (all-to-all pairs).
const char* method_name(tessel::plan::CpMethod m) {
  return m == tessel::plan::CpMethod::kHybrid ? "hybrid (pairs)" : tessel::plan::name_of(m).c_str();
}

// One cp method over `g` (n ranks): time and bytes from the group's counters; rank 0 prints.
void bench_method(const Args& a, tessel::parallel::Group& g, tessel::plan::CpMethod method,
                  const Inputs& in, int64_t n, bool print) {
  auto local = [&](const torch::Tensor& t) {
    return cp::local_chunks(t, 2, n, g.rank()).contiguous().requires_grad_();
  };
  auto ql = local(in.q), kl = local(in.k), vl = local(in.v);
  auto wl = cp::local_chunks(in.w, 2, n, g.rank()).contiguous();
  const int64_t bytes0 = g.bytes(), sent0 = g.sent_bytes();
  const double s =
      time_fwd_bwd([&] { return cp::attention(g, method, ql, kl, vl); }, {ql, kl, vl}, wl, a.iters);
  const double runs = a.iters + 1;
  const double coll = static_cast<double>(g.bytes() - bytes0) / runs,
               sent = static_cast<double>(g.sent_bytes() - sent0) / runs;
  const double kv_all = static_cast<double>(a.batch * a.kv_heads * a.seq * a.head_dim * 4);
  const double q_all = kv_all * static_cast<double>(a.heads) / static_cast<double>(a.kv_heads);
  if (print)
    std::printf("| %s | %lld | %.2f | %.0f | %.0f | %.0f |\n", method_name(method),
                static_cast<long long>(n), s * 1e3, coll, sent,
                theory_bytes(method, n, q_all, kv_all, a));
}

void bench(const Args& a) {
  const auto world = tessel::parallel::discover_world();
  const bool cuda = tessel::device::cuda_available();
  const torch::Device dev =
      cuda ? torch::Device(torch::kCUDA, static_cast<int8_t>(world.local_rank)) : torch::kCPU;
  if (cuda) c10::cuda::set_device(dev.index());  // before any CUDA or NCCL work
  const int64_t n = world.world;
  if (a.seq % (2 * n) != 0 || a.heads % a.kv_heads != 0)
    throw std::invalid_argument(fmt::format(
        "--seq ({}) must be divisible by 2·ranks ({}) and --heads ({}) by --kv-heads ({})", a.seq,
        2 * n, a.heads, a.kv_heads));
  const tessel::plan::Config c = cp_config(a, cuda, n);
  auto mesh = tessel::parallel::Mesh::create(c, world, dev);
  auto& g = mesh->group(tessel::parallel::GroupKind::kCp);
  const Inputs in = random_inputs(a, dev);
  if (world.rank == 0) {
    print_header(a, n, tessel::plan::name_of(mesh->backend()));
    bench_dense(a, in);
  }
  for (auto method : {tessel::plan::CpMethod::kAllGather, tessel::plan::CpMethod::kRing,
                      tessel::plan::CpMethod::kAllToAll, tessel::plan::CpMethod::kHybrid}) {
    if (method == tessel::plan::CpMethod::kAllToAll && a.heads % n != 0)
      continue;  // heads must split
    if (method == tessel::plan::CpMethod::kHybrid && !hybrid_ranks(a, n)) continue;
    bench_method(a, g, method, in, n, world.rank == 0);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tessel-bench-cp: context-parallel attention time and bytes (run under tessel-launch)",
      "tessel-bench-cp"};
  Args a;
  app.add_option("--seq", a.seq, "Tokens per sequence (whole, over every cp rank)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", a.batch, "Sequences")->check(CLI::PositiveNumber);
  app.add_option("--heads", a.heads, "Query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", a.kv_heads, "Key/value heads")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", a.head_dim, "Head dimension")->check(CLI::PositiveNumber);
  app.add_option("--iters", a.iters, "Timed iterations")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    bench(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-bench-cp: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
