#include "core/observe/profiler.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <utility>

namespace tessel::observe {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

std::set<ActivityType> activities(bool cuda) {
  if (cuda) return {ActivityType::CPU, ActivityType::CUDA};
  return {ActivityType::CPU};
}

prof::ProfilerConfig config() {
  // Shapes and stacks off: the profiled steps should cost what the others do.
  return prof::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO);
}

std::vector<ProfiledSpan> spans_of(const prof::ProfilerResult& r) {
  std::vector<ProfiledSpan> out;
  for (const auto& e : r.events()) {
    if (e.isAsync() || e.endNs() < e.startNs()) continue;
    const bool device = e.deviceType() != c10::DeviceType::CPU;
    out.push_back({e.name(),
                   device ? static_cast<uint64_t>(e.deviceResourceId()) : e.startThreadId(),
                   e.startNs(), e.endNs(), device});
  }
  return out;
}

}  // namespace

std::vector<OpTime> op_times(std::vector<ProfiledSpan> spans) {
  // Per thread, in start order (a parent before the children it encloses): a stack of the open
  // spans; each span's duration is taken off its innermost enclosing span.
  std::sort(spans.begin(), spans.end(), [](const ProfiledSpan& a, const ProfiledSpan& b) {
    return std::tie(a.device, a.thread, a.start_ns, b.end_ns) <
           std::tie(b.device, b.thread, b.start_ns, a.end_ns);
  });
  std::map<std::pair<bool, std::string>, OpTime> by_name;
  std::vector<std::pair<const ProfiledSpan*, double>> open;  // span, its self ns so far
  auto close = [&](const ProfiledSpan* s, double self_ns) {
    auto& row = by_name[{s->device, s->name}];
    row.name = s->name, row.device = s->device;
    row.calls += 1;
    row.self_ms += self_ns / 1e6;
  };
  for (size_t i = 0; i <= spans.size(); ++i) {
    const ProfiledSpan* s = i < spans.size() ? &spans[i] : nullptr;
    while (!open.empty() && (!s || s->device || s->thread != open.back().first->thread ||
                             s->start_ns >= open.back().first->end_ns)) {
      close(open.back().first, open.back().second);
      open.pop_back();
    }
    if (!s) break;
    const double ns = static_cast<double>(s->end_ns - s->start_ns);
    if (s->device) {
      close(s, ns);
      continue;
    }
    if (!open.empty()) open.back().second -= ns;
    open.emplace_back(s, ns);
  }
  std::vector<OpTime> out;
  for (auto& [_, row] : by_name) out.push_back(std::move(row));
  std::sort(out.begin(), out.end(),
            [](const OpTime& a, const OpTime& b) { return a.self_ms > b.self_ms; });
  return out;
}

int64_t busy_host_threads(const std::vector<ProfiledSpan>& spans) {
  std::map<uint64_t, double> ns;  // per thread: its spans' time (nested ones counted again)
  double busiest = 0;
  for (const auto& s : spans)
    if (!s.device) busiest = std::max(busiest, ns[s.thread] += double(s.end_ns - s.start_ns));
  int64_t n = 0;
  for (const auto& [_, t] : ns) n += t >= 0.1 * busiest ? 1 : 0;
  return std::max<int64_t>(1, n);
}

std::string top_ops_table(const std::vector<OpTime>& ops, double wall_ms, int64_t steps, size_t top,
                          int64_t host_threads) {
  std::string s;
  for (const bool device : {false, true}) {
    std::vector<const OpTime*> rows;
    double total = 0;
    for (const auto& o : ops)
      if (o.device == device) {
        total += o.self_ms;
        if (rows.size() < top) rows.push_back(&o);
      }
    if (rows.empty()) continue;
    const double of_ms = device ? wall_ms : wall_ms * static_cast<double>(host_threads);
    s += fmt::format("\n| {} | calls/step | {} ms/step | share of step |\n|---|---|---|---|\n",
                     device ? "device kernel" : "operator (host)", device ? "device" : "self");
    for (const auto* o : rows)
      s += fmt::format("| {} | {:.1f} | {:.3f} | {:.1f}% |\n", o->name,
                       static_cast<double>(o->calls) / static_cast<double>(steps),
                       o->self_ms / static_cast<double>(steps), 100 * o->self_ms / of_ms);
    s += fmt::format("| (all {}) | | {:.3f} | {:.1f}% |\n", device ? "device time" : "host ops",
                     total / static_cast<double>(steps), 100 * total / of_ms);
  }
  return fmt::format("profile of {} step{}: {:.2f} ms/step wall{}\n", steps, steps == 1 ? "" : "s",
                     wall_ms / static_cast<double>(steps),
                     host_threads > 1
                         ? fmt::format("; host operators on {} threads at once (shares "
                                       "of {} × wall)",
                                       host_threads, host_threads)
                         : "") +
         s;
}

StepProfiler::StepProfiler(int64_t first, int64_t last, std::string dir, int64_t rank, bool cuda)
    : first_(first), last_(last), rank_(rank), dir_(std::move(dir)), cuda_(cuda) {
  // A CPU run's profile needs no GPU, but Kineto asks for one when it starts and logs the
  // driver's refusal ("gpuGetDeviceCount failed with code 35") as an error. Its log level is
  // read when it starts: only fatal ones then, unless the user chose a level.
  if (!cuda_) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  if (last_ >= first_) prof::prepareProfiler(config(), activities(cuda_));
}

StepProfiler::~StepProfiler() {
  if (on_) prof::disableProfiler();  // an exception left the window open: close it, write none
}

void StepProfiler::before_step(int64_t step) {
  if (step != first_ || on_ || done_) return;
  if (cuda_) torch::cuda::synchronize();  // the window holds its own steps' kernels only
  prof::enableProfiler(config(), activities(cuda_));
  on_ = true;
  t0_ns_ = now_ns();
}

std::string StepProfiler::after_step(int64_t step) {
  if (!on_ || step != last_) return "";
  if (cuda_) torch::cuda::synchronize();
  const double wall_ms = static_cast<double>(now_ns() - t0_ns_) / 1e6;
  auto result = prof::disableProfiler();
  on_ = false, done_ = true;
  std::filesystem::create_directories(dir_);
  const auto base = std::filesystem::path(dir_) / fmt::format("rank{}", rank_);
  result->save(base.string() + ".pt.trace.json");
  auto spans = spans_of(*result);
  const int64_t threads = busy_host_threads(spans);
  auto table = top_ops_table(op_times(std::move(spans)), wall_ms, last_ - first_ + 1, 15, threads);
  std::ofstream(base.string() + ".top.md") << table;
  return fmt::format("{}trace: {}.pt.trace.json (Perfetto: ui.perfetto.dev; TensorBoard)", table,
                     base.string());
}

}  // namespace tessel::observe
