// tessel-gpu-tests: what only CUDA shows. Exits 77 (ctest: skipped, never passed) without a CUDA
// device. Alone (world size 1): the attention kernels on CUDA (block forward/backward against
// plain attention, the SDPA backend the dense layer gets), recomputation's CUDA RNG replay, the
// zero-bubble backward split.
// Under tessel-launch with one process per GPU (tests/gpu/gpu_suite.py does it when there are
// two GPUs or more): every collective of parallel/comm.h over NCCL on CUDA tensors, ZeRO-3's
// side channel, the pipeline's one-way channels.
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/device/cuda.h"
#include "core/kernels/fused_ops.h"
#include "core/observe/host_reads.h"
#include "engine/io/safetensors.h"
#include "engine/run/train.h"
#include "parallel/ep/dispatch.h"
#include "parallel/mesh.h"
#include "parallel/tp/layers.h"
#include "tests/common/attention_cases.h"
#include "tests/common/moe_cases.h"
#include "tests/common/recompute_cases.h"
#include "tests/common/weight_grad_cases.h"

namespace tessel::testing {
namespace {

std::unique_ptr<parallel::Mesh> g_mesh;  // NCCL over every rank (world > 1)
torch::Device g_device(torch::kCUDA, 0);

class CudaBlockKernels : public ::testing::TestWithParam<BlockCase> {};
TEST_P(CudaBlockKernels, ForwardAndBackwardMatchPlainAttention) { check_block_kernels(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cuda, CudaBlockKernels,
                         ::testing::ValuesIn(block_cases(torch::Device(torch::kCUDA, 0))),
                         [](const auto& info) { return case_name(info.param); });

// The dense layer never falls to the math kernel (a full [s, s] score matrix): fp32 and bf16,
// with and without grouped-query heads, training shapes and one-token generation.
// The host-read counter (core/observe/host_reads.h) counts a copy between the host and the device
// that the host waits for, once; a non-blocking copy from pinned memory, and read_on_host's own
// copy (counted by read_on_host), are not counted again.
TEST(CudaHostReads, BlockingCopiesAreCounted) {
  observe::count_host_reads();
  auto host = torch::ones({16});
  const int64_t before = observe::host_reads();
  auto on = host.to(g_device);  // pageable, blocking
  EXPECT_EQ(observe::host_reads() - before, 1);
  auto pinned = host.pin_memory();
  auto quiet = pinned.to(g_device, /*non_blocking=*/true);
  (void)quiet;
  EXPECT_EQ(observe::host_reads() - before, 1);
  observe::read_on_host(on);
  EXPECT_EQ(observe::host_reads() - before, 2);
  on.copy_(host);  // blocking copy_ from the host
  EXPECT_EQ(observe::host_reads() - before, 3);
  torch::cuda::synchronize();
}

TEST(CudaDenseAttention, NeverTheMathKernel) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (int64_t kv : {8, 2}) {
      auto o = torch::TensorOptions().dtype(dtype).device(g_device);
      auto q = torch::randn({2, 8, 256, 64}, o), k = torch::randn({2, kv, 256, 64}, o),
           v = torch::randn({2, kv, 256, 64}, o);
      const auto kernel = kernels::dense_attention_kernel(q, k, v, true);
      EXPECT_NE(kernel, "math") << "dtype " << dtype << " kv_heads " << kv;
      std::fprintf(stderr, "dense attention %s kv_heads %ld: %s kernel\n",
                   dtype == torch::kFloat32 ? "fp32" : "bf16", static_cast<long>(kv),
                   kernel.c_str());
      auto y = kernels::dense_attention(q, k, v, true, /*tessel_kernels=*/true);  // SDPA on CUDA
      auto ref = plain_attention(q.to(torch::kFloat64), k.to(torch::kFloat64),
                                 v.to(torch::kFloat64), true);
      const double tol = dtype == torch::kFloat32 ? 1e-4 : 3e-2;  // TF32 off: see main()
      EXPECT_LT((y.to(torch::kFloat64) - ref).abs().max().item<double>(), tol);
      auto one = q.narrow(2, 255, 1);  // a generated token against the cached keys
      EXPECT_NE(kernels::dense_attention_kernel(one, k, v, false), "math");
    }
}

// Attention inside documents through the variable-length kernels: fp32 memory-efficient, bf16
// flash, one call for the micro-batch, against plain attention under the block-diagonal mask.
TEST(CudaDocumentAttention, VarlenMatchesTheBlockDiagonalMask) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    check_document_attention(g_device, dtype, /*tessel_kernels=*/true);
    const auto q = torch::zeros({1}, torch::TensorOptions().dtype(dtype).device(g_device));
    EXPECT_EQ(kernels::document_attention_kernel(q),
              dtype == torch::kFloat32 ? "efficient-varlen" : "flash-varlen");
  }
}

// The limits start-up checks for document masking (kernels::document_kernel_unfit) are the
// device kernels' own: each head size and dtype the check passes runs forward and backward here,
// and each it refuses fails in the kernel (which, unchecked, would fail mid-step).
TEST(CudaDocumentAttention, StartUpLimitsAreTheKernels) {
  const int cc = device::cuda_module()->compute_capability(g_device.index());
  auto tokens = torch::randint(8, 100, {1, 40}, torch::kInt64);
  tokens[0][17] = 7;
  const auto docs = kernels::find_documents(tokens, 7, g_device);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (int64_t d : {60, 64, 256, 264}) {
      const auto why = kernels::document_kernel_unfit(d, dtype, cc);
      const auto o = torch::TensorOptions().dtype(dtype).device(g_device);
      auto q = torch::randn({1, 2, 40, d}, o).requires_grad_();
      auto k = torch::randn({1, 2, 40, d}, o).requires_grad_();
      auto v = torch::randn({1, 2, 40, d}, o).requires_grad_();
      bool ran = true;
      try {
        auto y = kernels::document_attention(q, k, v, docs, /*tessel_kernels=*/true);
        y.sum().backward();
        torch::cuda::synchronize();
      } catch (const std::exception&) {
        ran = false;
      }
      EXPECT_EQ(ran, why.empty()) << "head size " << d << " " << c10::toString(dtype) << ": "
                                  << why;
    }
}

// The kernel start-up names (and refuses when it is math) for the shipped plans' attention:
// a fused one, flash (or cuDNN's, where SDPA prefers it) in bf16, memory-efficient in fp32,
// grouped heads or not.
TEST(CudaDenseAttention, PlannedKernels) {
  // The order Tessel pins (kernels::pin_sdpa_order): cuDNN's kernel first in bf16 where the GPU
  // has it (the H100 did), the memory-efficient one in fp32; named at the plan's length.
  kernels::pin_sdpa_order(torch::kBFloat16);
  for (int64_t seq : {2048, 8192}) {
    const auto k =
        kernels::planned_attention_kernel(32, 8, seq, 64, torch::kBFloat16, g_device, true);
    std::fprintf(stderr, "planned attention bf16 seq %ld: %s kernel\n", static_cast<long>(seq),
                 k.c_str());
    EXPECT_TRUE(k == "cudnn" || k == "flash") << k;
  }
  kernels::pin_sdpa_order(torch::kFloat32);
  EXPECT_EQ(kernels::planned_attention_kernel(32, 8, 2048, 64, torch::kFloat32, g_device, true),
            "efficient");
  kernels::pin_sdpa_order(torch::kBFloat16);
  for (int64_t kv : {32, 8}) {
    const auto bf16 =
        kernels::planned_attention_kernel(32, kv, 2048, 64, torch::kBFloat16, g_device, true);
    EXPECT_TRUE(bf16 == "flash" || bf16 == "cudnn") << bf16;
    EXPECT_EQ(kernels::planned_attention_kernel(32, kv, 2048, 64, torch::kFloat32, g_device, true),
              "efficient");
  }
}

// training.deterministic on the GPU: attention forward and backward in bf16 at Llama-3 1B's
// grouped-query shape, run twice, give bitwise-equal gradients (without it neither cuDNN's nor
// flash's backward repeated on an H100: bench/RESULTS.md, third GPU run).
TEST(CudaDeterministic, AttentionBackwardRepeatsBitwise) {
  device::set_deterministic(true);
  kernels::pin_sdpa_order(torch::kBFloat16, /*deterministic=*/true);
  const auto o = torch::TensorOptions().dtype(torch::kBFloat16).device(g_device);
  torch::manual_seed(0);
  auto q = torch::randn({2, 32, 2048, 64}, o), k = torch::randn({2, 8, 2048, 64}, o),
       v = torch::randn({2, 8, 2048, 64}, o), dy = torch::randn({2, 32, 2048, 64}, o);
  auto grads = [&] {
    auto qq = q.clone().requires_grad_(), kk = k.clone().requires_grad_(),
         vv = v.clone().requires_grad_();
    at::scaled_dot_product_attention(qq, kk, vv, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                     /*enable_gqa=*/true)
        .backward(dy);
    return torch::cat({qq.grad().flatten(), kk.grad().flatten(), vv.grad().flatten()});
  };
  const auto first = grads();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(first, grads())) << "repeat " << i;
  device::set_deterministic(false);
  kernels::pin_sdpa_order(torch::kBFloat16);
}

TEST(CudaRecompute, ReplaysTheForwardsRandomDraws) { check_recompute_replays_rng(g_device); }

// An MoE layer's router, grouped expert matmuls (at::_grouped_mm's CUDA kernel) and combine on
// the GPU against the CPU in fp32: fp32 within 1e-4 (TF32 off here), bf16 within 3e-2.
TEST(CudaMoe, LayerMatchesTheCpu) {
  at::globalContext().setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL,
                                          at::Float32Precision::IEEE);
  check_moe_on(g_device, torch::kFloat32, 1e-4);
  check_moe_on(g_device, torch::kBFloat16, 3e-2);
}

// Microseconds per call of f on the GPU: 20 calls after 3 warm-ups.
template <typename F>
double time_us(const F& f) {
  for (int i = 0; i < 3; ++i) f();
  torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) f();
  torch::cuda::synchronize();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
         20;
}

// Llama's RMSNorm on CUDA is LibTorch's fused kernel (core/kernels/fused_ops.cpp): against the
// composite in fp64 (fp32 statistics) in fp32 and bf16, output and both gradients, at Llama-3 1B's
// width; and its time against the composite's, forward and backward (the GPU check's report).
TEST(CudaFusedOps, RmsNormMatchesTheCompositeAndIsFaster) {
  at::globalContext().setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL,
                                          at::Float32Precision::IEEE);
  const int64_t rows = 8192, h = 2048;
  auto composite = [](const torch::Tensor& x, const torch::Tensor& w) {
    auto x32 = x.to(torch::kFloat32);
    return w * (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-5)).to(x.scalar_type());
  };
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto o = torch::TensorOptions().device(g_device).dtype(dtype);
    auto x = (torch::randn({rows, h}, o) * 3).requires_grad_();
    auto w = (torch::rand({h}, o) + 0.5).requires_grad_();
    auto dy = torch::randn({rows, h}, o);
    auto xr = x.detach().to(torch::kFloat64).requires_grad_();
    auto wr = w.detach().to(torch::kFloat64).requires_grad_();
    auto y = kernels::rms_norm(x, w, 1e-5, /*fused=*/true), yr = composite(xr, wr);
    y.backward(dy);
    yr.backward(dy.to(torch::kFloat64));
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 2e-2;
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
      return ((a.to(torch::kFloat64) - b).abs().max() / b.abs().max()).item<double>();
    };
    EXPECT_LT(rel(y, yr), tol);
    EXPECT_LT(rel(x.grad(), xr.grad()), tol);
    EXPECT_LT(rel(w.grad(), wr.grad()), tol);
    const double fused = time_us([&] { kernels::rms_norm(x, w, 1e-5, true).backward(dy); });
    const double comp = time_us([&] { composite(x, w).backward(dy); });
    std::fprintf(stderr,
                 "kernel rms_norm [%ld, %ld] %s fwd+bwd: fused %.1f us, composite %.1f us\n",
                 static_cast<long>(rows), static_cast<long>(h),
                 dtype == torch::kFloat32 ? "fp32" : "bf16", fused, comp);
    EXPECT_LT(fused, comp);
  }
}

// The optimizer step Tessel runs (at::_fused_adamw_, one multi-tensor kernel) against AdamW
// written as LibTorch's per-tensor operators, on Llama-3 1B's 16 MLP up-projection shapes in
// fp32: the same update within 1e-6, and both times for the GPU check's report.
TEST(CudaFusedOps, AdamWMatchesTheCompositeAndIsFaster) {
  const double lr = 3e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  const auto o = torch::TensorOptions().device(g_device).dtype(torch::kFloat32);
  std::vector<torch::Tensor> w, g, m, v, w2, m2, v2;
  for (int i = 0; i < 16; ++i) {
    w.push_back(torch::randn({8192, 2048}, o));
    g.push_back(torch::randn({8192, 2048}, o) * 1e-2);
    m.push_back(torch::zeros_like(w.back()));
    v.push_back(torch::zeros_like(w.back()));
    w2.push_back(w.back().clone());
    m2.push_back(m.back().clone());
    v2.push_back(v.back().clone());
  }
  auto steps = torch::zeros({}, o), steps2 = torch::zeros({}, o);
  std::vector<torch::Tensor> st(16, steps);
  auto fused = [&] {
    steps.add_(1);
    at::_fused_adamw_(w, g, m, v, {}, st, lr, b1, b2, wd, eps, false, false, std::nullopt,
                      std::nullopt);
  };
  int64_t t = 0;
  auto composite = [&] {
    ++t;
    const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < w2.size(); ++i) {
      w2[i].mul_(1 - lr * wd);
      m2[i].mul_(b1).add_(g[i], 1 - b1);
      v2[i].mul_(b2).addcmul_(g[i], g[i], 1 - b2);
      w2[i].addcdiv_(m2[i], (v2[i] / c2).sqrt_().add_(eps), -lr / c1);
    }
  };
  fused();
  composite();
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i)
    worst = std::max(worst, ((w[i] - w2[i]).abs().max() / w2[i].abs().max()).item<double>());
  EXPECT_LT(worst, 1e-6);
  const double f = time_us(fused), c = time_us(composite);
  std::fprintf(stderr, "kernel adamw 16 x [8192, 2048] fp32: fused %.1f us, composite %.1f us\n", f,
               c);
  EXPECT_LT(f, c);
}

// Tessel's cross-entropy (one fp32 buffer, softmax and gradient in place: parallel/tp/layers.h)
// against LibTorch's (log-softmax, then NLL) on Llama-3 1B's logits for 4x2048 tokens in bf16:
// the same loss and gradient within bf16 rounding, and both times for the GPU check's report.
TEST(CudaFusedOps, CrossEntropyMatchesLibTorchsAndIsTimed) {
  const int64_t n = 8192, vocab = 128256;
  const auto o = torch::TensorOptions().device(g_device).dtype(torch::kBFloat16);
  auto logits = (torch::randn({n, vocab}, o) * 2).requires_grad_();
  auto targets = torch::randint(vocab, {n}, o.dtype(torch::kInt64));
  parallel::Group one("tp", {0}, 0, nullptr);
  auto ours = [&] {
    logits.mutable_grad() = torch::Tensor();
    auto loss = parallel::tp::vocab_parallel_cross_entropy(one, logits, targets, 0, vocab).sum();
    loss.backward();
    return loss;
  };
  auto theirs = [&] {
    logits.mutable_grad() = torch::Tensor();
    auto loss = torch::nn::functional::cross_entropy(
        logits.to(torch::kFloat32), targets,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    loss.backward();
    return loss;
  };
  const double a = ours().item<double>();
  const auto ga = logits.grad().to(torch::kFloat32);
  const double b = theirs().item<double>();
  const auto gb = logits.grad().to(torch::kFloat32);
  EXPECT_LT(std::abs(a - b) / std::abs(b), 1e-4);
  EXPECT_LT(((ga - gb).abs().max() / gb.abs().max()).item<double>(), 2e-2);
  const double t_ours = time_us(ours), t_theirs = time_us(theirs);
  std::fprintf(
      stderr,
      "kernel cross_entropy [%ld, %ld] bf16 fwd+bwd: Tessel's %.1f us, LibTorch's %.1f us\n",
      static_cast<long>(n), static_cast<long>(vocab), t_ours, t_theirs);
  // Tessel's: an fp32 copy made the log-softmax in place (LibTorch's fused kernel), backward the
  // exponential, the target subtracted and one scaled cast: five passes over [n, vocab] where
  // LibTorch's makes seven and holds a second fp32 buffer. (The six-pass version before it took
  // 17.3 ms against LibTorch's 13.5 ms on an H200.)
  EXPECT_LT(t_ours, t_theirs);
}

// Zero-bubble B then W on CUDA, where backward runs on the engine's device thread.
TEST(CudaWeightGrad, BThenWIsOneBackward) { check_split_backward(g_device); }

// A checkpoint's tensors leave the device through one pinned buffer, copied without waiting but
// for the last: what is written is what was on the device (dtypes, a strided view, an empty one),
// after work still queued on the stream that wrote them.
TEST(CudaCheckpoint, HostCopiesAreWhatTheDeviceHeld) {
  auto o = torch::TensorOptions().device(g_device);
  auto big = torch::randn({2048, 2048}, o);
  std::vector<std::pair<std::string, torch::Tensor>> t = {
      {"f32", torch::randn({37, 5}, o)},
      {"bf16", torch::randn({64}, o.dtype(torch::kBFloat16))},
      {"i64", torch::arange(11, o.dtype(torch::kInt64))},
      {"strided", torch::randn({8, 6}, o).t()},
      {"empty", torch::empty({0, 3}, o)},
      {"late", big.matmul(big)}};  // still computing when the copies are queued
  const auto path = std::filesystem::temp_directory_path() / "tessel_gpu_host_copies.safetensors";
  io::write_safetensors(path.string(), t, {});
  const auto back = io::read_safetensors(path.string());
  for (const auto& [name, x] : t) {
    const auto& y = back.tensors.at(name);
    EXPECT_EQ(y.scalar_type(), x.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(y, x.cpu())) << name;
  }
  std::filesystem::remove(path);
}

// checkpoint.async's copy to host (libtessel_cuda's copy_to_host): on a side stream after the
// work already queued (a matmul still running); the training stream reads the sources meanwhile
// and waits for the copies on the device only before it writes them (the optimizer step): the
// host gets the values of the step boundary. The host side is one exactly sized page-locked arena.
TEST(CudaCheckpoint, AsyncCopiesAreTheStepBoundarysValues) {
  auto o = torch::TensorOptions().device(g_device);
  auto big = torch::randn({2048, 2048}, o);
  std::vector<torch::Tensor> src = {big.matmul(big), torch::randn({8, 6}, o).t(),
                                    torch::randn({64}, o.dtype(torch::kBFloat16))};
  const int64_t bytes = 2048 * 2048 * 4 + 256 + 256;
  const auto arena = device::cuda_module()->pinned_bytes(bytes);
  EXPECT_EQ(arena.numel(), bytes);
  EXPECT_TRUE(arena.is_pinned());
  std::vector<torch::Tensor> want, dst;
  int64_t at = 0;
  for (const auto& s : src) {
    want.push_back(s.cpu());
    const int64_t n = s.numel() * s.element_size();
    dst.push_back(arena.narrow(0, at, n).view(s.scalar_type()).view(s.sizes()));
    at += (n + 255) / 256 * 256;
  }
  const auto copied = device::cuda_module()->copy_to_host(dst, src);
  auto read = src[0].sum();  // the next step's forward reads while the copies run
  copied.wait_on_device();
  for (auto& s : src) s.fill_(7);  // the next step's update, queued on the training stream
  copied.wait_host();
  for (size_t i = 0; i < src.size(); ++i) EXPECT_TRUE(torch::equal(dst[i], want[i])) << i;
  EXPECT_TRUE(torch::equal(src[0].cpu(), torch::full_like(want[0], 7)));
  EXPECT_NEAR(read.item<double>(), want[0].sum().item<double>(),
              1e-3 * want[0].abs().sum().item<double>());
}

// Rows reach the device through pinned memory without waiting, and are the rows.
TEST(CudaData, RowsOnTheDevice) {
  auto rows = torch::randint(0, 50000, {8, 129}, torch::kInt64);
  auto d = run::to_device(rows, g_device);
  EXPECT_TRUE(d.is_cuda());
  EXPECT_TRUE(torch::equal(d.cpu(), rows));
  EXPECT_FALSE(run::to_device(rows, torch::kCPU).is_cuda());
}

// NCCL: every typed collective, on CUDA tensors, over all ranks (skipped at world size 1: two
// ranks of one communicator cannot share a GPU).
TEST(Nccl, EveryCollective) {
  if (!g_mesh) GTEST_SKIP() << "world size 1: NCCL needs one GPU per rank";
  auto& g = g_mesh->dp_cp();
  EXPECT_EQ(g.backend_name(), "nccl");
  const double r = static_cast<double>(g.rank()), n = static_cast<double>(g.size());
  auto o = torch::TensorOptions().device(g_mesh->device());
  auto x = torch::full({3}, r + 1, o);
  g.all_reduce(x).wait();
  EXPECT_TRUE(torch::allclose(x.cpu(), torch::full({3}, n * (n + 1) / 2)));
  auto b = torch::full({2}, r, o);
  g.broadcast(b, 1).wait();
  EXPECT_TRUE(torch::equal(b.cpu(), torch::full({2}, 1.0)));
  auto in = torch::full({2}, r, o), out = torch::empty({2 * g.size()}, o);
  g.all_gather(out, in).wait();
  EXPECT_TRUE(
      torch::equal(out.cpu(), torch::arange(g.size()).repeat_interleave(2).to(torch::kFloat)));
  auto big = torch::arange(2 * g.size(), o.dtype(torch::kFloat)), mine = torch::empty({2}, o);
  g.reduce_scatter(mine, big).wait();
  EXPECT_TRUE(torch::equal(mine.cpu(), big.narrow(0, 2 * g.rank(), 2).cpu() * n));
  auto a_in = torch::arange(g.size(), o.dtype(torch::kFloat)) + 10 * r,
       a_out = torch::empty({g.size()}, o);
  g.all_to_all(a_out, a_in).wait();
  EXPECT_TRUE(torch::equal(a_out.cpu(), torch::arange(g.size()).to(torch::kFloat) * 10 + r));
  // A ring of point-to-point transfers in one coalesced batch (the pipeline's and ring
  // attention's pattern).
  const int64_t next = (g.rank() + 1) % g.size(), prev = (g.rank() + g.size() - 1) % g.size();
  auto send = torch::full({4}, r, o), recv = torch::empty({4}, o);
  for (auto& w :
       g.send_recv({{parallel::P2POp::kSend, send, next}, {parallel::P2POp::kRecv, recv, prev}}))
    w.wait();
  EXPECT_TRUE(torch::equal(recv.cpu(), torch::full({4}, static_cast<double>(prev))));
  g.barrier();
}

// Expert parallelism's transfer: rows with uneven split sizes (rank r sends r + j + 1 rows to
// rank j, none to itself when it is rank 0), on NCCL, forward and backward.
TEST(Nccl, RowsAllToAllWithUnevenSplits) {
  if (!g_mesh) GTEST_SKIP() << "world size 1: NCCL needs one GPU per rank";
  auto& g = g_mesh->dp_cp();
  const int64_t r = g.rank(), n = g.size();
  std::vector<int64_t> send, recv;
  for (int64_t j = 0; j < n; ++j) {
    send.push_back(j == 0 && r == 0 ? 0 : r + j + 1);
    recv.push_back(j == 0 && r == 0 ? 0 : j + r + 1);
  }
  int64_t rows = 0;
  for (auto s : send) rows += s;
  auto o = torch::TensorOptions().device(g_mesh->device());
  auto x = (torch::arange(rows, o.dtype(torch::kFloat)) + 100 * r).unsqueeze(1).repeat({1, 3});
  x.requires_grad_(true);
  auto y = parallel::ep::all_to_all_rows(g, x, send, recv);
  int64_t at = 0;
  for (int64_t s = 0; s < n; ++s) {  // rank s's rows for me start after its rows for ranks < r
    int64_t first = 0;
    for (int64_t j = 0; j < r; ++j) first += (j == 0 && s == 0) ? 0 : s + j + 1;
    for (int64_t i = 0; i < recv[static_cast<size_t>(s)]; ++i, ++at)
      EXPECT_EQ(y[at][0].item<double>(), static_cast<double>(first + i + 100 * s));
  }
  y.backward(torch::ones_like(y) * (r + 1));  // each row's gradient comes back from its receiver
  int64_t row = 0;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < send[static_cast<size_t>(j)]; ++i, ++row)
      EXPECT_EQ(x.grad()[row][0].item<double>(), static_cast<double>(j + 1));
}

// ZeRO-3's side channel: a communicator of its own over the data group's ranks, so an all-gather
// on it and a reduce-scatter on the group run beside each other (on two NCCL streams); both land
// with the right values, and the side channel's bytes count as the group's.
TEST(Nccl, SideChannelBesideTheGroup) {
  if (!g_mesh) GTEST_SKIP() << "world size 1: NCCL needs one GPU per rank";
  auto& g = g_mesh->dp_cp();
  ASSERT_TRUE(g.has_side());
  EXPECT_EQ(g.side().backend_name(), "nccl");
  auto o = torch::TensorOptions().device(g_mesh->device());
  const double r = static_cast<double>(g.rank());
  const int64_t n = 1 << 22;
  auto big = torch::ones({n * g.size()}, o), mine = torch::empty({n}, o);
  auto piece = torch::full({n}, r, o), whole = torch::empty({n * g.size()}, o);
  const int64_t before = g.bytes();
  auto rs = g.reduce_scatter(mine, big);
  auto ag = g.side().all_gather(whole, piece);
  rs.wait();
  ag.wait();
  EXPECT_TRUE(torch::equal(mine.cpu(), torch::full({n}, static_cast<double>(g.size()))));
  EXPECT_TRUE(
      torch::equal(whole.cpu(), torch::arange(g.size()).to(torch::kFloat).repeat_interleave(n)));
  EXPECT_EQ(g.bytes() - before, 2 * n * g.size() * 4);
}

// The pipeline's channels: over a mesh of one pipeline through every rank, each rank sends two
// large messages (past NCCL's eager size, so a send completes only when received) to the next
// stage and receives two from the previous one, every rank sending first. Each receive is waited
// for alone, before any send: they land whole and in order.
TEST(Nccl, PipelineChannelsOneWayEach) {
  if (!g_mesh) GTEST_SKIP() << "world size 1: NCCL needs one GPU per rank";
  const int64_t world = g_mesh->world_group().size();
  auto c = plan::load_config_text(
      "data: {path: none}\nmodel: {heads: 4, layers: " + std::to_string(2 * world) +
          "}\ntraining: {global_batch: " + std::to_string(world) +
          ", micro_batch: 1, device: cuda}\nparallel: {timeout_s: 120, backend: nccl, pp: " +
          std::to_string(world) + "}\n",
      "gpu_tests");
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "pipeline_mesh", c10::intrusive_ptr<c10d::Store>::reclaim_copy(g_mesh->store()));
  auto mesh = parallel::Mesh::create(c, parallel::discover_world(), g_mesh->device(), store);
  auto& pp = mesh->group(parallel::GroupKind::kPp);
  ASSERT_EQ(pp.channels(), world == 2 ? 2 : 4);
  const int64_t next = (pp.rank() + 1) % world, prev = (pp.rank() + world - 1) % world;
  auto o = torch::TensorOptions().device(g_mesh->device());
  const int64_t n = 1 << 22;
  const double r = static_cast<double>(pp.rank());
  std::vector<torch::Tensor> out{torch::full({n}, r, o), torch::full({n}, r + 100, o)};
  std::vector<torch::Tensor> in{torch::empty({n}, o), torch::empty({n}, o)};
  const int64_t before = pp.sent_bytes();
  auto works = pp.send_recv({{parallel::P2POp::kSend, out[0], next},
                             {parallel::P2POp::kSend, out[1], next},
                             {parallel::P2POp::kRecv, in[0], prev},
                             {parallel::P2POp::kRecv, in[1], prev}});
  ASSERT_EQ(works.size(), 4u);
  works[2].wait();
  works[3].wait();
  EXPECT_TRUE(torch::equal(in[0].cpu(), torch::full({n}, static_cast<double>(prev))));
  EXPECT_TRUE(torch::equal(in[1].cpu(), torch::full({n}, static_cast<double>(prev) + 100)));
  works[0].wait();
  works[1].wait();
  EXPECT_EQ(pp.sent_bytes() - before, 2 * n * 4);
  mesh->world_group().barrier();
}

}  // namespace
}  // namespace tessel::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!tessel::device::cuda_available()) {
    // Skipped only where the machine has no GPU at all: a GPU CUDA cannot use is a failure.
    if (const auto why = tessel::device::gpu_present_but_unusable(); !why.empty()) {
      std::printf("tessel-gpu-tests: FAILED: %s\n", why.c_str());
      return 1;
    }
    std::printf("tessel-gpu-tests: no GPU on this machine (%s): skipped\n",
                tessel::device::cuda_unavailable_reason().c_str());
    return 77;
  }
  // Exact fp32 matmuls, as the CPU: the fp32 bounds above are kernel rounding only.
  at::globalContext().setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL,
                                          at::Float32Precision::IEEE);
  const auto world = tessel::parallel::discover_world();
  if (world.world > 1) {
    auto c = tessel::plan::load_config_text(
        "data: {path: none}\nmodel: {heads: 4}\ntraining: {global_batch: " +
            std::to_string(world.world) +
            ", micro_batch: 1, device: cuda}\nparallel: {timeout_s: 120, backend: nccl, zero: 3, "
            "dp: " +
            std::to_string(world.world) + "}\n",
        "gpu_tests");
    const auto device = tessel::run::resolve_device(tessel::plan::TrainDevice::kCuda, world);
    c10::cuda::set_device(device.index());
    tessel::testing::g_device = device;
    tessel::testing::g_mesh = tessel::parallel::Mesh::create(c, world, device);
  }
  const int rc = RUN_ALL_TESTS();
  if (tessel::testing::g_mesh) tessel::testing::g_mesh->world_group().barrier();
  tessel::testing::g_mesh.reset();
  return rc;
}
