#include "models/recompute.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

#include <optional>

#include "parallel/pp/weight_grad.h"

namespace tessel::models {
namespace {

// The random streams a piece may draw from (dropout, say): the CPU generator, and the CUDA
// generator of the input's device when it is on one. Recomputation replays the forward's draws
// (as torch.utils.checkpoint's preserve_rng_state): the states at the first run are restored for
// the rerun, and the streams then continue from where backward found them.
class RngState {
 public:
  explicit RngState(const torch::Device& device) {
    auto cpu = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      cpu_ = cpu.get_state();
    }
    if (device.is_cuda()) {
      cuda_gen_ = at::globalContext().defaultGenerator(device);
      std::lock_guard<std::mutex> lock(cuda_gen_->mutex());
      cuda_ = cuda_gen_->get_state();
    }
  }
  // Sets these states, returning the ones it replaced.
  RngState swap_in() {
    RngState previous = *this;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      previous.cpu_ = gen.get_state();
      gen.set_state(cpu_);
    }
    if (cuda_gen_) {
      std::lock_guard<std::mutex> lock(cuda_gen_->mutex());
      previous.cuda_ = cuda_gen_->get_state();
      cuda_gen_->set_state(cuda_);
    }
    return previous;
  }

 private:
  at::Tensor cpu_, cuda_;
  std::optional<at::Generator> cuda_gen_;
};

thread_local bool t_recomputing = false;

// Marks this thread as rerunning for its lifetime (restored after, even on a throw).
class Rerun {
 public:
  Rerun() : was_(t_recomputing) { t_recomputing = true; }
  ~Rerun() { t_recomputing = was_; }
  Rerun(const Rerun&) = delete;
  Rerun& operator=(const Rerun&) = delete;

 private:
  bool was_;
};

class RecomputeBackward : public torch::autograd::Node {
 public:
  RecomputeBackward(Piece fn, torch::Tensor input, RngState rng)
      : fn_(std::move(fn)), input_(std::move(input)), rng_(std::move(rng)) {}
  std::string name() const override { return "tessel::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(fn_, "activation recomputation ran backward twice (retain_graph is not supported)");
    torch::AutoGradMode grad_on(true);
    auto x = input_.detach().requires_grad_(true);
    torch::Tensor y;
    {
      RngState after = rng_->swap_in();  // the forward's draws again
      Rerun rerun;
      y = fn_(x);
      after.swap_in();
    }
    // Nothing the rerun needed stays with this node, which a zero-bubble B's deferred weight
    // gradients may keep alive until its W.
    fn_ = nullptr;
    input_ = torch::Tensor();
    rng_.reset();
    if (!grads[0].defined()) return {torch::Tensor()};
    // A zero-bubble B: the input's gradient now, the weights' left in the store for W.
    if (parallel::pp::deferring())
      return {
          parallel::pp::backward_input(torch::autograd::impl::gradient_edge(y), grads[0], {x})[0]};
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad()};
  }

 private:
  Piece fn_;
  torch::Tensor input_;
  std::optional<RngState> rng_;
};

}  // namespace

bool recomputing() { return t_recomputing; }

double piece_rng_state_bytes() {
  static const double bytes =
      static_cast<double>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
  return bytes;
}

torch::Tensor recompute(Piece fn, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  RngState rng(x.device());  // before fn draws anything
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = fn(x);
  }
  auto node = std::shared_ptr<RecomputeBackward>(
      new RecomputeBackward(std::move(fn), x.detach(), std::move(rng)),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

}  // namespace tessel::models
