// Every enumerated plan key (a Choice<E>, choice.h): its enum and, beside it, its names in the
// enum's order, declared once. The YAML reader, the errors, --help-config,
// docs/configuration.md and the resolved-plan dump read the names here; code compares the enum,
// so a new value is found by the compiler at every switch and comparison. Light (no plan
// structs), so models/shape.h carries ModelArch from here.
#pragma once

#include <string>
#include <vector>

namespace tessel::plan {

using Names = std::vector<std::string>;

// model.arch
enum class ModelArch { kGpt2, kLlama };
inline const Names& choice_names(ModelArch) {
  static const Names n{"gpt2", "llama"};
  return n;
}

// model.mlp // kAuto: the architecture's form (models/registry.h features)
enum class Mlp { kAuto, kGeluTanh, kSwiGlu, kRelu2 };
inline const Names& choice_names(Mlp) {
  static const Names n{"auto", "gelu_tanh", "swiglu", "relu2"};
  return n;
}

// parallel.pipeline.schedule
enum class PipelineSchedule { kGpipe, k1F1B, kInterleaved, kZbH1, kZbv };
inline const Names& choice_names(PipelineSchedule) {
  static const Names n{"gpipe", "1f1b", "interleaved", "zb-h1", "zbv"};
  return n;
}

// parallel.context.method
enum class CpMethod { kAllGather, kRing, kAllToAll, kHybrid };
inline const Names& choice_names(CpMethod) {
  static const Names n{"allgather", "ring", "alltoall", "hybrid"};
  return n;
}

// parallel.backend
enum class Backend { kAuto, kGloo, kNccl };
inline const Names& choice_names(Backend) {
  static const Names n{"auto", "gloo", "nccl"};
  return n;
}

// training.recompute
enum class Recompute { kNone, kSelective, kFull };
inline const Names& choice_names(Recompute) {
  static const Names n{"none", "selective", "full"};
  return n;
}

// training.fp8
enum class Fp8 { kOff, kTensorwise, kRowwise };
inline const Names& choice_names(Fp8) {
  static const Names n{"off", "tensorwise", "rowwise"};
  return n;
}

// training.kernels
enum class Kernels { kTessel, kTorch };
inline const Names& choice_names(Kernels) {
  static const Names n{"tessel", "torch"};
  return n;
}

// training.schedule.decay
enum class Decay { kCosine, kLinear, kConstant };
inline const Names& choice_names(Decay) {
  static const Names n{"cosine", "linear", "constant"};
  return n;
}

// data.format
enum class DataFormat { kText, kMegatron, kTokens };
inline const Names& choice_names(DataFormat) {
  static const Names n{"text", "megatron", "tokens"};
  return n;
}

// data.order
enum class DataOrder { kTessel, kMegatron };
inline const Names& choice_names(DataOrder) {
  static const Names n{"tessel", "megatron"};
  return n;
}

// data.token_dtype
enum class TokenDtype { kUint16, kUint32 };
inline const Names& choice_names(TokenDtype) {
  static const Names n{"uint16", "uint32"};
  return n;
}

// model.moe.router.score
enum class RouterScore { kSoftmax, kSigmoid };
inline const Names& choice_names(RouterScore) {
  static const Names n{"softmax", "sigmoid"};
  return n;
}

// model.tie_embeddings // kAuto resolved at load, by arch
enum class TieEmbeddings { kAuto, kTrue, kFalse };
inline const Names& choice_names(TieEmbeddings) {
  static const Names n{"auto", "true", "false"};
  return n;
}

// training.device
enum class TrainDevice { kAuto, kCpu, kCuda };
inline const Names& choice_names(TrainDevice) {
  static const Names n{"auto", "cpu", "cuda"};
  return n;
}

// parallel.order // the one order the mesh builds (parallel/mesh.h)
enum class RankOrder { kTpCpDpPp };
inline const Names& choice_names(RankOrder) {
  static const Names n{"tp-cp-dp-pp"};
  return n;
}

// training.dtype // kAuto resolved at load
enum class Dtype { kAuto, kFp32, kBf16, kFp16 };
inline const Names& choice_names(Dtype) {
  static const Names n{"auto", "fp32", "bf16", "fp16"};
  return n;
}

/// The plan's name of a value ("zb-h1" for PipelineSchedule::kZbH1).
template <class E>
const std::string& name_of(E e) {
  return choice_names(e)[static_cast<size_t>(e)];
}

}  // namespace tessel::plan
