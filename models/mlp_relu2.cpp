// The squared-ReLU MLP (Primer, So et al. 2021; Nemotron-4): down(ReLU(up(x))^2), up with its bias
// where the architecture has biases. LibTorch's operators either way: ReLU and the square are one
// cheap pass each, with no kernel of Tessel's to fuse them.
#include <torch/torch.h>

#include "models/mlp.h"

namespace tessel::models {
namespace {

class Relu2 final : public MlpForm {
 public:
  bool gated() const override { return false; }
  torch::Tensor hidden(const torch::Tensor& x, parallel::tp::ColumnParallelLinearImpl& up,
                       parallel::tp::ColumnParallelLinearImpl*, bool) const override {
    return torch::square(torch::relu(up.forward_entered(x)));
  }
  // The ReLU's output (its own backward's and the square's input) and the square's (down's
  // input); up's output is freed once the ReLU has read it. Backward: the square's gradient
  // (2·r·grad) exists beside down's input gradient and the ReLU's result: one ffn-wide tensor
  // more than a one-pass activation. Both measured with the counting allocator against GELU's
  // MLP on the same plan (gpt2, pp 2, 1F1B; CPU fp32, 2-core EPYC, 2026-11-29): the same peak on
  // the last stage, 4096 floats (tokens x ffn) more at the first stage's backward.
  double kept_per_ffn(bool) const override { return 2.0; }
  double backward_extra_per_ffn(bool) const override { return 1.0; }
  void activation_pass(bool, const torch::Tensor& up, const torch::Tensor&,
                       const torch::Tensor& grad, const torch::Tensor&) const override {
    auto r = at::relu(up);  // forward: ReLU, square; backward: the square's, then the ReLU's
    auto y = at::square(r);
    at::threshold_backward(grad * r * 2, r, 0);
  }
};

}  // namespace

const MlpForm& relu2_mlp() {
  static const Relu2 form;
  return form;
}

}  // namespace tessel::models
