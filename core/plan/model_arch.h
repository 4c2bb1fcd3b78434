// model.arch's values, apart from the rest of the plan: models/shape.h carries the architecture
// too, and models/registry.h finds each one's builder and Hugging Face mapping by it.
#pragma once

#include <string>
#include <vector>

namespace tessel::plan {

enum class ModelArch { kGpt2, kLlama };
inline const std::vector<std::string>& choice_names(ModelArch) {
  static const std::vector<std::string> n{"gpt2", "llama"};
  return n;
}

}  // namespace tessel::plan
