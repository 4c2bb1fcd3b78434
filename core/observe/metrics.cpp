#include "core/observe/metrics.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

namespace tessel::observe {

int64_t memory_bytes(const torch::Device& device) {
  if (device.is_cuda()) {
    auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    int64_t peak = stats.allocated_bytes[0].peak;  // StatType::AGGREGATE
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
    return peak;
  }
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "... kB"
  return 0;
}

MetricsLog::MetricsLog(const plan::Config& c, int64_t resumed_step) {
  std::filesystem::create_directories(c.run.output_dir);
  path_ = (std::filesystem::path(c.run.output_dir) / c.logging.metrics_file).string();
  std::string kept;
  if (resumed_step > 0) {
    std::ifstream in(path_);
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number() &&
          j["step"].get<int64_t>() <= resumed_step)
        kept += line + "\n";
    }
  }
  f_ = std::fopen(path_.c_str(), "w");
  if (f_) std::fputs(kept.c_str(), f_);
  if (!f_) throw plan::UserError(path_ + ": cannot write metrics: " + std::strerror(errno));
  if (c.logging.tensorboard)
    tb_ = std::make_unique<TensorBoardWriter>(
        (std::filesystem::path(c.run.output_dir) / "tensorboard").string());
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

namespace {
double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string duration(double s) {
  long t = static_cast<long>(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60)
                   : fmt::format("{}m{:02d}s", t / 60, t % 60);
}
}  // namespace

void MetricsLog::write_line(const std::string& line) {
  // A full disk or a vanished file must stop the run, not lose the metrics silently.
  if (std::fprintf(f_, "%s\n", line.c_str()) < 0 || std::fflush(f_) != 0)
    throw plan::UserError(path_ + ": cannot write metrics: " + std::strerror(errno));
}

namespace {
// A mixture of experts' figures: into the metrics line `j` and TensorBoard (when on).
void add_moe_figures(const StepLine& s, nlohmann::json& j, TensorBoardWriter* tb) {
  if (!s.moe.on) return;
  j["moe_aux_loss"] = s.moe.aux_loss;
  j["moe_load_max"] = s.moe.load_max;
  j["moe_dropped"] = s.moe.dropped;
  j["moe_tokens_per_expert"] = s.moe.tokens_per_expert;
  if (!tb) return;
  std::map<std::string, double> moe = {{"moe/aux_loss", s.moe.aux_loss},
                                       {"moe/load_max", s.moe.load_max},
                                       {"moe/dropped", s.moe.dropped}};
  for (size_t e = 0; e < s.moe.tokens_per_expert.size(); ++e)
    moe[fmt::format("moe/tokens_expert_{:03d}", e)] = s.moe.tokens_per_expert[e];
  tb->scalars(s.step, moe);
}
// Exposed communication, or n/a where it was not measured (NaN: a replayed CUDA graph; the
// metrics file then holds null).
std::string comm_text(double ms) { return std::isnan(ms) ? "n/a" : fmt::format("{:.1f} ms", ms); }
}  // namespace

void MetricsLog::step(const StepLine& s) {
  const double tokens_per_s_global = s.tokens_per_s * static_cast<double>(s.world);
  nlohmann::json j = {{"step", s.step},
                      {"time", unix_time()},
                      {"elapsed_s", s.elapsed_s},
                      {"samples", s.samples},
                      {"tokens", s.tokens},
                      {"loss", s.loss},
                      {"lr", s.lr},
                      {"grad_norm", s.grad_norm},
                      {"ms_per_step", s.ms_per_step},
                      {"tokens_per_s", s.tokens_per_s},
                      {"tokens_per_s_per_device", s.tokens_per_s},
                      {"tokens_per_s_global", tokens_per_s_global},
                      {"tflops_per_device", s.tflops_per_device},
                      {"mfu", s.mfu},
                      {"mem_bytes", s.mem_bytes},
                      {"comm_exposed_ms", s.comm_exposed_ms},
                      {"loss_scale", s.loss_scale},
                      {"skipped_steps", s.skipped_steps}};
  add_moe_figures(s, j, tb_.get());
  if (!s.blend_samples.empty()) j["blend_samples"] = s.blend_samples;
  write_line(j.dump());
  if (tb_)
    tb_->scalars(s.step, {{"train/loss", s.loss},
                          {"train/lr", s.lr},
                          {"train/grad_norm", s.grad_norm},
                          {"perf/ms_per_step", s.ms_per_step},
                          {"perf/tokens_per_s_per_device", s.tokens_per_s},
                          {"perf/tokens_per_s_global", tokens_per_s_global},
                          {"perf/mfu", s.mfu},
                          {"perf/mem_gib", static_cast<double>(s.mem_bytes) / (1 << 30)},
                          {"perf/comm_exposed_ms", s.comm_exposed_ms},
                          {"progress/tokens", static_cast<double>(s.tokens)}});
  spdlog::info(
      "step {:>{}}/{} | loss {:.4f} | lr {:.3e} | norm {:.3f} | {:.1f} ms | {:.0f} tok/s/device "
      "({:.0f} global) | {:.3f} "
      "TFLOP/s | MFU {:.2f}% | mem {:.2f} GiB | comm {}{}{} | ETA {}",
      s.step, std::to_string(s.steps).size(), s.steps, s.loss, s.lr, s.grad_norm, s.ms_per_step,
      s.tokens_per_s, tokens_per_s_global, s.tflops_per_device, 100.0 * s.mfu,
      static_cast<double>(s.mem_bytes) / (1 << 30), comm_text(s.comm_exposed_ms),
      s.loss_scale != 1.0 || s.skipped_steps > 0
          ? fmt::format(" | scale {:g} (skipped {})", s.loss_scale, s.skipped_steps)
          : "",
      s.moe.on ? fmt::format(
                     " | moe aux {:.4f} load {:.2f}{}", s.moe.aux_loss, s.moe.load_max,
                     s.moe.dropped > 0 ? fmt::format(" dropped {:.1f}%", 100 * s.moe.dropped) : "")
               : "",
      duration(s.eta_s));
}

void MetricsLog::eval(int64_t step, double val_loss, double ms, int64_t tokens,
                      const std::vector<std::pair<std::string, double>>& by_dataset) {
  nlohmann::json j = {{"step", step},
                      {"time", unix_time()},
                      {"tokens", tokens},
                      {"val_loss", val_loss},
                      {"eval_ms", ms}};
  std::string each;
  if (!by_dataset.empty()) {
    auto& m = j["val_loss_by_dataset"] = nlohmann::json::object();
    for (const auto& [key, loss] : by_dataset) {
      m[key] = loss;
      each += fmt::format(" | {} {:.4f}", key, loss);
    }
  }
  write_line(j.dump());
  if (tb_) {
    std::map<std::string, double> scalars{{"val/loss", val_loss}};
    for (size_t i = 0; i < by_dataset.size(); ++i)
      scalars[fmt::format("val/loss_dataset_{}", i + 1)] = by_dataset[i].second;
    tb_->scalars(step, scalars);
  }
  spdlog::info("eval step {} | val_loss {:.4f}{} | {:.0f} ms", step, val_loss, each, ms);
}

}  // namespace tessel::observe
