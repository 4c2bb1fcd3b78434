#include "engine/planner/cpu_profile.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>
#include <vector>

#include "core/kernels/activation_kernels.h"
#include "core/kernels/activations.h"
#include "core/kernels/attention_cpu.h"
#include "core/observe/counters.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/comm.h"

namespace tessel::planner {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Restores LibTorch's intra-op threads when the measurement is done.
struct ThreadsFor {
  explicit ThreadsFor(int64_t n) : was(at::get_num_threads()) {
    at::set_num_threads(static_cast<int>(n));
  }
  ~ThreadsFor() { at::set_num_threads(was); }
  int was;
};

// The kernels a step runs, at the plan's shapes on one rank, each run as a step meets it: one
// after another (not one kernel again and again, whose thread pool and caches stay warm for it)
// and on the next of several operand sets (up to 64 MiB in all: a step's kernels read operands
// that other kernels wrote long before). Measured on the 2-core Xeon: kernels in a step run
// 10-50% slower than each one repeated on one set.
class StepKernels {
 public:
  StepKernels(const plan::Config& c, const models::ModelShape& m, torch::ScalarType dtype)
      : parts_(models::features(m)),
        own_kernels_(c.training.kernels == plan::Kernels::kTessel && dtype == torch::kFloat32),
        short_attention_(own_kernels_ && c.parallel.cp <= 1 &&
                         kernels::short_attention_applies(torch::kCPU, dtype, c.training.seq_len)) {
    const auto opts = torch::TensorOptions().dtype(dtype);
    const int64_t tp = std::max<int64_t>(1, c.parallel.tp),
                  cp = std::max<int64_t>(1, c.parallel.cp);
    // Matmuls: one linear layer's three as autograd runs them (forward x [T, h] times w [f, h]
    // transposed, the input gradient g [T, f] times w, the weight gradient g transposed times x)
    // over a micro-batch's T tokens, h the hidden size and f the MLP's width on this rank.
    t_ = std::max<int64_t>(1, c.training.micro_batch * c.training.seq_len / cp);
    h_ = m.hidden, f_ = std::max<int64_t>(1, m.ffn_hidden / tp);
    // Attention: the kernel a step runs (Tessel's short-sequence one or SDPA's flash) at the heads
    // on one tp rank, head size and sequence (at most 2,048 tokens).
    seq_ = std::min<int64_t>(c.training.seq_len, 2048);
    batch_ = std::max<int64_t>(1, std::min<int64_t>(c.training.micro_batch, 4096 / seq_));
    heads_ = std::max<int64_t>(1, m.heads / tp), head_dim_ = m.head_dim();
    // The MLP's activation over [rows, f] (at most 4 Mi elements).
    rows_ = std::max<int64_t>(1, std::min<int64_t>(t_, (int64_t{4} << 20) / f_));
    const int64_t set_elems =
        t_ * h_ + f_ * h_ + t_ * f_ + 4 * batch_ * heads_ * seq_ * head_dim_ + 3 * rows_ * f_;
    const double set_bytes = static_cast<double>(set_elems * torch::elementSize(dtype));
    const auto sets = static_cast<size_t>(std::clamp((64 << 20) / set_bytes, 1.0, 8.0));
    const std::vector<int64_t> bhsd{batch_, heads_, seq_, head_dim_};
    for (size_t i = 0; i < sets; ++i) {
      std::vector<torch::Tensor> v;
      for (auto shape : {std::vector<int64_t>{t_, h_},
                         {f_, h_},
                         {t_, f_},
                         bhsd,
                         bhsd,
                         bhsd,
                         bhsd,
                         {rows_, f_},
                         {rows_, f_},
                         {rows_, f_}})
        v.push_back(torch::randn(shape, opts));
      sets_.push_back(std::move(v));
    }
    add_a_ = torch::randn({int64_t{4} << 20}), add_b_ = torch::randn({int64_t{4} << 20});
    add_out_ = torch::empty_like(add_a_);
    small_ = torch::randn({8, 32}, torch::TensorOptions().requires_grad(true));
    gelu_bias_ = torch::randn({f_}, opts);
  }

  // One run of each, in a step's order; seconds each.
  std::array<double, 5> run() {
    const auto& s = sets_[next_++ % sets_.size()];
    std::array<double, 5> out{};
    out[0] = seconds(
        [&] { torch::mm(s[0], s[1].t()), torch::mm(s[2], s[1]), torch::mm(s[2].t(), s[0]); });
    out[2] = seconds([&] {  // the MLP's activation, as its layer runs it
      models::mlp_form(parts_.mlp).activation_pass(own_kernels_, s[7], s[8], s[9], gelu_bias_);
    });
    out[1] = seconds([&] {
      if (short_attention_) {
        auto [o, saved] = kernels::short_attention_forward(s[3], s[4], s[5], true);
        kernels::short_attention_backward(s[6], saved, true);
        return;
      }
      auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(s[3], s[4], s[5], 0.0, true);
      at::_scaled_dot_product_flash_attention_for_cpu_backward(s[6], s[3], s[4], s[5], o, lse, 0.0,
                                                               true);
    });
    out[3] = seconds([&] { at::add_out(add_out_, add_a_, add_b_); });
    out[4] = seconds([&] {  // small operators' forward and backward: the host's cost of each
      auto y = small_;
      for (int i = 0; i < 50; ++i) y = y * 1.01 + 0.1;
      y.sum().backward();
    });
    return out;
  }

  // The rates from a run's seconds: matmul TFLOP/s, attention TFLOP/s (12·H·Q·T FLOPs per
  // token, as the planner counts), activation ns per element, add GB/s, operator us.
  std::array<double, 5> rates(const std::array<double, 5>& s) const {
    return {6.0 * static_cast<double>(t_ * h_ * f_) / s[0] / 1e12,
            12.0 * static_cast<double>(heads_ * head_dim_ * seq_) *
                static_cast<double>(batch_ * seq_) / s[1] / 1e12,
            s[2] / static_cast<double>(rows_ * f_) * 1e9,
            3.0 * static_cast<double>(add_a_.nbytes()) / s[3] / 1e9, s[4] / 100 * 1e6};
  }

 private:
  template <class F>
  static double seconds(F&& f) {
    const auto t0 = Clock::now();
    f();
    return seconds_since(t0);
  }
  models::DecoderOptions parts_;  // the parts the model builds (its MLP's activation)
  bool own_kernels_;              // training.kernels tessel, fp32: Tessel's CPU kernels run
  bool short_attention_;  // Tessel's short-sequence attention (core/kernels/attention_cpu.h)
  int64_t t_, h_, f_, seq_, batch_, heads_, head_dim_, rows_;
  std::vector<std::vector<torch::Tensor>> sets_;
  size_t next_ = 0;
  torch::Tensor add_a_, add_b_, add_out_, small_, gelu_bias_;
};

struct Loopback {
  double latency_s = 0;                        // one collective's cost inside a step
  double all_reduce = 0, gather = 0, p2p = 0;  // GB/s of wire bytes
};

// Two Gloo ranks of this process over loopback. Bandwidth: all-reduce, all-gather and
// send/receive of 4 MiB on idle ranks, rank 0's median of five, by the bytes each rank puts on its
// link (planner.cpp's Traffic::wire), which for two ranks is the buffer for all three. Then as a
// step meets them: all-reduces of 64 KiB and 1 MiB, each after a few milliseconds of
// single-threaded compute on both ranks, the mean of 30 (compute plus all-reduce) less the mean
// of 30 compute alone, the three kinds of run taking turns. On a machine whose cores all compute,
// the Gloo threads' wake-up and the ranks' skew cost several times what idle ranks show, and vary
// widely, so the mean is what a step's many collectives add up to. `f`'s time over `n` runs after
// two: their median, or their mean.
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
      // Interleaved rounds of the three (compute alone, with the small and with the large
      // all-reduce), so that a shared machine's drift weighs on each alike.
      double compute = 0, with_small = 0, with_large = 0;
      constexpr int kRounds = 30;
      auto once = [](auto&& f) {
        const auto t0 = Clock::now();
        f();
        return seconds_since(t0);
      };
      for (int i = -2; i < kRounds; ++i) {
        const double c = once([&] { torch::mm(a, b); });
        const double s = once([&] { torch::mm(a, b), g.all_reduce(small).wait(); });
        const double l = once([&] { torch::mm(a, b), g.all_reduce(large).wait(); });
        if (i >= 0) compute += c / kRounds, with_small += s / kRounds, with_large += l / kRounds;
      }
      with_small -= compute, with_large -= compute;
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

// The step's kernels' rates (StepKernels::rates): each one's median over the runs of the sequence
// in 0.8 s (at least fifteen) after 0.2 s of warm-up runs (a cold process faults in pages and
// starts its thread pool; on a shared machine the best run would be faster than a step's typical
// one, and a short window catches a passing slowdown: the EPYC VM's matmul rate measured over
// 15 runs ranged 0.07-0.14 TFLOP/s within minutes).
std::array<double, 5> measure_rates(const plan::Config& c, const models::ModelShape& m,
                                    torch::ScalarType dtype) {
  StepKernels k(c, m, dtype);
  for (const auto t0 = Clock::now(); seconds_since(t0) < 0.2;) k.run();
  std::array<std::vector<double>, 5> runs;
  for (const auto t0 = Clock::now(); runs[0].size() < 15 || seconds_since(t0) < 0.8;) {
    const auto s = k.run();
    for (size_t j = 0; j < s.size(); ++j) runs[j].push_back(s[j]);
  }
  std::array<double, 5> med{};
  for (size_t j = 0; j < med.size(); ++j) {
    const auto mid = runs[j].begin() + static_cast<std::ptrdiff_t>(runs[j].size() / 2);
    std::nth_element(runs[j].begin(), mid, runs[j].end());
    med[j] = *mid;
  }
  return k.rates(med);
}

}  // namespace

int64_t cpu_threads_per_rank(const plan::Config& c, int64_t ranks_on_node) {
  if (c.training.threads > 0) return c.training.threads;
  if (const char* omp = std::getenv("OMP_NUM_THREADS"))  // tessel-launch leaves it as it is
    if (const int64_t n = std::atoll(omp); n > 0) return n;
  return ranks_on_node > 1 ? 1 : at::get_num_threads();
}

DeviceProfile measure_cpu_profile(const plan::Config& c, int64_t ranks_on_node) {
#ifdef __GLIBC__
  // A step's allocations come from memory the process already holds: after its first steps a
  // step faults in no pages (0 minor faults per step on the bench's models, 2026-11-26). The
  // kernels here allocate and free the same few outputs, which glibc hands back to the kernel and
  // faults in again on every run (twice the activation's and 40% more of attention's time, as
  // measured on the EPYC VM): keep what is freed, as a step's steady state does.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
  const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  const int64_t threads = cpu_threads_per_rank(c, ranks_on_node);
  const auto m = models::model_shape(c.model);
  const auto dtype = models::resolve_dtype(c.training.dtype);
  DeviceProfile d;
  d.name = "cpu";
  d.cpu = true;
  d.threads = threads;
  d.efficiency = 1.0;  // the rate is measured on the plan's own matmul shapes
  {
    // Each of the node's ranks computes at once (one thread each here, as under tessel-launch;
    // one rank computes on its threads): rank 0's rates.
    const int64_t ranks = threads == 1 ? std::min(std::max<int64_t>(1, ranks_on_node), cores) : 1;
    ThreadsFor scope(std::min(threads, cores));
    std::vector<std::thread> others;
    for (int64_t r = 1; r < ranks; ++r) others.emplace_back([&] { measure_rates(c, m, dtype); });
    const auto med = measure_rates(c, m, dtype);
    for (auto& t : others) t.join();
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

double cpu_matmul_bytes(int64_t m, int64_t k, int64_t n, c10::ScalarType dtype, bool a_transposed,
                        int64_t threads) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, int64_t, c10::ScalarType, bool, int64_t>, double>
      measured;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(m, k, n, dtype, a_transposed, threads);
  if (auto it = measured.find(key); it != measured.end()) return it->second;
  // A shape too large to run at plan time (over 2 GFLOP: a second or more on a few cores):
  // its result in fp32 beside the result itself, which is what oneDNN's workspace came to on the
  // shapes measured (2026-11-28).
  const double elements = static_cast<double>(m) * static_cast<double>(n);
  if (2.0 * elements * static_cast<double>(k) > 2e9)
    return measured[key] = elements * static_cast<double>(c10::elementSize(dtype) + 4);
  auto& counter = observe::CpuAllocationCounter::get();  // installed before the operands exist
  // oneDNN's workspaces grow with the threads: the rank's, for the measurement only.
  const int64_t before = at::get_num_threads();
  if (threads != before) at::set_num_threads(static_cast<int>(threads));
  torch::NoGradGuard no_grad;
  const auto options = torch::TensorOptions().dtype(dtype);
  const auto a = a_transposed ? torch::ones({k, m}, options).t() : torch::ones({m, k}, options);
  const auto b = torch::ones({k, n}, options);
  torch::mm(a, b);  // the first call may set up what lives on
  const auto bytes = static_cast<double>(counter.peak_during([&] { torch::mm(a, b); }));
  if (threads != before) at::set_num_threads(static_cast<int>(before));
  return measured[key] = bytes;
}

}  // namespace tessel::planner
