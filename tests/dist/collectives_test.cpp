// Run under tessel-launch (ctest does, at 2 and 4 ranks): every typed collective and every
// autograd pair of parallel/autograd_comm.h, forward values and gradients, over Gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/observe/counters.h"
#include "parallel/autograd_comm.h"
#include "parallel/mesh.h"
#include "tests/dist/dist_env.h"

namespace tessel::parallel {
namespace {

Group& group() { return test_group(); }
double r() { return static_cast<double>(group().rank()); }
double n() { return static_cast<double>(group().size()); }

TEST(Collectives, TypedWrappers) {
  auto& g = group();
  auto x = torch::full({3}, r() + 1);
  g.all_reduce(x).wait();
  EXPECT_TRUE(torch::allclose(x, torch::full({3}, n() * (n() + 1) / 2)));
  auto b = torch::full({2}, r());
  g.broadcast(b, 1).wait();
  EXPECT_TRUE(torch::equal(b, torch::full({2}, 1.0)));
  auto red = torch::full({2}, r() + 1);
  g.reduce(red, 0).wait();
  if (g.rank() == 0) EXPECT_TRUE(torch::allclose(red, torch::full({2}, n() * (n() + 1) / 2)));
  auto in = torch::full({2}, r());
  auto out = torch::empty({2 * g.size()});
  g.all_gather(out, in).wait();
  EXPECT_TRUE(torch::equal(out, torch::arange(g.size()).repeat_interleave(2).to(torch::kFloat)));
  auto big = torch::arange(2 * g.size()).to(torch::kFloat);  // the same on every rank
  auto mine = torch::empty({2});
  g.reduce_scatter(mine, big).wait();
  EXPECT_TRUE(torch::equal(mine, big.narrow(0, 2 * g.rank(), 2) * n()));
  // all_to_all: slice j of rank i's input carries 10·i + j; rank r receives 10·s + r from each s.
  auto a2a_in = torch::arange(g.size()).to(torch::kFloat) + 10 * r();
  auto a2a_out = torch::empty({g.size()});
  g.all_to_all(a2a_out, a2a_in).wait();
  EXPECT_TRUE(torch::equal(a2a_out, torch::arange(g.size()).to(torch::kFloat) * 10 + r()));
  // A ring of batched send/recv: everyone sends first, nobody deadlocks.
  auto send = torch::full({4}, r()), recv = torch::empty({4});
  const int64_t next = (g.rank() + 1) % g.size(), prev = (g.rank() + g.size() - 1) % g.size();
  for (auto& w : g.send_recv({{P2POp::kSend, send, next}, {P2POp::kRecv, recv, prev}})) w.wait();
  EXPECT_TRUE(torch::equal(recv, torch::full({4}, static_cast<double>(prev))));
  g.barrier();
}

TEST(Collectives, CoalescedAllReduceIsOneCollective) {
  // Views of one flat buffer, of several shapes, as the replicated gradients are.
  auto& g = group();
  auto buffer = torch::zeros({40});
  std::vector<torch::Tensor> views = {buffer.narrow(0, 0, 6).view({2, 3}), buffer.narrow(0, 10, 1),
                                      buffer.narrow(0, 20, 12).view({3, 4})};
  for (size_t i = 0; i < views.size(); ++i)
    views[i].copy_(torch::arange(views[i].numel()).view(views[i].sizes()) * (r() + 1) +
                   static_cast<double>(i));
  torch::Tensor staging;
  const int64_t before = g.calls();
  g.all_reduce_coalesced(views, staging);
  EXPECT_EQ(g.calls() - before, 1);  // one all-reduce, not one per tensor
  for (size_t i = 0; i < views.size(); ++i) {
    auto want =
        (torch::arange(views[i].numel()) * (n() * (n() + 1) / 2) + n() * static_cast<double>(i))
            .view(views[i].sizes())
            .to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(views[i], want)) << i;
  }
  // Elements between the views are untouched; the staging buffer is kept for the next call.
  EXPECT_EQ(buffer.narrow(0, 6, 4).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(buffer.narrow(0, 32, 8).abs().sum().item<double>(), 0.0);
  const auto* kept = staging.data_ptr();
  g.all_reduce_coalesced(views, staging);
  EXPECT_EQ(staging.data_ptr(), kept);
}

// loss = sum(y · w) with w = (rank + 1): closed forms for every value and gradient below.
torch::Tensor backward_through(const torch::Tensor& y) {
  (y * (r() + 1)).sum().backward();
  return y;
}

// What a collective held (Gloo's reduce-scatter copies its input) is freed by wait(), not a moment
// later by Gloo's worker thread: the step peaks the planner is checked against must not depend on
// thread scheduling.
TEST(Collectives, WaitFreesWhatTheCollectiveHeld) {
  auto& g = group();
  auto& counter = tessel::observe::CpuAllocationCounter::get();
  const int64_t k = 4096;
  for (int i = 0; i < 20; ++i) {
    auto in = torch::full({static_cast<int64_t>(n()) * k}, r() + 1);
    auto out = torch::empty({k});
    auto gathered = torch::empty({static_cast<int64_t>(n()) * k});
    const int64_t before = counter.now();
    g.reduce_scatter(out, in).wait();
    EXPECT_EQ(counter.now(), before) << "reduce_scatter, iteration " << i;
    g.all_gather(gathered, out).wait();
    EXPECT_EQ(counter.now(), before) << "all_gather, iteration " << i;
    EXPECT_TRUE(torch::equal(gathered, torch::full_like(gathered, n() * (n() + 1) / 2)));
  }
}

// A reduce-scatter whose input the caller gives up (ZeRO's buckets) allocates nothing the size of
// it: Gloo, which has no reduce-scatter, all-reduces the input itself, not a copy.
TEST(Collectives, ReduceScatterOfAScratchInputAndAllGatherMakeNoCopy) {
  auto& g = group();
  auto& counter = tessel::observe::CpuAllocationCounter::get();
  const int64_t k = 1 << 14;
  auto in = torch::full({static_cast<int64_t>(n()) * k}, r() + 1);
  auto out = torch::empty({k});
  counter.take_peak();
  const int64_t before = counter.now();
  g.reduce_scatter(out, in, c10d::ReduceOp::SUM, /*scratch_input=*/true).wait();
  EXPECT_LT(counter.take_peak() - before, k * 4) << "a copy of the input";
  EXPECT_TRUE(torch::equal(out, torch::full({k}, n() * (n() + 1) / 2)));
  // And an all-gather writes straight into its output (c10d's Gloo all-gather stages the whole
  // output in a buffer of its own).
  auto gathered = torch::empty({static_cast<int64_t>(n()) * k});
  counter.take_peak();
  const int64_t before_gather = counter.now();
  g.all_gather(gathered, out).wait();
  EXPECT_LT(counter.take_peak() - before_gather, k * 4) << "a staging copy of the output";
  EXPECT_TRUE(torch::equal(gathered, torch::full_like(gathered, n() * (n() + 1) / 2)));
}

TEST(AutogradPairs, CopyToAndReduceFrom) {
  auto& g = group();
  auto x = torch::full({2, 3}, r() + 1).requires_grad_();
  auto y = backward_through(copy_to(g, x));
  EXPECT_TRUE(torch::equal(y, x));
  EXPECT_TRUE(torch::allclose(x.grad(), torch::full({2, 3}, n() * (n() + 1) / 2)));  // all-reduced
  auto x2 = torch::full({2, 3}, r() + 1).requires_grad_();
  auto y2 = backward_through(reduce_from(g, x2));
  EXPECT_TRUE(torch::allclose(y2, torch::full({2, 3}, n() * (n() + 1) / 2)));
  EXPECT_TRUE(torch::allclose(x2.grad(), torch::full({2, 3}, r() + 1)));  // identity
}

TEST(AutogradPairs, SplitAndGather) {
  auto& g = group();
  const int64_t k = 2;
  auto full = torch::arange(k * g.size()).to(torch::kFloat).view({1, -1}).requires_grad_();
  auto y = backward_through(split(g, full, 1));
  EXPECT_TRUE(torch::equal(y, full.narrow(1, k * g.rank(), k)));
  // Backward all-gathers every rank's (rank + 1) chunk.
  auto want = (torch::arange(g.size()).repeat_interleave(k) + 1).to(torch::kFloat).view({1, -1});
  EXPECT_TRUE(torch::equal(full.grad(), want));
  auto part = torch::full({1, k}, r()).requires_grad_();
  auto y2 = backward_through(gather(g, part, 1));
  EXPECT_TRUE(torch::equal(
      y2, torch::arange(g.size()).repeat_interleave(k).to(torch::kFloat).view({1, -1})));
  EXPECT_TRUE(torch::equal(part.grad(), torch::full({1, k}, r() + 1)));  // my chunk of my w
}

TEST(AutogradPairs, SequenceGatherAndScatter) {
  auto& g = group();
  const int64_t k = 2;
  auto part = torch::full({3, k, 4}, r()).requires_grad_();  // [b, s/n, h]
  auto y = backward_through(sequence_gather(g, part, 1));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, k * g.size(), 4}));
  EXPECT_TRUE(torch::equal(y.select(1, k * g.size() - 1), torch::full({3, 4}, n() - 1)));
  EXPECT_TRUE(torch::allclose(part.grad(),
                              torch::full({3, k, 4}, n() * (n() + 1) / 2)));  // reduce-scattered
  auto whole = torch::full({3, k * g.size(), 4}, r() + 1).requires_grad_();
  auto y2 = backward_through(sequence_scatter(g, whole, 1));
  EXPECT_EQ(y2.sizes(), (std::vector<int64_t>{3, k, 4}));
  EXPECT_TRUE(torch::allclose(y2, torch::full({3, k, 4}, n() * (n() + 1) / 2)));
  auto want = (torch::arange(g.size()).repeat_interleave(k) + 1)
                  .to(torch::kFloat)
                  .view({1, -1, 1})
                  .expand({3, -1, 4});
  EXPECT_TRUE(torch::equal(whole.grad(), want));
}

}  // namespace
}  // namespace tessel::parallel
