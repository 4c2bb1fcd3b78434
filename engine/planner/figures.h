// The one peak that step time and MFU are measured against (runtime and --dry-run alike); the
// FLOPs of a step are the parts' declarations (models/flops.h).
#pragma once

#include <torch/types.h>

#include <string>

#include "core/plan/config.h"
#include "models/layers.h"

namespace tessel::planner {

struct Peak {
  double tflops;       // per device
  std::string source;  // where the figure comes from, printed once at start
  bool measured;       // a rate measured at start, not a datasheet peak: a step may beat it
};
/// logging.peak_tflops when set; else the dense peak of known GPUs for the dtype; else (CPU or an
/// unknown GPU) a large matmul measured now in the run's dtype, which the start line says.
Peak device_peak(const plan::Config& c, const torch::Device& device, torch::ScalarType dtype);

}  // namespace tessel::planner
