// The training run: components are built once (device, model, optimizer, data, metrics,
// checkpoints); train() loops over steps; train_step() runs the micro-batches of one global batch.
#pragma once

#include <torch/types.h>

#include <memory>

#include "engine/config.h"
#include "engine/data.h"
#include "engine/metrics.h"
#include "engine/optim.h"
#include "models/registry.h"

namespace tessel {

/// training.device resolved: auto -> cuda when available. Throws UserError for cuda without one.
torch::Device resolve_device(const std::string& device);
torch::ScalarType resolve_dtype(const std::string& dtype);

/// Builds the plan's model on `device` in `dtype`: seeded init, or model.init_from.
models::Decoder make_model(const Config& c, const torch::Device& device, torch::ScalarType dtype);

/// Mean next-token loss of rows [b, T+1] (inputs = row[:-1], targets = row[1:]) as a device
/// scalar: sum of token losses (fp32 logits) times `scale`. The one loss rule lives here.
torch::Tensor token_loss_sum(models::Decoder& model, const torch::Tensor& rows);

class Trainer {
 public:
  explicit Trainer(Config c);
  void train();

 private:
  struct StepOut {
    torch::Tensor loss, grad_norm;  // device scalars: read only when logging
  };
  StepOut train_step(int64_t step);
  double evaluate();
  void log_step(int64_t step, const StepOut& out);

  Config c_;
  torch::Device device_;
  torch::ScalarType dtype_;
  models::Decoder model_{nullptr};
  std::unique_ptr<FlatAdamW> opt_;
  std::unique_ptr<data::Dataset> data_;
  std::unique_ptr<MetricsLog> metrics_;
  double flops_per_token_ = 0;
  Peak peak_;
  // Timing between logged steps: the loss read at a log step is the only host sync.
  std::chrono::steady_clock::time_point last_log_time_, start_time_;
  int64_t last_log_step_ = 0;
  int64_t first_step_ = 1;  // > 1 when resumed
  int64_t consumed_ = 0;    // the data position: global samples consumed so far
};

}  // namespace tessel
