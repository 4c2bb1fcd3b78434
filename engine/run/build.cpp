#include "engine/run/build.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>

#include "core/device/cuda.h"
#include "core/kernels/attention_kernels.h"
#include "core/kernels/document_attention.h"
#include "core/observe/counters.h"
#include "engine/io/safetensors.h"
#include "engine/io/weights.h"
#include "engine/run/startup.h"
#include "parallel/cp/attention.h"

namespace tessel::run {

torch::Device resolve_device(plan::TrainDevice device, const parallel::WorldInfo& w,
                             std::string* why) {
  if (device == plan::TrainDevice::kCpu) {  // LibTorch's CUDA half is never loaded
    if (why) *why = "training.device cpu";
    return torch::kCPU;
  }
  const bool cuda = device::cuda_available();
  if (device == plan::TrainDevice::kCuda && !cuda)
    throw plan::UserError("training.device is cuda but no CUDA device can be used: " +
                          device::cuda_unavailable_reason());
  if (!cuda) {
    if (why) *why = "training.device auto, no CUDA device: " + device::cuda_unavailable_reason();
    return torch::kCPU;
  }
  const auto choice =
      plan::choose_cuda_device(static_cast<int>(device::cuda_device_count()), w.local_rank,
                               w.local_world, std::getenv("CUDA_VISIBLE_DEVICES"));
  if (why) *why = choice.why;
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(choice.index)};
}

torch::Tensor to_device(const torch::Tensor& host, const torch::Device& device) {
  return device.is_cuda() ? host.pin_memory().to(device, /*non_blocking=*/true) : host;
}

std::vector<kernels::Documents> micro_batch_documents(const plan::Config& c, int64_t eod,
                                                      const torch::Tensor& host_rows,
                                                      const torch::Device& device) {
  std::vector<kernels::Documents> docs;
  if (eod < 0) return docs;
  const int64_t b = host_rows.size(0), t = host_rows.size(1) - 1, mb = c.training.micro_batch;
  for (int64_t first = 0; first < b; first += mb)
    docs.push_back(kernels::find_documents(
        host_rows.narrow(0, first, std::min(mb, b - first)).narrow(1, 0, t), eod, device));
  return docs;
}

int64_t scored_targets(const torch::Tensor& host_rows, int64_t seq, int64_t eod) {
  const auto ids = host_rows.narrow(1, 0, seq).to(torch::kInt64).contiguous();
  const int64_t* p = ids.const_data_ptr<int64_t>();
  int64_t n = 0;
  for (int64_t i = 0, end = ids.numel(); i < end; ++i) n += p[i] != eod;
  return n;
}

void load_weights_file(models::Decoder& model, const std::string& path, const std::string& key) {
  const io::MappedWeights weights(path, key);  // views: only what this rank keeps is read
  models::load_weights(model, weights.tensors(), weights.source());
}

models::Decoder make_model(const plan::Config& c, const torch::Device& device,
                           torch::ScalarType dtype, parallel::Group* tp,
                           const models::StagePart& stages, parallel::Group* cp,
                           parallel::Group* ep) {
  auto model =
      models::build_model(models::model_shape(c.model), c.run.seed, tp,
                          c.parallel.sequence_parallel, stages, cp, c.parallel.context_method, ep);
  if (!c.model.init_from.empty()) load_weights_file(model, c.model.init_from, "model.init_from");
  model->set_recompute(c.training.recompute);
  model->set_kernels(c.training.kernels);
  model->set_lean_logits(c.training.lean_logits, c.training.lean_logits_chunk);
  if (c.training.fp8 != plan::Fp8::kOff) {
    const auto [fp8, kept] = model->set_fp8(c.training.fp8);
    spdlog::info("fp8: {} linear layers of this rank in float8{}", fp8,
                 kept ? fmt::format("; {} key/value projections replicated over tp (kv_heads < "
                                    "tp) stay in {}",
                                    kept, c.training.dtype.name())
                      : "");
  }
  model->to(device, dtype);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters())  // state that is not trained stays fp32
    if (!p.value().requires_grad()) p.value().set_data(p.value().to(torch::kFloat32));
  return model;
}

void configure_device(const plan::Config& c, const torch::Device& on) {
  if (c.training.threads > 0) torch::set_num_threads(static_cast<int>(c.training.threads));
  if (on.is_cuda()) device::set_tf32(c.training.tf32);
  device::set_deterministic(c.training.deterministic);
  if (c.training.deterministic)
    spdlog::info(
        "training.deterministic: PyTorch's deterministic algorithms (strict), cuDNN "
        "deterministic, CUBLAS_WORKSPACE_CONFIG={}, cuDNN's attention last",
        std::getenv("CUBLAS_WORKSPACE_CONFIG"));
  if (!on.is_cuda()) observe::CpuAllocationCounter::get();  // counts the state from its first byte
}

std::string fp8_matmuls(const plan::Config& c, const torch::Device& device) {
  const plan::Fp8 recipe = c.training.fp8;
  if (recipe == plan::Fp8::kOff) return "";
  const auto m = models::model_shape(c.model);
  const auto& par = c.parallel;
  if (device.is_cuda()) {
    const auto* cuda = device::cuda_module();
    const int cc = cuda ? cuda->compute_capability(device.has_index() ? device.index() : 0) : 0;
    if (cc < 89)
      throw plan::UserError(fmt::format(
          "{}: training.fp8 {}: float8 matmuls need compute capability 8.9 or newer (Ada, Hopper, "
          "Blackwell); this GPU has {}.{}: set training.fp8 off",
          c.source, c.training.fp8.name(), cc / 10, cc % 10));
    const int64_t kv = m.kv_heads >= par.tp ? m.kv_heads * m.head_dim() / par.tp : 0;
    const std::pair<const char*, int64_t> dims[] = {
        {"model.hidden", m.hidden},
        {"model.hidden / parallel.tp (attention's heads per rank)", m.hidden / par.tp},
        {"model.kv_heads x head size / parallel.tp", kv},
        {"model.ffn_hidden / parallel.tp", m.ffn_hidden / par.tp},
        {"model.moe.shared_experts x model.moe.ffn_hidden / parallel.tp",
         m.moe.shared * m.moe.ffn_hidden / par.tp},
        {"training.micro_batch x training.seq_len / parallel.cp (tokens per rank)",
         c.training.micro_batch * c.training.seq_len / par.cp}};
    for (const auto& [what, d] : dims)
      if (d % 16 != 0)
        throw plan::UserError(fmt::format(
            "{}: training.fp8 {}: CUDA's float8 matmuls take dimensions that are multiples of "
            "16; {} is {}",
            c.source, c.training.fp8.name(), what, d));
  }
  return fmt::format(
      "{}: the blocks' linear layers in float8, {} (inputs and weights e4m3, gradients {}); "
      "the embedding, head, norms, router and experts in {}",
      c.training.fp8.name(),
      recipe == plan::Fp8::kTensorwise ? "one scale per tensor" : "one power-of-two scale per row",
      recipe == plan::Fp8::kTensorwise ? "e5m2" : "e4m3", c.training.dtype.name());
}

std::string attention_kernel(const plan::Config& c, const torch::Device& device,
                             torch::ScalarType dtype) {
  const auto m = models::model_shape(c.model);
  const auto& par = c.parallel;
  const bool alltoall = par.cp > 1 && par.context_method == plan::CpMethod::kAllToAll;
  if (par.cp > 1 && !alltoall) {  // allgather and ring run their own block kernels
    return fmt::format("context parallel ({}): {} block kernels", par.context_method.name(),
                       device.is_cuda() ? "memory-efficient" : "flash (CPU)");
  }
  // alltoall: dense attention over the whole sequence for 1/cp of each tp rank's heads.
  const int64_t per_tp = std::max<int64_t>(1, m.kv_heads / par.tp);
  const int64_t carried = alltoall ? parallel::cp::alltoall_kv_heads(per_tp, par.cp) : per_tp;
  const int64_t heads = m.heads / par.tp / (alltoall ? par.cp : 1);
  const int64_t kv = carried / (alltoall ? par.cp : 1);
  if (device.is_cuda() && c.data.document_mask) {  // the variable-length kernels, no fallback
    const auto* cuda = device::cuda_module();
    const int cc = cuda ? cuda->compute_capability(device.has_index() ? device.index() : 0) : 0;
    if (auto why = kernels::document_kernel_unfit(m.head_dim(), dtype, cc); !why.empty())
      throw plan::UserError(fmt::format("{}: data.document_mask: {} ({} heads of size {})",
                                        c.source, why, m.heads, m.head_dim()));
  }
  if (device.is_cuda()) kernels::pin_sdpa_order(dtype, c.training.deterministic);
  const auto kernel =
      kernels::planned_attention_kernel(heads, kv, c.training.seq_len, m.head_dim(), dtype, device,
                                        !alltoall && c.training.kernels == plan::Kernels::kTessel);
  auto line = fmt::format(
      "{}{} ({} heads, {} key/value heads of {} per rank, {}){}",
      alltoall ? "context parallel (alltoall): " : "",
      kernel == "tessel" ? "Tessel's short-sequence CPU kernel" : "SDPA " + kernel + " kernel",
      heads, kv, m.head_dim(), c.training.dtype.name(),
      carried > per_tp ? fmt::format("; {} key/value heads per tp rank repeated x{} to split "
                                     "over cp {}",
                                     per_tp, carried / per_tp, par.cp)
                       : "");
  if (device.is_cuda() && kernel == "math")
    throw plan::UserError(fmt::format(
        "{}: attention would run SDPA's math kernel on CUDA, which holds a [{}, {}] score matrix "
        "per head: {} heads of size {} ({} key/value heads per rank) in {} have no fused kernel "
        "here (flash: bf16/fp16, head size a multiple of 8 up to 256; memory-efficient: any float "
        "dtype, head size a multiple of 8)",
        c.source, c.training.seq_len, c.training.seq_len, heads, m.head_dim(), kv,
        c.training.dtype.name()));
  return line;
}

}  // namespace tessel::run
