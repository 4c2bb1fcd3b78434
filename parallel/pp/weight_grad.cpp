#include "parallel/pp/weight_grad.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace tessel::parallel::pp {
namespace {

std::atomic<WeightGrads*> active{nullptr};
std::mutex adding;  // backward's threads (one per device) hand gradients over one at a time

// dx, dW (now, or left for W) and db of y = x·wᵀ + b from the output's gradient `g`.
torch::autograd::variable_list linear_backward(torch::autograd::AutogradContext* ctx,
                                               const torch::Tensor& g, bool bias) {
  const auto saved = ctx->get_saved_variables();
  const auto &x = saved[0], &w = saved[1];
  torch::Tensor dx, dw, db;
  if (ctx->needs_input_grad(0)) dx = g.matmul(w);
  auto g2 = g.reshape({-1, g.size(-1)});
  if (bias && ctx->needs_input_grad(2)) db = g2.sum(0);
  if (ctx->needs_input_grad(1)) {
    auto x2 = x.reshape({-1, x.size(-1)});
    WeightGrads* store = ctx->saved_data["deferrable"].toBool() ? deferring() : nullptr;
    if (store && w.is_leaf())  // W: the matmul, on the tensors B kept for it
      store->defer(w, [g2, x2] { return g2.t().mm(x2); });
    else
      dw = g2.t().mm(x2);
  }
  if (bias) return {dx, dw, db, torch::Tensor()};
  return {dx, dw, torch::Tensor()};
}

// (A C++ autograd function takes no undefined tensor: one with a bias, one without.)
class LinearFn : public torch::autograd::Function<LinearFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, const torch::Tensor& b, bool deferrable) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["deferrable"] = deferrable;
    return at::linear(x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_backward(ctx, grads[0], true);
  }
};

class LinearNoBiasFn : public torch::autograd::Function<LinearNoBiasFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, bool deferrable) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["deferrable"] = deferrable;
    return at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return linear_backward(ctx, grads[0], false);
  }
};

// y = x·wᵀ with its three matmuls in float8; x and w kept as linear's are, with their scales.
class Fp8LinearFn : public torch::autograd::Function<Fp8LinearFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, bool deferrable,
                               const kernels::fp8::Spec* spec) {
    kernels::fp8::Kept kept;
    auto y = kernels::fp8::forward(*spec, x.reshape({-1, x.size(-1)}), w, kept);
    ctx->save_for_backward({x, w, kept.x_scale, kept.w_scale});
    ctx->saved_data["deferrable"] = deferrable;
    ctx->saved_data["spec"] = reinterpret_cast<intptr_t>(spec);  // the layer's: outlives backward
    auto shape = x.sizes().vec();
    shape.back() = w.size(0);
    return at::_unsafe_view(y, shape);  // not a view: a tensor-parallel reduction writes into it
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1];
    const kernels::fp8::Kept kept{saved[2], saved[3]};
    const auto* spec = reinterpret_cast<const kernels::fp8::Spec*>(
        static_cast<intptr_t>(ctx->saved_data["spec"].toInt()));
    const auto& g = grads[0];
    const auto grad = kernels::fp8::grad_of(*spec, g.reshape({-1, g.size(-1)}));
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0))
      dx = kernels::fp8::grad_input(*spec, grad, w, kept).view(x.sizes());
    if (ctx->needs_input_grad(1)) {
      auto x2 = x.reshape({-1, x.size(-1)});
      auto make = [spec, grad, x2, kept, dtype = w.scalar_type()] {
        return kernels::fp8::grad_weight(*spec, grad, x2, kept).to(dtype);
      };
      WeightGrads* store = ctx->saved_data["deferrable"].toBool() ? deferring() : nullptr;
      if (store && w.is_leaf())
        store->defer(w, make);
      else
        dw = make();
    }
    return {dx, dw, torch::Tensor(), torch::Tensor()};
  }
};

// W hands a gradient to its parameter as a backward's engine would, without a graph task of its
// own: the parameter's tensor hooks and its accumulator's pre-hooks on the gradient, the
// accumulator (which adds it into .grad, stealing it where it can, and runs the post-accumulate
// hooks: the data-parallel reducer's), then its post-hooks. On this thread and its current
// stream, where W's matmuls ran: no hand-over to the device's autograd thread and back.
void accumulate(const torch::Tensor& param, torch::Tensor grad) {
  torch::NoGradGuard no_grad;  // as the engine runs a backward without create_graph
  const auto acc = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(acc, "zero-bubble W: a gradient for a tensor that is not a leaf needing one");
  torch::autograd::variable_list grads{std::move(grad)};
  for (const auto& hook : acc->tensor_pre_hooks()) grads = (*hook)(grads);
  for (const auto& [i, hook] : acc->retains_grad_hooks()) grads = (*hook)(grads);
  for (const auto& hook : acc->pre_hooks()) grads = (*hook)(grads);
  if (acc->post_hooks().empty()) {
    (*acc)(std::move(grads));
    return;
  }
  const auto inputs = grads;
  const auto outputs = (*acc)(std::move(grads));
  for (const auto& hook : acc->post_hooks()) (*hook)(outputs, inputs);
}

}  // namespace

void WeightGrads::add(const torch::Tensor& param, torch::Tensor grad) {
  std::lock_guard<std::mutex> lock(adding);
  items_.push_back({param, std::move(grad), nullptr});
}

void WeightGrads::defer(const torch::Tensor& param, std::function<torch::Tensor()> grad) {
  std::lock_guard<std::mutex> lock(adding);
  items_.push_back({param, torch::Tensor(), std::move(grad)});
}

void WeightGrads::deliver() {
  // Grouped by parameter (in first-seen order), then each parameter's gradient computed, summed
  // in item order and accumulated on its own: one parameter's gradient lives at a time, not the
  // whole chunk's (W's transient memory is its largest parameter, not its weights), and each
  // parameter's hooks fire once, as they would in a plain backward. No autograd graph task runs:
  // each gradient goes straight to its parameter's accumulator (accumulate above).
  std::vector<std::vector<size_t>> by_param;
  std::unordered_map<const void*, size_t> at;
  for (size_t i = 0; i < items_.size(); ++i) {
    auto [it, fresh] = at.emplace(items_[i].param.unsafeGetTensorImpl(), by_param.size());
    if (fresh) by_param.emplace_back();
    by_param[it->second].push_back(i);
  }
  for (const auto& indices : by_param) {
    torch::Tensor grad;
    {
      torch::NoGradGuard no_grad;
      for (size_t i : indices) {
        auto& item = items_[i];
        auto g = item.later ? item.later() : std::move(item.grad);
        item.later = nullptr;
        if (g.defined()) grad = grad.defined() ? grad + g : std::move(g);
      }
    }
    if (grad.defined()) accumulate(items_[indices.front()].param, std::move(grad));
  }
  items_.clear();
}

Deferring::Deferring(WeightGrads& store) {
  WeightGrads* none = nullptr;
  TORCH_CHECK(active.compare_exchange_strong(none, &store),
              "zero-bubble backward: a weight-gradient store is already active");
}

Deferring::~Deferring() { active = nullptr; }

WeightGrads* deferring() { return active.load(); }

std::vector<torch::Tensor> backward_input(const torch::autograd::Edge& root,
                                          const torch::Tensor& grad,
                                          const std::vector<torch::Tensor>& inputs) {
  WeightGrads* store = deferring();
  TORCH_CHECK(store, "zero-bubble backward: backward_input outside a Deferring scope");
  // Every leaf below the root: its accumulator's edge.
  torch::autograd::edge_list leaves;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{root.function.get()};
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    for (const auto& e : node->next_edges()) {
      if (!e.is_valid() || !seen.insert(e.function.get()).second) continue;
      if (dynamic_cast<torch::autograd::AccumulateGrad*>(e.function.get()))
        leaves.push_back(e);
      else
        todo.push_back(e.function.get());
    }
  }
  auto grads = torch::autograd::Engine::get_default_engine().execute(
      {root}, {grad}, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false,
      leaves);
  std::vector<torch::Tensor> out(inputs.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    const auto& var =
        static_cast<torch::autograd::AccumulateGrad*>(leaves[i].function.get())->variable;
    bool input = false;
    for (size_t j = 0; j < inputs.size(); ++j)
      if (inputs[j].defined() && inputs[j].unsafeGetTensorImpl() == var.unsafeGetTensorImpl())
        out[j] = grads[i], input = true;
    if (!input && grads[i].defined()) store->add(var, grads[i]);
  }
  return out;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                     bool deferrable, const kernels::fp8::Spec* fp8) {
  if (fp8 && fp8->recipe != kernels::fp8::Recipe::kOff) {
    auto y = Fp8LinearFn::apply(x, w, deferrable, fp8);
    return b.defined() ? y + b : y;
  }
  return b.defined() ? LinearFn::apply(x, w, b, deferrable)
                     : LinearNoBiasFn::apply(x, w, deferrable);
}

}  // namespace tessel::parallel::pp
