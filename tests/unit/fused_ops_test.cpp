// Llama's fused CPU layers (core/kernels/fused_ops.h) against their LibTorch composites in fp64:
// outputs and gradients of RMSNorm, SwiGLU and RoPE, in the layouts the model hands them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/kernels/accumulate.h"
#include "core/kernels/fused_ops.h"
#include "core/observe/counters.h"

namespace tessel::testing {
namespace {

double rel_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kFloat64) - want).abs().max().item<double>() /
         std::max(1e-30, want.abs().max().item<double>());
}

// f(fused inputs) in fp32 with fused on, f(the same values in fp64) with the composite; every
// input's gradient compared too.
template <class F>
void check_against_composite(const std::vector<torch::Tensor>& inputs, const F& f, double tol) {
  std::vector<torch::Tensor> a, b;
  for (const auto& t : inputs) {
    a.push_back(t.detach().clone().requires_grad_(true));
    b.push_back(t.detach().to(torch::kFloat64).requires_grad_(true));
  }
  auto ya = f(a, true), yb = f(b, false);
  ASSERT_EQ(ya.sizes(), yb.sizes());
  EXPECT_LT(rel_error(ya, yb), tol);
  auto dy = torch::randn(ya.sizes());
  ya.backward(dy);
  yb.backward(dy.to(torch::kFloat64));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(rel_error(a[i].grad(), b[i].grad()), tol) << i;
}

TEST(FusedOps, RmsNormMatchesTheComposite) {
  torch::manual_seed(2);
  for (int64_t h : {192, 37, 8}) {
    auto x = torch::randn({3, 41, h}) * 3, w = torch::rand({h}) + 0.5;
    check_against_composite(
        {x, w},
        [](const std::vector<torch::Tensor>& t, bool fused) {
          return kernels::rms_norm(t[0], t[1], 1e-5, fused);
        },
        2e-6);
  }
}

// Where Tessel's loops do not run (training.kernels torch, bf16, CUDA), LibTorch's fused RMSNorm
// operator does (on the CPU it decomposes into the composite; on CUDA it is one kernel each way,
// which tests/gpu checks): fp32 within 2e-6 of the composite in fp64, bf16 within two roundings
// (it applies the weight before the cast to bf16, the composite after).
TEST(FusedOps, LibTorchsFusedRmsNormWhereTesselsLoopsDoNotRun) {
  torch::manual_seed(5);
  auto x = torch::randn({3, 41, 192}) * 3, w = torch::rand({192}) + 0.5;
  check_against_composite(
      {x, w},
      [](const std::vector<torch::Tensor>& t, bool fused) {
        return kernels::rms_norm(t[0], t[1], 1e-5, /*fused=*/false);  // fp32: LibTorch's operator
      },
      2e-6);
  auto xb = x.to(torch::kBFloat16).requires_grad_(), wb = w.to(torch::kBFloat16).requires_grad_();
  auto y = kernels::rms_norm(xb, wb, 1e-5, true);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  auto x32 = xb.detach().to(torch::kFloat32);
  auto want =
      (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-5)) * wb.detach().to(torch::kFloat32);
  EXPECT_LT(
      ((y.detach().to(torch::kFloat32) - want).abs() / (want.abs() + 1e-3)).max().item<double>(),
      2 * std::ldexp(1.0, -8));
}

TEST(FusedOps, SwigluMatchesTheComposite) {
  torch::manual_seed(3);
  auto g = torch::randn({5, 67}) * 4, u = torch::randn({5, 67});
  check_against_composite(
      {g, u},
      [](const std::vector<torch::Tensor>& t, bool fused) {
        return kernels::swiglu(t[0], t[1], fused);
      },
      2e-6);
}

// Through a matmul (the down projection) the incoming gradient is fresh and SwiGLU's backward
// writes the up projection's gradient into it: the same gradients as from a caller-held one (the
// out-of-place path, which a caller's tensor takes: it must come out unchanged).
TEST(FusedOps, SwigluBackwardInPlaceMatchesOutOfPlace) {
  auto g1 = torch::randn({32, 40}).requires_grad_(), u1 = torch::randn({32, 40}).requires_grad_();
  auto m = torch::randn({40, 24}), dz = torch::randn({32, 24});
  torch::matmul(kernels::swiglu(g1, u1, true), m).backward(dz);
  auto g2 = g1.detach().clone().requires_grad_(), u2 = u1.detach().clone().requires_grad_();
  auto dy = torch::matmul(dz, m.t()), kept = dy.clone();
  kernels::swiglu(g2, u2, true).backward(dy);
  EXPECT_TRUE(torch::equal(dy, kept));
  EXPECT_TRUE(torch::equal(g1.grad(), g2.grad()));
  EXPECT_TRUE(torch::equal(u1.grad(), u2.grad()));
}

TEST(FusedOps, RopeMatchesTheCompositeInTheModelsLayout) {
  torch::manual_seed(4);
  const int64_t b = 2, s = 9, heads = 3, d = 20;
  // x as the projections make it: [b, s, heads, d] memory viewed [b, heads, s, d].
  auto x = torch::randn({b, s, heads, d}).transpose(1, 2);
  auto angles = torch::rand({s, d / 2}) * 6;
  auto emb = torch::cat({angles, angles}, -1);
  auto cos = emb.cos(), sin = emb.sin();
  check_against_composite(
      {x},
      [&](const std::vector<torch::Tensor>& t, bool fused) {
        const auto dtype = t[0].scalar_type();
        return kernels::rope(t[0], cos.to(dtype), sin.to(dtype), fused);
      },
      1e-6);
  // The result keeps x's memory layout (no copy for the attention's reshape to make twice).
  auto y = kernels::rope(x, cos, sin, true);
  EXPECT_EQ(y.strides(), x.strides());
  // One table per row (data.document_mask: positions restart at each document): each row as
  // the shared-table rope of its own table.
  auto row_angles = torch::rand({b, s, d / 2}) * 6;
  auto row_emb = torch::cat({row_angles, row_angles}, -1);
  auto rc = row_emb.cos(), rs = row_emb.sin();
  check_against_composite(
      {x},
      [&](const std::vector<torch::Tensor>& t, bool fused) {
        const auto dtype = t[0].scalar_type();
        return kernels::rope(t[0], rc.to(dtype), rs.to(dtype), fused);
      },
      1e-6);
  auto per_row = kernels::rope(x, rc, rs, true);
  for (int64_t r = 0; r < b; ++r)
    EXPECT_TRUE(torch::equal(per_row[r], kernels::rope(x.narrow(0, r, 1), rc[r], rs[r], true)[0]))
        << "row " << r;
}

TEST(FusedOps, OffOrNotFp32CpuRunsTheComposite) {
  auto x = torch::randn({4, 16}, torch::kFloat64), w = torch::ones({16}, torch::kFloat64);
  EXPECT_FALSE(kernels::fused_cpu(x));
  EXPECT_TRUE(kernels::fused_cpu(x.to(torch::kFloat32)));
  auto y = kernels::rms_norm(x, w, 1e-6, true);  // fp64: the composite (fp32 statistics), exactly
  auto x32 = x.to(torch::kFloat32);
  auto want = (x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + 1e-6)).to(torch::kFloat64);
  EXPECT_TRUE(torch::allclose(y, want, 0, 0));
}

// The fold of a micro-batch's 16-bit gradients: the same bits as LibTorch's mixed-dtype add_, with
// no full-size temporary (LibTorch's CPU add_ casts the whole input to fp32 first).
TEST(Accumulate, AddsA16BitGradientIntoFp32BitwiseWithoutACopy) {
  torch::manual_seed(4);
  auto& counter = observe::CpuAllocationCounter::get();
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const int64_t n = 100003;  // not a multiple of a thread's share
    auto acc = torch::randn({n}) * 3, g = torch::randn({n}).to(dtype);
    auto want = acc.clone();
    want.add_(g);
    counter.take_peak();
    const int64_t before = counter.now();
    kernels::add_widened(acc, g);
    EXPECT_LT(counter.take_peak() - before, 4096) << "a temporary the size of the gradient";
    EXPECT_TRUE(torch::equal(acc, want)) << dtype;
  }
  auto acc = torch::zeros({5});  // same dtype: LibTorch's add_
  kernels::add_widened(acc, torch::ones({5}));
  EXPECT_TRUE(torch::equal(acc, torch::ones({5})));
}

}  // namespace
}  // namespace tessel::testing
