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

}  // namespace

torch::Tensor read_on_host(const torch::Tensor& t) {
  g_reads.fetch_add(1, std::memory_order_relaxed);
  if (g_trace) spdlog::warn("host read: read_on_host\n{}", c10::get_backtrace(1, 24));
  return t.cpu();
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
              if (t_depth++ == 0 && reads_on_host(fn.name())) {
                g_reads.fetch_add(1, std::memory_order_relaxed);
                if (g_trace)
                  spdlog::warn("host read: {}\n{}", fn.name(), c10::get_backtrace(1, 24));
              }
              return nullptr;
            },
            [](const at::RecordFunction&, at::ObserverContext*) { --t_depth; })
            .scopes({at::RecordScope::FUNCTION}));
    g_counting = true;
  });
}

bool counting_host_reads() { return g_counting; }

}  // namespace tessel::observe
