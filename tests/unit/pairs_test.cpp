// Micro-batches two at a time (Executor::pair_microbatches, parallel/pp/pairs.cpp): the same
// gradients and losses as one at a time, run to run the same, the caller's thread count kept, and
// a failure on either lane raised on the calling thread. The sums are those of one at a time bit
// for bit when each operator rounds alike on one thread and on two (the element-wise net here;
// MKL's sgemm of a [6, 16] × [16, 32] product does not: PyTorch's own result differs in the last
// bit between 1 and 2 threads).
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <stdexcept>

#include "parallel/comm.h"
#include "parallel/pp/executor.h"

namespace tessel::parallel::pp {
namespace {

struct Net {
  torch::Tensor w1, b1, w2, frozen;
  std::vector<torch::Tensor> all() const { return {w1, b1, w2, frozen}; }
};

Net make_net() {
  torch::manual_seed(3);
  return {torch::randn({32, 16}).requires_grad_(true), torch::randn({32}).requires_grad_(true),
          torch::randn({1, 32}).requires_grad_(true), torch::randn({16})};
}

struct Result {
  std::vector<torch::Tensor> grads;
  std::vector<torch::Tensor> losses;
  std::vector<torch::Tensor> at_hooks;  // w1's gradient at every after-backward hook
  int64_t peak = 0;
};

// One step of `m` micro-batches of 6 rows; `fail_at`: the micro-batch whose forward throws.
// `matmul`: a two-layer net; else element-wise only (every operator below ATen's grain: serial).
Result step(int64_t m, bool pairs, bool matmul, int64_t fail_at = -1) {
  auto net = make_net();
  auto data = torch::randn({m * 6, 16}, torch::TensorOptions().dtype(torch::kFloat32));
  Group solo("pp", {0}, 0, {});
  Executor ex(solo, make_schedule(plan::PipelineSchedule::k1F1B, 1, m, 1), {6, 16},
              torch::TensorOptions());
  if (pairs) ex.pair_microbatches(net.all());
  Result r;
  r.losses.resize(static_cast<size_t>(m));
  int64_t hooks = 0;
  StageFns fns{[&](int64_t mb, int64_t, const torch::Tensor& input) {
                 EXPECT_FALSE(input.defined());
                 if (mb == fail_at) throw std::runtime_error("forward failed");
                 auto x = data.narrow(0, mb * 6, 6) + net.frozen;
                 auto loss =
                     matmul ? torch::tanh(x.matmul(net.w1.t()) + net.b1).matmul(net.w2.t()).sum()
                            : (torch::tanh(x * net.w1.narrow(0, 0, 1) + net.b1.narrow(0, 0, 16)) *
                               net.w2.narrow(1, 0, 16))
                                  .sum();
                 r.losses[static_cast<size_t>(mb)] = loss.detach();
                 return loss;
               },
               [&](int64_t, bool) { ++hooks; },
               [&](int64_t, bool) {
                 ++hooks;
                 r.at_hooks.push_back(net.w1.grad().clone());
               }};
  r.peak = ex.run(fns).peak_activations;
  EXPECT_EQ(hooks, 2 * m);  // before and after every backward
  for (const auto& t : {net.w1, net.b1, net.w2}) r.grads.push_back(t.grad().clone());
  EXPECT_FALSE(net.frozen.grad().defined());
  return r;
}

class Pairs : public ::testing::Test {
 protected:
  void SetUp() override {
    before_ = at::get_num_threads();
    at::set_num_threads(2);
  }
  void TearDown() override { at::set_num_threads(before_); }
  int before_ = 1;
};

TEST_F(Pairs, SumsInOneAtATimesOrder) {
  for (int64_t m : {2, 3, 4, 5}) {
    torch::manual_seed(7);
    auto one = step(m, false, false);
    torch::manual_seed(7);
    auto two = step(m, true, false);
    for (size_t i = 0; i < one.grads.size(); ++i)
      EXPECT_TRUE(torch::equal(one.grads[i], two.grads[i])) << "m " << m;
    for (size_t i = 0; i < one.losses.size(); ++i)
      EXPECT_TRUE(torch::equal(one.losses[i], two.losses[i])) << "m " << m;
    // Each micro-batch's gradients reach the weights between its own hooks (bf16/fp16 fold
    // them into fp32 in the after-hook).
    ASSERT_EQ(two.at_hooks.size(), static_cast<size_t>(m));
    for (size_t i = 0; i < one.at_hooks.size(); ++i)
      EXPECT_TRUE(torch::equal(one.at_hooks[i], two.at_hooks[i])) << "m " << m << " hook " << i;
    EXPECT_EQ(one.peak, 1);
    EXPECT_EQ(two.peak, 2);
    EXPECT_EQ(at::get_num_threads(), 2);  // each lane's share given back
  }
}

TEST_F(Pairs, MatmulNetsAgreeAndRepeat) {
  for (int64_t m : {2, 3, 5}) {
    torch::manual_seed(11);
    auto one = step(m, false, true);
    torch::manual_seed(11);
    auto a = step(m, true, true);
    torch::manual_seed(11);
    auto b = step(m, true, true);
    for (size_t i = 0; i < one.grads.size(); ++i) {
      EXPECT_TRUE(torch::allclose(one.grads[i], a.grads[i], 1e-5, 1e-5)) << "m " << m;
      EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "m " << m << ": run to run";
    }
  }
}

TEST_F(Pairs, EitherLaneFailingRaisesHere) {
  for (int64_t fail_at : {0, 1, 2}) {
    torch::manual_seed(5);
    try {
      step(3, true, true, fail_at);
      ADD_FAILURE() << "micro-batch " << fail_at << "'s failure was not raised";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("forward failed"), std::string::npos) << e.what();
    }
    EXPECT_EQ(at::get_num_threads(), 2);
  }
}

TEST_F(Pairs, OnlyOneStageSchedulesPair) {
  Group solo("pp", {0}, 0, {});
  Executor zb(solo, make_schedule(plan::PipelineSchedule::kZbH1, 1, 2, 1), {6, 16},
              torch::TensorOptions());
  EXPECT_THROW(zb.pair_microbatches({}), c10::Error);
}

}  // namespace
}  // namespace tessel::parallel::pp
