// What a step costs and achieves, printed the way the anchors print it, and metrics.jsonl.
#pragma once

#include <torch/types.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <memory>

#include "core/observe/tensorboard.h"
#include "core/plan/config.h"

namespace tessel::observe {

/// Bytes in use: CUDA peak allocated since the last call, or the process's resident set on CPU.
int64_t memory_bytes(const torch::Device& device);
/// The process's peak resident set so far (VmHWM), bytes.
int64_t peak_rss_bytes();

/// A mixture of experts' figures of the logged step, over every MoE layer and rank.
struct MoeFigures {
  bool on = false;
  double aux_loss = 0;  // the balance loss (before its coefficient), summed over MoE layers
  double load_max = 0;  // the busiest expert's choices / the mean, worst MoE layer
  double dropped = 0;   // fraction of (token, expert) choices dropped by the capacity factor
  std::vector<double> tokens_per_expert;  // choices routed to each expert, summed over layers
};

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
  MoeFigures moe;
  std::vector<int64_t> blend_samples;  // data.blend: samples each dataset gave so far (else empty)
};

/// Appends to <output_dir>/<metrics_file> (one JSON object per line) and prints the console line.
class MetricsLog {
 public:
  /// Opens the metrics file; a resumed run (resumed_step > 0) keeps the lines of steps up to it
  /// and drops the rest (steps the interrupted run logged after its last checkpoint).
  MetricsLog(const plan::Config& c, int64_t resumed_step);
  ~MetricsLog();
  void step(const StepLine& s);
  /// `by_dataset`: each validation dataset's loss under its plan key, when there are several
  /// (val_loss is then their weighted mean).
  void eval(int64_t step, double val_loss, double ms, int64_t tokens,
            const std::vector<std::pair<std::string, double>>& by_dataset = {});

 private:
  void write_line(const std::string& line);  // throws UserError when the file cannot be written
  FILE* f_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;  // logging.tensorboard
  std::string path_;
};

}  // namespace tessel::observe
