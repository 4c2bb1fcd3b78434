#include "core/observe/host_reads.h"

#include <ATen/record_function.h>
#include <c10/util/Backtrace.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace tessel::observe {
namespace {

std::atomic<int64_t> g_reads{0};
std::atomic<bool> g_counting{false};
bool g_trace = false;          // count_host_reads(true): each read logged with its stack
thread_local int t_depth = 0;  // operators of this thread under way

// Operators whose result depends on tensor values read on the host (on CUDA each waits for the
// device). item() is aten::item over aten::_local_scalar_dense: counted once, as the outer one.
bool reads_on_host(const char* op) {
  static const char* const kOps[] = {"aten::item",
                                     "aten::_local_scalar_dense",
                                     "aten::nonzero",
                                     "aten::masked_select",
                                     "aten::_unique2",
                                     "aten::unique_dim",
                                     "aten::unique_consecutive"};
  for (const char* k : kOps)
    if (std::strcmp(op, k) == 0) return true;
  return false;
}

// A copy between the host and a device that the host waits for: aten::_to_copy (t.to(device))
// or aten::copy_ without non_blocking, with one side on the CPU and the other not. A CUDA copy
// from pageable host memory, or to it, returns only once the device has reached it.
bool blocking_device_copy(const at::RecordFunction& fn) {
  const bool to_copy = std::strcmp(fn.name(), "aten::_to_copy") == 0;
  if (!to_copy && std::strcmp(fn.name(), "aten::copy_") != 0) return false;
  const auto inputs = fn.inputs();
  if (inputs.size() < 3 || !inputs[0].isTensor()) return false;
  const auto& a = inputs[0].toTensor();
  if (!a.defined()) return false;
  c10::Device to = a.device();
  bool non_blocking = false;
  if (to_copy) {  // (self, dtype, layout, device, pin_memory, non_blocking, memory_format)
    if (inputs.size() < 6 || !inputs[3].isDevice()) return false;
    to = inputs[3].toDevice();
    non_blocking = inputs[5].isBool() && inputs[5].toBool();
    return !non_blocking && a.device().is_cpu() != to.is_cpu();
  }
  // copy_(self, src, non_blocking): src into self
  if (!inputs[1].isTensor() || !inputs[1].toTensor().defined()) return false;
  non_blocking = inputs[2].isBool() && inputs[2].toBool();
  return !non_blocking && inputs[1].toTensor().device().is_cpu() != to.is_cpu();
}

}  // namespace

torch::Tensor read_on_host(const torch::Tensor& t) {
  g_reads.fetch_add(1, std::memory_order_relaxed);
  if (g_trace) spdlog::warn("host read: read_on_host\n{}", c10::get_backtrace(1, 24));
  ++t_depth;  // counted here, once: the copy inside is not counted again
  auto host = t.cpu();
  --t_depth;
  return host;
}

int64_t host_reads() { return g_reads.load(std::memory_order_relaxed); }

void count_host_reads(bool trace) {
  static std::once_flag once;
  std::call_once(once, [trace] {
    g_trace = trace;
    // Only operators called from outside any other: the CPU kernels of operators that read
    // nothing on the host on CUDA (fused AdamW's learning rate, grouped matmul's offsets) read
    // their tensors' values inside, which a GPU run never waits on.
    at::addGlobalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (t_depth++ == 0 && (reads_on_host(fn.name()) || blocking_device_copy(fn))) {
                g_reads.fetch_add(1, std::memory_order_relaxed);
                if (g_trace)
                  spdlog::warn("host read: {}\n{}", fn.name(), c10::get_backtrace(1, 24));
              }
              return nullptr;
            },
            [](const at::RecordFunction&, at::ObserverContext*) { --t_depth; })
            .needsInputs(true)  // a copy's devices (counting is for tests and diagnosis)
            .scopes({at::RecordScope::FUNCTION}));
    g_counting = true;
  });
}

bool counting_host_reads() { return g_counting; }

}  // namespace tessel::observe
