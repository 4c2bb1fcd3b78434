// What a step is worth: model FLOPs by one convention, and the one peak that step time and MFU
// are measured against (runtime and --dry-run alike).
#pragma once

#include <torch/types.h>

#include <string>

#include "core/plan/config.h"
#include "models/layers.h"

namespace tessel::planner {

/// PaLM (appendix B) training FLOPs per token: 6·N + 12·L·H·Q·T, with N the parameters excluding
/// the input embeddings (the token table counts when it is tied to the head), L layers, H heads,
/// Q head dim, T sequence length. Full attention term, not halved for the causal mask. In a
/// mixture of experts N counts the active parameters: top_k experts per MoE layer.
/// `n`: the global N, summed over pipeline stages from flops_parameters(). `attention_share`:
/// under data.document_mask, the share of a causal sequence's attention the documents keep
/// (planner::document_figures): the attention term counts that share only, so that MFU stays
/// the work done.
double flops_per_token(const models::ModelShape& m, double n, int64_t seq_len,
                       double attention_share = 1.0);
/// This rank's stages' share of N at global shapes (tensor-parallel shards count whole, once;
/// the last stage's copy of a tied token table does not count).
double flops_parameters(models::Decoder& model);
constexpr const char* kFlopsConvention =
    "PaLM 6N + 12·L·H·Q·T per token (N without input embeddings; attention term not halved; "
    "under a document mask, times the share of attention its documents keep)";

struct Peak {
  double tflops;       // per device
  std::string source;  // where the figure comes from, printed once at start
  bool measured;       // a rate measured at start, not a datasheet peak: a step may beat it
};
/// logging.peak_tflops when set; else the dense peak of known GPUs for the dtype; else (CPU or an
/// unknown GPU) a large matmul measured now in the run's dtype, which the start line says.
Peak device_peak(const plan::Config& c, const torch::Device& device, torch::ScalarType dtype);

}  // namespace tessel::planner
