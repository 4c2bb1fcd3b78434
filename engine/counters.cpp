#include "engine/counters.h"

#include <c10/core/CPUAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <cstring>

namespace tessel {
namespace {

// Counts the bytes the CPU allocator hands out (now and at peak), delegating to the default.
// Installed once per process and never removed: tensors it allocated must find it at release.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& get() {
    static auto* a = new CountingAllocator();  // leaked on purpose (see above)
    return *a;
  }
  c10::DataPtr allocate(size_t n) override {
    auto inner = base_->allocate(n);
    void* data = inner.get();
    const auto device = inner.device();
    auto* ctx = new Ctx{std::move(inner), n, this};
    const int64_t now = now_ += static_cast<int64_t>(n);
    for (int64_t p = peak_; now > p && !peak_.compare_exchange_weak(p, now);) {
    }
    return {data, ctx, &CountingAllocator::release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  int64_t now() const { return now_; }
  int64_t take_peak() { return peak_.exchange(now_.load()); }

 private:
  CountingAllocator() : base_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(this, /*priority=*/100);
  }
  struct Ctx {
    c10::DataPtr inner;
    size_t n;
    CountingAllocator* self;
  };
  static void release(void* p) {
    auto* c = static_cast<Ctx*>(p);
    c->self->now_ -= static_cast<int64_t>(c->n);
    delete c;
  }
  c10::Allocator* base_;
  std::atomic<int64_t> now_{0}, peak_{0};
};

int cuda_index(const torch::Device& d) { return d.index() < 0 ? 0 : d.index(); }

}  // namespace

CpuAllocationCounter& CpuAllocationCounter::get() {
  CountingAllocator::get();  // installed on first use
  static CpuAllocationCounter counter;
  return counter;
}
int64_t CpuAllocationCounter::now() const { return CountingAllocator::get().now(); }
int64_t CpuAllocationCounter::take_peak() { return CountingAllocator::get().take_peak(); }

StepCounters::StepCounters(const parallel::Mesh& mesh, const torch::Device& device)
    : mesh_(mesh), device_(device) {
  if (!device.is_cuda()) CpuAllocationCounter::get();
}

int64_t StepCounters::allocated() const {
  if (device_.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device_))
        .allocated_bytes[0]
        .current;
  return CpuAllocationCounter::get().now();
}

int64_t StepCounters::reset_peak() {
  if (device_.is_cuda()) {
    const int d = cuda_index(device_);
    const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(d).allocated_bytes[0].peak;
    c10::cuda::CUDACachingAllocator::resetPeakStats(d);
    return peak;
  }
  return CpuAllocationCounter::get().take_peak();
}

void StepCounters::begin_step() {
  for (auto k : parallel::all_group_kinds()) {
    const auto& g = mesh_.group(k);
    at_begin_[k] = g.bytes() + g.sent_bytes();
  }
  reset_peak();
  base_ = allocated();
}

void StepCounters::end_step() {
  for (auto k : parallel::all_group_kinds()) {
    const auto& g = mesh_.group(k);
    total_[k] += g.bytes() + g.sent_bytes() - at_begin_[k];
  }
  const int64_t peak = reset_peak();
  // The first step also allocates what lives on (lazy buffers, caches): steady state is the rest.
  if (steps_ == 1 || steps_ == 0) peak_extra_ = 0;
  peak_extra_ = std::max(peak_extra_, peak - base_);
  peak_abs_ = std::max(peak_abs_, peak);
  ++steps_;
}

std::map<std::string, double> StepCounters::comm_bytes_per_step() const {
  std::map<std::string, double> out;
  for (const auto& [k, bytes] : total_)
    out[parallel::group_name(k)] = steps_ ? static_cast<double>(bytes) / steps_ : 0.0;
  return out;
}

}  // namespace tessel
