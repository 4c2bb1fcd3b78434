#include "models/mlp.h"

namespace tessel::models {

const MlpForm& mlp_form(MlpKind kind) {
  switch (kind) {
    case MlpKind::kGeluTanh:
      return gelu_tanh_mlp();
    case MlpKind::kSwiGlu:
      return swiglu_mlp();
  }
  return gelu_tanh_mlp();  // unreachable: every kind has its case (-Werror=switch)
}

}  // namespace tessel::models
