#include "engine/metrics.h"

#include "engine/planner.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace tessel {

double flops_parameters(models::Decoder& model) {
  const auto& m = model->options().model;
  double n = 0;
  for (const auto& [name, spec] : model->specs()) {
    const bool input_embedding =
        name == "pos_embed.weight" || (name == "embed.weight" && !m.tied());
    if (input_embedding || spec.pipeline_copy) continue;
    double numel = 1;
    for (auto d : spec.global_shape) numel *= static_cast<double>(d);
    n += numel;
  }
  return n;
}

double flops_per_token(const ModelConfig& m, double n, int64_t seq_len) {
  return 6.0 * n + 12.0 * m.layers * m.heads * m.head_dim() * static_cast<double>(seq_len);
}

Peak device_peak(const Config& c, const torch::Device& device, torch::ScalarType dtype) {
  if (c.logging.peak_tflops > 0) return {c.logging.peak_tflops, "logging.peak_tflops", false};
  const std::string dname = dtype == torch::kHalf       ? "fp16"
                            : dtype == torch::kBFloat16 ? "bf16"
                                                        : "fp32";
  std::string name = "CPU";
  if (device.is_cuda()) {
    name = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->name;
    // The planner's profile of this GPU: the one peak for its step time and its MFU.
    if (const auto* p = profile_of_gpu(name))
      return {matmul_peak_tflops(*p, c.training),
              name + " " + matmul_peak_name(c.training) + " datasheet peak", false};
  }
  // No datasheet: measure the best matmul rate this device reaches in the run's dtype, on the
  // run's threads: square matmuls of growing sizes, each the best of several tries (up to ten,
  // within a quarter second per size), after a warm-up. Sizes stop growing once one matmul takes
  // over 30 ms (the next, 8x the work, would take a quarter second): a dtype without fast kernels
  // here (bf16/fp16 on many CPUs) costs well under a second of start-up.
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  double best = 0;
  int64_t best_n = 0;
  using clock = std::chrono::steady_clock;
  for (int64_t n : {256, 512, 1024, 2048}) {
    auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
    const auto warm = clock::now();
    torch::matmul(a, b).sum().item<double>();  // warm-up (and CUDA sync)
    const bool slow = clock::now() - warm > std::chrono::milliseconds(30);
    const auto start = clock::now();
    for (int i = 0; i < 10; ++i) {
      const auto t0 = clock::now();
      torch::matmul(a, b).sum().item<double>();  // synchronises CUDA; small next to the matmul
      const auto t1 = clock::now();
      const double tflops = 2.0 * n * n * n / std::chrono::duration<double>(t1 - t0).count() / 1e12;
      if (tflops > best) best = tflops, best_n = n;
      if (i >= 2 && t1 - start > std::chrono::milliseconds(250)) break;
    }
    if (slow) break;
  }
  return {best,
          fmt::format("measured: the best {} matmul rate on {} (sizes 256 and up, best {}^3), no "
                      "datasheet entry",
                      dname, name, best_n),
          true};
}

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

MetricsLog::MetricsLog(const Config& c, int64_t resumed_step) {
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
  if (!f_) throw UserError(path_ + ": cannot write metrics: " + std::strerror(errno));
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
    throw UserError(path_ + ": cannot write metrics: " + std::strerror(errno));
}

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
      "TFLOP/s | MFU {:.2f}% | mem {:.2f} GiB | comm {:.1f} ms{} | ETA {}",
      s.step, std::to_string(s.steps).size(), s.steps, s.loss, s.lr, s.grad_norm, s.ms_per_step,
      s.tokens_per_s, tokens_per_s_global, s.tflops_per_device, 100.0 * s.mfu,
      static_cast<double>(s.mem_bytes) / (1 << 30), s.comm_exposed_ms,
      s.loss_scale != 1.0 || s.skipped_steps > 0
          ? fmt::format(" | scale {:g} (skipped {})", s.loss_scale, s.skipped_steps)
          : "",
      duration(s.eta_s));
}

void MetricsLog::eval(int64_t step, double val_loss, double ms, int64_t tokens) {
  nlohmann::json j = {{"step", step},
                      {"time", unix_time()},
                      {"tokens", tokens},
                      {"val_loss", val_loss},
                      {"eval_ms", ms}};
  write_line(j.dump());
  if (tb_) tb_->scalars(step, {{"val/loss", val_loss}});
  spdlog::info("eval step {} | val_loss {:.4f} | {:.0f} ms", step, val_loss, ms);
}

}  // namespace tessel
