#include "models/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

namespace tessel::models {
namespace {

class RecomputeBackward : public torch::autograd::Node {
 public:
  RecomputeBackward(Piece fn, torch::Tensor input) : fn_(std::move(fn)), input_(std::move(input)) {}
  std::string name() const override { return "tessel::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(fn_, "activation recomputation ran backward twice (retain_graph is not supported)");
    torch::AutoGradMode grad_on(true);
    auto x = input_.detach().requires_grad_(true);
    auto y = fn_(x);
    fn_ = nullptr;
    input_ = torch::Tensor();
    if (grads[0].defined()) torch::autograd::backward({y}, {grads[0]});
    return {x.grad()};
  }

 private:
  Piece fn_;
  torch::Tensor input_;
};

}  // namespace

torch::Tensor recompute(Piece fn, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = fn(x);
  }
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(std::move(fn), x.detach()),
                                                 torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

}  // namespace tessel::models
