#include "models/mlp.h"

#include <stdexcept>

namespace tessel::models {

const MlpForm& mlp_form(plan::Mlp kind) {
  switch (kind) {
    case plan::Mlp::kGeluTanh:
      return gelu_tanh_mlp();
    case plan::Mlp::kSwiGlu:
      return swiglu_mlp();
    case plan::Mlp::kRelu2:
      return relu2_mlp();
    case plan::Mlp::kAuto:
      break;
  }
  // Every architecture resolves auto to its own form (its options: resolved_mlp).
  throw std::logic_error("mlp_form: model.mlp auto reached a layer unresolved");
}

}  // namespace tessel::models
