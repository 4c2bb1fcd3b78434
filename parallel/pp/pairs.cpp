// Executor::run_pairs: a one-stage training step with its micro-batches two at a time on CPU.
// Each of the two lanes runs its micro-batch's forward and backward on half of the intra-op
// threads. On a small CPU model this beats one micro-batch on all threads: each operator's fork,
// join and uneven split over threads is gone, and one thread's matmul is about as fast per core.
//
// The gradients are summed as one at a time sums them. Lane 0 (the calling thread) accumulates into
// the weights' .grad as a one-at-a-time backward does; lane 1's backward returns its gradients
// instead (the engine's outputs, as torch.autograd.grad), added into .grad after the pair, between
// that micro-batch's own hooks (bf16/fp16 fold each micro-batch's gradients into fp32 there): the
// same order for any number of micro-batches, so steps repeat bit for bit. Each micro-batch's
// gradients may still round differently than on all threads where an operator's result depends
// on its thread count (MKL's sgemm does for some shapes).
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/thread_pool.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <future>
#include <mutex>

#include "parallel/pp/executor.h"

namespace tessel::parallel::pp {
namespace {

// The list of a one-stage training schedule: forwards and whole backwards of chunk 0 only.
bool pairable(const Schedule& s) {
  if (s.stages != 1 || s.virtual_stages != 1 || !s.backward) return false;
  for (const auto& a : s.ranks[0])
    if ((a.op != Op::kForward && a.op != Op::kBackward) || a.chunk != 0) return false;
  return true;
}

// Intra-op threads of the calling thread for as long as it lives, then back to what they were.
class Threads {
 public:
  explicit Threads(int n) : before_(at::get_num_threads()) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(before_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int before_;
};

torch::autograd::Edge backward_root(const torch::Tensor& loss) {
  return torch::autograd::impl::gradient_edge(loss);
}

// Where the two lanes meet between forward and backward: both micro-batches' activations are
// then held whole at once, the peak the planner counts, whatever the lanes' relative speed.
class Meeting {
 public:
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (++arrived_ == 2) return cv_.notify_all();
    cv_.wait(lock, [this] { return arrived_ == 2; });
  }
  void arrive() {  // a lane whose forward failed: the other goes on
    std::lock_guard<std::mutex> lock(mutex_);
    if (++arrived_ == 2) cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
};

}  // namespace

Executor::~Executor() = default;

void Executor::pair_microbatches(std::vector<torch::Tensor> weights) {
  TORCH_CHECK(pairable(schedule_),
              "micro-batch pairs need a one-stage schedule of forwards and "
              "whole backwards, not ",
              schedule_.name, " over ", schedule_.stages, " stages");
  TORCH_CHECK(options_.device().is_cpu(), "micro-batch pairs run on CPU only");
  weights_.clear();
  for (auto& w : weights)
    if (w.requires_grad()) weights_.push_back(w);
  lane_ = std::make_unique<c10::ThreadPool>(1);
}

namespace {

// One step's micro-batch passes on two lanes, and lane 1's gradients until they are added.
class PairedStep {
 public:
  PairedStep(const StageFns& fns, std::vector<torch::Tensor>& weights, c10::ThreadPool& lane)
      : fns_(fns), weights_(weights), lane_(lane) {
    outputs_.reserve(weights.size());
    for (const auto& w : weights) outputs_.push_back(torch::autograd::impl::gradient_edge(w));
  }

  // Micro-batch `mb` on this thread with every intra-op thread (the odd one out).
  void alone(int64_t mb) { pass(mb, true, nullptr); }

  // Micro-batches `mb` on this thread and `mb` + 1 on the lane, each on half of the threads.
  void pair(int64_t mb) {
    const int all = at::get_num_threads(), second = all / 2;
    Meeting meeting;
    std::promise<void> done;
    auto lane_done = done.get_future();
    const at::ThreadLocalState state;  // grad mode, the profiler's callbacks, ... of this thread
    lane_.run([&] {
      try {
        const at::ThreadLocalStateGuard same(state);
        Threads n(second);
        pass(mb + 1, false, &meeting);
        done.set_value();
      } catch (...) {
        done.set_exception(std::current_exception());
      }
    });
    {
      Threads n(all - second);
      try {
        pass(mb, true, &meeting);
      } catch (...) {
        lane_done.wait();  // the lane's pass reads this frame: it must end first
        throw;
      }
    }
    lane_done.get();
  }

  // The pair's second micro-batch's gradients into the weights', as its backward would have
  // accumulated them.
  void add_lane_grads() {
    for (size_t i = 0; i < lane_grads_.size(); ++i) {
      if (!lane_grads_[i].defined()) continue;
      auto& grad = weights_[i].mutable_grad();
      if (grad.defined())
        grad.add_(lane_grads_[i]);
      else
        grad = lane_grads_[i];
    }
    lane_grads_.clear();
  }

 private:
  // One micro-batch's forward and backward; lane 1's gradients kept in lane_grads_.
  void pass(int64_t mb, bool into_weights, Meeting* meeting) {
    torch::Tensor loss;
    try {
      loss = fns_.forward(mb, 0, torch::Tensor());
    } catch (...) {
      if (meeting) meeting->arrive();
      throw;
    }
    if (meeting) meeting->arrive_and_wait();
    auto grads = torch::autograd::Engine::get_default_engine().execute(
        {backward_root(loss)}, {torch::ones_like(loss)}, /*keep_graph=*/false,
        /*create_graph=*/false, /*accumulate_grad=*/into_weights,
        into_weights ? std::vector<torch::autograd::Edge>{} : outputs_);
    if (!into_weights) lane_grads_ = std::move(grads);
  }

  const StageFns& fns_;
  std::vector<torch::Tensor>& weights_;
  c10::ThreadPool& lane_;
  std::vector<torch::autograd::Edge> outputs_;
  std::vector<torch::Tensor> lane_grads_;  // per weight: lane 1's, until add_lane_grads()
};

}  // namespace

StepStats Executor::run_pairs(const StageFns& fns) {
  step_.start();
  compute_.start();
  const int64_t m = schedule_.microbatches;
  PairedStep step(fns, weights_, *lane_);
  // Each micro-batch's gradients reach the weights between its own hooks, in micro-batch order
  // (the first of a pair's in its backward, the second's just after the pair).
  auto around = [&](int64_t mb, const std::function<void()>& into_weights) {
    if (fns.before_backward) fns.before_backward(0, mb == m - 1);
    into_weights();
    if (fns.after_backward) fns.after_backward(0, mb == m - 1);
  };
  for (int64_t mb = 0; mb < m; mb += 2) {
    if (mb + 1 == m) {
      around(mb, [&] { step.alone(mb); });
      continue;
    }
    around(mb, [&] { step.pair(mb); });
    around(mb + 1, [&] { step.add_lane_grads(); });
  }
  compute_.stop();
  step_.stop();
  return {m > 1 ? 2 : 1};
}

}  // namespace tessel::parallel::pp
