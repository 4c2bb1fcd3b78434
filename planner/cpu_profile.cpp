#include "planner/cpu_profile.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#include "parallel/comm.h"
#include "planner/model_plan.h"

namespace tessel {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The median of `tries` runs of `f` after a warm-up of at least 0.1 s: a warm kernel's time as a
// step's median meets it (a cold process's first runs fault in pages and start the thread pool;
// on a shared machine the best run would be faster than a step's typical one).
template <class F>
double median_seconds(F&& f, int tries, bool warm) {
  if (warm)
    for (const auto t0 = Clock::now(); seconds_since(t0) < 0.1;) f();
  std::vector<double> t;
  for (int i = 0; i < tries; ++i) {
    const auto t0 = Clock::now();
    f();
    t.push_back(seconds_since(t0));
  }
  std::nth_element(t.begin(), t.begin() + tries / 2, t.end());
  return t[static_cast<size_t>(tries / 2)];
}

// Restores LibTorch's intra-op threads when the measurement is done.
struct ThreadsFor {
  explicit ThreadsFor(int64_t n) : was(at::get_num_threads()) {
    at::set_num_threads(static_cast<int>(n));
  }
  ~ThreadsFor() { at::set_num_threads(was); }
  int was;
};

// The rate of the plan's own matmuls: one linear layer's three (forward [T, h] x [h, f], the
// input gradient [T, f] x [f, h], the weight gradient [f, T] x [T, h]) over a micro-batch's T
// tokens on this rank, h the hidden size and f the MLP's width on this rank; skinny shapes run
// below a square matmul's rate, and these are the shapes a step runs.
double matmul_tflops(const Config& c, const models::ModelShape& m, torch::ScalarType dtype,
                     bool warm) {
  const auto opts = torch::TensorOptions().dtype(dtype);
  const int64_t t = std::max<int64_t>(
      1, c.training.micro_batch * c.training.seq_len / std::max<int64_t>(1, c.parallel.cp));
  const int64_t h = m.hidden,
                f = std::max<int64_t>(1, m.ffn_hidden / std::max<int64_t>(1, c.parallel.tp));
  auto x = torch::randn({t, h}, opts), w = torch::randn({h, f}, opts),
       g = torch::randn({t, f}, opts);
  auto wt = w.t().contiguous(), gt = g.t().contiguous();
  auto three = [&] {
    torch::mm(x, w);
    torch::mm(g, wt);
    torch::mm(gt, x);
  };
  return 3 * 2.0 * static_cast<double>(t * h * f) / median_seconds(three, 5, warm) / 1e12;
}

// SDPA's CPU kernels forward and backward (no autograd: the operators' host cost is op_us's) at
// the plan's heads on one tp rank, head size and sequence (at most 2,048 tokens), in the FLOPs the
// planner counts for attention: 12·H·Q·T per token.
double attention_tflops(const Config& c, const models::ModelShape& m, torch::ScalarType dtype,
                        bool warm) {
  const int64_t t = std::min<int64_t>(c.training.seq_len, 2048);
  const int64_t b = std::max<int64_t>(1, std::min<int64_t>(c.training.micro_batch, 4096 / t));
  const int64_t h = std::max<int64_t>(1, m.heads / c.parallel.tp), q = m.head_dim();
  const auto opts = torch::TensorOptions().dtype(dtype);
  auto qq = torch::randn({b, h, t, q}, opts), k = torch::randn({b, h, t, q}, opts),
       v = torch::randn({b, h, t, q}, opts), g = torch::randn({b, h, t, q}, opts);
  const double s = median_seconds(
      [&] {
        auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(qq, k, v, 0.0, true);
        at::_scaled_dot_product_flash_attention_for_cpu_backward(g, qq, k, v, o, lse, 0.0, true);
      },
      5, warm);
  return 12.0 * static_cast<double>(h * q * t) * static_cast<double>(b * t) / s / 1e12;
}

// The MLP's activation kernels forward and backward (tanh-GELU for gpt2; SiLU of the gate times
// the up projection for llama), nanoseconds per element of one [tokens, ffn] input.
double activation_ns(const Config& c, const models::ModelShape& m, torch::ScalarType dtype,
                     bool warm) {
  const int64_t ffn = std::max<int64_t>(1, m.ffn_hidden / c.parallel.tp);
  const int64_t rows = std::max<int64_t>(
      1, std::min<int64_t>(c.training.micro_batch * c.training.seq_len, (int64_t{4} << 20) / ffn));
  const auto opts = torch::TensorOptions().dtype(dtype);
  auto x = torch::randn({rows, ffn}, opts), gate = torch::randn({rows, ffn}, opts),
       g = torch::randn({rows, ffn}, opts);
  const bool llama = m.arch == "llama";
  const double s = median_seconds(
      [&] {
        if (!llama) {
          at::gelu_backward(g, x, "tanh"), at::gelu(x, "tanh");
          return;
        }
        auto act = at::silu(gate);
        auto y = act * x, dx = g * act;
        at::silu_backward(g * x, gate);
      },
      5, warm);
  return s / static_cast<double>(rows * ffn) * 1e9;
}

// One small operator's forward and backward: what the host spends per operator, whatever its size.
double op_us(bool warm) {
  auto x = torch::randn({8, 32}, torch::TensorOptions().requires_grad(true));
  const double s = median_seconds(
      [&] {
        auto y = x;
        for (int i = 0; i < 50; ++i) y = y * 1.01 + 0.1;
        y.sum().backward();
      },
      5, warm);
  return s / 100 * 1e6;
}

double add_gbps(bool warm) {
  auto a = torch::randn({int64_t{4} << 20}), b = torch::randn({int64_t{4} << 20});
  auto out = torch::empty_like(a);
  const double s = median_seconds([&] { at::add_out(out, a, b); }, 5, warm);
  return 3.0 * static_cast<double>(a.nbytes()) / s / 1e9;
}

struct Loopback {
  double latency_s = 0;                        // one collective's cost inside a step
  double all_reduce = 0, gather = 0, p2p = 0;  // GB/s of wire bytes
};

// Two Gloo ranks of this process over loopback. Bandwidth: all-reduce, all-gather and
// send/receive of 4 MiB on idle ranks, rank 0's median of five, by the bytes each rank puts on its
// link (planner.cpp's Traffic::wire), which for two ranks is the buffer for all three. Then as a
// step meets them: all-reduces of 64 KiB and 1 MiB, each after a few milliseconds of
// single-threaded compute on both ranks, the mean of 20 (compute plus all-reduce) less the mean
// of 20 compute alone. On a machine whose cores all compute, the Gloo threads' wake-up and the
// ranks' skew cost several times what idle ranks show, and vary widely, so the mean is what a
// step's many collectives add up to.
// `f`'s time over `n` runs after two: their median, or their mean.
double timed(const std::function<void()>& f, int n, bool median) {
  f(), f();
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    f();
    t.push_back(seconds_since(t0));
  }
  if (!median) return std::accumulate(t.begin(), t.end(), 0.0) / n;
  std::nth_element(t.begin(), t.begin() + n / 2, t.end());
  return t[static_cast<size_t>(n / 2)];
}

Loopback loopback_gloo() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Loopback out;
  std::exception_ptr failed;
  auto rank_main = [&](int rank) {
    try {
      auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      parallel::Group g("loopback", {0, 1}, rank,
                        c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, opts));
      auto x = torch::ones({int64_t{1} << 20}), y = torch::empty_like(x);
      auto both = torch::empty({2 * x.numel()});
      const double wire = static_cast<double>(x.nbytes()) / 1e9;
      const double ar = timed([&] { g.all_reduce(x).wait(); }, 5, true);
      const double ag = timed([&] { g.all_gather(both, x).wait(); }, 5, true);
      const double p2p = timed(
          [&] {
            for (auto& w : g.send_recv({{parallel::P2POp::kSend, x, 1 - rank, 0},
                                        {parallel::P2POp::kRecv, y, 1 - rank, 0}}))
              w.wait();
          },
          5, true);
      auto a = torch::randn({512, 512}), b = torch::randn({512, 512});
      auto small = torch::ones({int64_t{16} << 10}), large = torch::ones({int64_t{256} << 10});
      const double compute = timed([&] { torch::mm(a, b); }, 20, false);
      const double with_small =
          timed([&] { torch::mm(a, b), g.all_reduce(small).wait(); }, 20, false) - compute;
      const double with_large =
          timed([&] { torch::mm(a, b), g.all_reduce(large).wait(); }, 20, false) - compute;
      if (rank != 0) return;
      // Loaded all-reduce: latency and bandwidth through the two sizes (the bandwidth at most the
      // idle one, the latency at least 0); all-gather and send/receive slowed alike.
      const double wires = static_cast<double>(small.nbytes()) / 1e9,
                   wirel = static_cast<double>(large.nbytes()) / 1e9;
      const double gbps =
          std::min(wire / ar, (wirel - wires) / std::max(with_large - with_small, 1e-9));
      const double slow = gbps / (wire / ar);
      out = {std::max(0.0, with_small - wires / gbps), gbps, slow * wire / ag, slow * wire / p2p};
    } catch (...) {
      failed = std::current_exception();
    }
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  if (failed) std::rethrow_exception(failed);
  return out;
}

// Rounds of every rate (matmul TFLOP/s, attention TFLOP/s, activation ns, add GB/s, operator us),
// the first after warm-ups.
void measure_rounds(const Config& c, const models::ModelShape& m, torch::ScalarType dtype,
                    std::vector<std::array<double, 5>>& rounds) {
  for (size_t i = 0; i < rounds.size(); ++i) {
    const bool warm = i == 0;
    rounds[i] = {matmul_tflops(c, m, dtype, warm), attention_tflops(c, m, dtype, warm),
                 activation_ns(c, m, dtype, warm), add_gbps(warm), op_us(warm)};
  }
}

}  // namespace

int64_t cpu_threads_per_rank(const Config& c, int64_t ranks_on_node) {
  if (c.training.threads > 0) return c.training.threads;
  if (const char* omp = std::getenv("OMP_NUM_THREADS"))  // tessel-launch leaves it as it is
    if (const int64_t n = std::atoll(omp); n > 0) return n;
  return ranks_on_node > 1 ? 1 : at::get_num_threads();
}

DeviceProfile measure_cpu_profile(const Config& c, int64_t ranks_on_node) {
  const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  const int64_t threads = cpu_threads_per_rank(c, ranks_on_node);
  const auto m = model_shape(c.model);
  const auto dtype = resolve_dtype(c.training.dtype);
  DeviceProfile d;
  d.name = "cpu";
  d.cpu = true;
  d.threads = threads;
  d.efficiency = 1.0;  // the rate is measured on the plan's own matmul shapes
  {
    // Each of the node's ranks computes at once (one thread each here, as under tessel-launch;
    // one rank computes on its threads): rank 0's rates, the median of three interleaved rounds,
    // so that a shared machine's drift over the second they take evens out.
    const int64_t ranks = threads == 1 ? std::min(std::max<int64_t>(1, ranks_on_node), cores) : 1;
    ThreadsFor scope(std::min(threads, cores));
    std::vector<std::array<double, 5>> rounds(3);
    std::vector<std::thread> others;
    for (int64_t r = 1; r < ranks; ++r)
      others.emplace_back([&] {
        std::vector<std::array<double, 5>> mine(3);
        measure_rounds(c, m, dtype, mine);
      });
    measure_rounds(c, m, dtype, rounds);
    for (auto& t : others) t.join();
    std::array<double, 5> med{};
    for (size_t k = 0; k < med.size(); ++k) {
      std::vector<double> v;
      for (const auto& r : rounds) v.push_back(r[k]);
      std::nth_element(v.begin(), v.begin() + 1, v.end());
      med[k] = v[1];
    }
    d.peak_tflops = d.fp32_tflops = med[0];
    d.attention_tflops = med[1], d.activation_ns = med[2], d.memory_gbps = med[3];
    d.op_us = med[4];
  }
  // More threads wanted than there are cores: the node's ranks share them.
  const double share = std::min(
      1.0, static_cast<double>(cores) /
               static_cast<double>(std::max<int64_t>(1, ranks_on_node) * std::min(threads, cores)));
  d.peak_tflops *= share, d.fp32_tflops *= share, d.attention_tflops *= share;
  d.activation_ns /= share, d.op_us /= share, d.memory_gbps *= share;
  d.gpus_per_node = std::max<int64_t>(1, ranks_on_node);
  d.memory_gib = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                 static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024 * 1024) /
                 static_cast<double>(d.gpus_per_node);
  if (ranks_on_node > 1) {
    ThreadsFor scope(1);  // each rank's thread computes on its own, as ranks under tessel-launch
    const auto link = loopback_gloo();
    d.intra_node_gbps = d.inter_node_gbps = link.all_reduce;
    d.gather_gbps = link.gather;
    d.p2p_gbps = link.p2p;
    d.latency_us = 1e6 * link.latency_s;
  } else {
    d.intra_node_gbps = d.inter_node_gbps = d.memory_gbps;  // no link: nothing crosses one
  }
  return d;
}

}  // namespace tessel
