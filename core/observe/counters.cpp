#include "core/observe/counters.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>

namespace tessel::observe {
namespace {

thread_local Held current_held = Held::kOther;

// Counts the bytes the CPU allocator hands out (now and at peak). Installed once per process and
// never removed: tensors it allocated must find it at release.
//
// Its DataPtrs are plain (context == data, with raw_deleter()), as the default CPU allocator's
// are: oneDNN's bf16 matmul allocates through Allocator::raw_allocate, which requires that. The
// size lives in a header of one alignment unit in front of the block, so release needs no lookup.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& get() {
    static auto* a = new CountingAllocator();  // leaked on purpose (see above)
    return *a;
  }
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &CountingAllocator::release, cpu};
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    const int held = static_cast<int>(current_held);
    std::memcpy(base + sizeof(size_t), &held, sizeof held);
    held_[held] += static_cast<int64_t>(n);
    void* data = base + kHeader;
    const int64_t now = now_ += static_cast<int64_t>(n);
    for (int64_t p = peak_; now > p && !peak_.compare_exchange_weak(p, now);) {
    }
    for (int64_t p = probe_; now > p && !probe_.compare_exchange_weak(p, now);) {
    }
    return {data, data, &CountingAllocator::release, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  int64_t now() const { return now_; }
  int64_t take_peak() { return peak_.exchange(now_.load()); }
  int64_t probe(const std::function<void()>& fn) {
    const int64_t before = now_.load(), step_peak = peak_.load();
    probe_.store(before);
    fn();
    const int64_t most = probe_.load();
    peak_.store(std::max(step_peak, now_.load()));  // the probe is no step's peak
    return most - before;
  }
  int64_t live(Held what) const { return held_[static_cast<int>(what)]; }

 private:
  // One alignment unit keeps the data as aligned as alloc_cpu's blocks (c10::gAlignment); it
  // holds the size, then what the block holds (Held).
  static constexpr size_t kHeader = c10::gAlignment;
  static_assert(kHeader >= sizeof(size_t) + sizeof(int));
  CountingAllocator() { c10::SetCPUAllocator(this, /*priority=*/100); }
  static void release(void* data) {
    if (!data) return;
    char* base = static_cast<char*>(data) - kHeader;
    const auto n = static_cast<int64_t>(*reinterpret_cast<size_t*>(base));
    int held = 0;
    std::memcpy(&held, base + sizeof(size_t), sizeof held);
    get().held_[held] -= n;
    get().now_ -= n;
    c10::free_cpu(base);
  }
  std::atomic<int64_t> now_{0}, peak_{0}, probe_{0};
  std::atomic<int64_t> held_[static_cast<int>(Held::kCount)] = {};
};

}  // namespace

CpuAllocationCounter& CpuAllocationCounter::get() {
  CountingAllocator::get();  // installed on first use
  static CpuAllocationCounter counter;
  return counter;
}
int64_t CpuAllocationCounter::now() const { return CountingAllocator::get().now(); }
int64_t CpuAllocationCounter::take_peak() { return CountingAllocator::get().take_peak(); }
int64_t CpuAllocationCounter::peak_during(const std::function<void()>& fn) {
  return CountingAllocator::get().probe(fn);
}
int64_t CpuAllocationCounter::live(Held what) const { return CountingAllocator::get().live(what); }

HeldAs::HeldAs(Held what) : before_(current_held) { current_held = what; }
HeldAs::~HeldAs() { current_held = before_; }

}  // namespace tessel::observe
