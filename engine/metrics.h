// What a step costs and achieves, printed the way the anchors print it, and metrics.jsonl.
#pragma once

#include <torch/types.h>

#include <cstdio>
#include <string>

#include "engine/config.h"
#include "models/layers.h"

#include <memory>

#include "engine/tensorboard.h"

namespace tessel {

/// PaLM (appendix B) training FLOPs per token: 6·N + 12·L·H·Q·T, with N the parameters excluding
/// the input embeddings (the token table counts when it is tied to the head), L layers, H heads,
/// Q head dim, T sequence length. Full attention term, not halved for the causal mask.
/// `n`: the global N, summed over pipeline stages from flops_parameters().
double flops_per_token(const ModelConfig& m, double n, int64_t seq_len);
/// This rank's stages' share of N at global shapes (tensor-parallel shards count whole, once;
/// the last stage's copy of a tied token table does not count).
double flops_parameters(models::Decoder& model);
constexpr const char* kFlopsConvention =
    "PaLM 6N + 12·L·H·Q·T per token (N without input embeddings; attention term not halved)";

struct Peak {
  double tflops;       // per device
  std::string source;  // where the figure comes from, printed once at start
  bool measured;       // a rate measured at start, not a datasheet peak: a step may beat it
};
/// logging.peak_tflops when set; else the dense peak of known GPUs for the dtype; else (CPU or an
/// unknown GPU) a large matmul measured now in the run's dtype, which the start line says.
Peak device_peak(const Config& c, const torch::Device& device, torch::ScalarType dtype);

/// Bytes in use: CUDA peak allocated since the last call, or the process's resident set on CPU.
int64_t memory_bytes(const torch::Device& device);
/// The process's peak resident set so far (VmHWM), bytes.
int64_t peak_rss_bytes();

struct StepLine {
  int64_t step, steps;
  double loss, lr, grad_norm, ms_per_step, tokens_per_s, tflops_per_device, mfu;
  int64_t mem_bytes;
  double eta_s;
  double comm_exposed_ms;  // gradient reduction not hidden behind backward (host-side wait)
  double loss_scale;       // fp16's dynamic scale (1 otherwise)
  int64_t skipped_steps;   // fp16 steps skipped for overflowing gradients, so far
  int64_t world;           // processes: tokens_per_s is per device, × world is global
  int64_t samples;         // sequences consumed since the start of training (resumes included)
  int64_t tokens;          // target tokens consumed (samples × seq_len)
  double elapsed_s;        // since this process started training
};

/// Appends to <output_dir>/<metrics_file> (one JSON object per line) and prints the console line.
class MetricsLog {
 public:
  /// Opens the metrics file; a resumed run (resumed_step > 0) keeps the lines of steps up to it
  /// and drops the rest (steps the interrupted run logged after its last checkpoint).
  MetricsLog(const Config& c, int64_t resumed_step);
  ~MetricsLog();
  void step(const StepLine& s);
  void eval(int64_t step, double val_loss, double ms, int64_t tokens);

 private:
  void write_line(const std::string& line);  // throws UserError when the file cannot be written
  FILE* f_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;  // logging.tensorboard
  std::string path_;
};

}  // namespace tessel
