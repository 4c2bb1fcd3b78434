#include "engine/run/step_counters.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/observe/host_reads.h"

namespace tessel::run {
namespace {

int cuda_index(const torch::Device& d) { return d.index() < 0 ? 0 : d.index(); }

}  // namespace

StepCounters::StepCounters(const parallel::Mesh& mesh, const torch::Device& device)
    : mesh_(mesh), device_(device) {
  if (!device.is_cuda()) observe::CpuAllocationCounter::get();
  if (const char* v = std::getenv("TESSEL_COUNT_HOST_READS"))
    if (std::strcmp(v, "1") == 0 || std::strcmp(v, "trace") == 0)
      observe::count_host_reads(std::strcmp(v, "trace") == 0);
}

int64_t StepCounters::allocated() const {
  if (device_.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device_))
        .allocated_bytes[0]
        .current;
  return observe::CpuAllocationCounter::get().now();
}

int64_t StepCounters::reset_peak() {
  if (device_.is_cuda()) {
    const int d = cuda_index(device_);
    const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(d).allocated_bytes[0].peak;
    c10::cuda::CUDACachingAllocator::resetPeakStats(d);
    return peak;
  }
  return observe::CpuAllocationCounter::get().take_peak();
}

void StepCounters::begin_step() {
  for (auto k : parallel::all_group_kinds()) {
    const auto& g = mesh_.group(k);
    at_begin_[k] = g.bytes() + g.sent_bytes();
  }
  reset_peak();
  base_ = allocated();
  reads_at_begin_ = observe::host_reads();
}

void StepCounters::end_step(bool host_ran) {
  if (host_ran) {
    for (auto k : parallel::all_group_kinds()) {
      const auto& g = mesh_.group(k);
      total_[k] += g.bytes() + g.sent_bytes() - at_begin_[k];
    }
    ++host_steps_;
  }
  const int64_t peak = reset_peak();
  // The first step also allocates what lives on (lazy buffers, caches): steady state is the rest.
  if (steps_ == 1 || steps_ == 0) peak_extra_ = reads_ = 0;
  peak_extra_ = std::max(peak_extra_, peak - base_);
  reads_ = std::max(reads_, observe::host_reads() - reads_at_begin_);
  peak_abs_ = std::max(peak_abs_, peak);
  ++steps_;
}

std::map<std::string, double> StepCounters::comm_bytes_per_step() const {
  std::map<std::string, double> out;
  for (const auto& [k, bytes] : total_)
    out[parallel::group_name(k)] = host_steps_ ? static_cast<double>(bytes) / host_steps_ : 0.0;
  return out;
}

}  // namespace tessel::run
