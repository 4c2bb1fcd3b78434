// The Trainer's reports: the start-up lines (layout, state), each logged step, and the end of
// the run's files (memory.json, pipeline.json). engine/run/train.cpp holds the steps themselves.
#include "engine/run/train.h"

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/device/cuda.h"
#include "core/kernels/attention_kernels.h"
#include "core/observe/host_reads.h"
#include "core/observe/profiler.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/io/safetensors.h"
#include "engine/planner/documents.h"
#include "engine/planner/planner.h"
#include "engine/run/same_plan.h"
#include "engine/run/step_counters.h"
#include "engine/run/stop.h"
#include "parallel/cp/attention.h"
#include "parallel/dp/grad_sync.h"
#include "parallel/pp/executor.h"

namespace tessel::run {

void Trainer::log_layout(const parallel::WorldInfo& world) const {
  const auto& l = mesh_->layout();
  const auto& t = c_.training;
  const bool sp = c_.parallel.sequence_parallel && l.tp > 1;
  spdlog::info(
      "{} process{} ({}, {}): dp {} tp {}{} pp {} cp {}{} | {} gradient bucket{}", mesh_->world(),
      mesh_->world() > 1 ? "es" : "", world.source, plan::name_of(mesh_->backend()), l.dp, l.tp,
      sp ? " (sequence parallel)" : "", l.pp, l.cp,
      l.cp > 1 ? fmt::format(" ({}, {} tokens per rank)", c_.parallel.context_method.name(),
                             t.seq_len / l.cp)
               : "",
      sync_->reducer().buckets().size(), sync_->reducer().buckets().size() == 1 ? "" : "s");
  if (executor_->pairs())
    spdlog::info(
        "micro-batches two at a time, each on {} of {} threads "
        "(training.microbatch_pairs; false: one at a time)",
        at::get_num_threads() / 2, at::get_num_threads());
  if (l.pp > 1) {
    const auto& s = executor_->schedule();
    const auto layers = parallel::pp::stage_layer_counts(c_.model.layers, l.pp * s.virtual_stages,
                                                         c_.parallel.layers_per_stage);
    spdlog::info(
        "pipeline: {} over {} ranks x {} chunk{}, {} micro-batches per step; layers per "
        "stage [{}]; tied embeddings {}",
        s.name, l.pp, s.virtual_stages, s.virtual_stages > 1 ? "s" : "", s.microbatches, layers,
        c_.model.tied() ? "kept equal over the embedding group" : "no");
  }
}

void Trainer::log_state() const {
  spdlog::info("model {} | {} parameters on this rank | {} | {} on {}", c_.model.arch.name(),
               opt_->numel(),
               !resumed_from_.empty()       ? "weights from checkpoint " + resumed_from_
               : c_.model.init_from.empty() ? "seeded init"
                                            : "weights from " + c_.model.init_from,
               c_.training.dtype.name(), device_.str());
  const auto bytes = opt_->bytes();
  auto& data_group = mesh_->dp_cp();
  spdlog::info(
      "state on this rank (ZeRO {} over {} data rank{}): weights {:.2f} MiB, gradients {:.2f} MiB, "
      "optimizer {:.2f} MiB{}",
      opt_->sharding().stage(), data_group.size(), data_group.size() == 1 ? "" : "s",
      bytes.params / 1048576.0, bytes.grads / 1048576.0, bytes.optimizer / 1048576.0,
      sync_->unit_gatherer() ? fmt::format(" (+ gathered units, the largest {:.2f} MiB)",
                                           sync_->unit_gatherer()->largest_unit_bytes() / 1048576.0)
                             : "");
  spdlog::info("data {} | {} training samples ({} tokens), {} validation samples | order {}{}{}",
               c_.data.format.name(), data_->train_samples(), data_->train_tokens(),
               data_->val_samples(), c_.data.order.name(),
               c_.data.split.empty() ? "" : ", split " + c_.data.split,
               c_.data.document_mask ? fmt::format(" | document mask after id {}", doc_eod_) : "");
  const auto& train = data_->sources();
  if (train.size() > 1) {
    // Each dataset's share, and what the run asks of it (an epoch is its training samples).
    bool exact = true;  // past 2^36 samples the run's shares are each weight's, within one
    const auto run = data_->shares(c_.training.steps * c_.training.global_batch, &exact);
    const auto so_far = data_->taken(consumed_);
    for (size_t i = 0; i < train.size(); ++i)
      spdlog::info(
          "{}: weight {:.4g} | {} | {} training samples | the run takes {}{} ({:.3g} epochs), {} "
          "taken so far",
          train[i].key, data_->weights()[i], train[i].name, train[i].samples, exact ? "" : "about ",
          run[i], static_cast<double>(run[i]) / static_cast<double>(train[i].samples), so_far[i]);
  }
  for (auto s : {data::SampleSplit::kValid, data::SampleSplit::kTest})
    for (const auto& src : data_->sources(s))
      spdlog::info("{} {}: {} | {} samples", data::split_name(s), src.key, src.name, src.samples);
  spdlog::info("device {}: {}", device_.str(), device_why_);
  spdlog::info("attention: {}", attention_);
  if (!fp8_.empty()) spdlog::info("fp8 {}", fp8_);
  spdlog::info("MFU: {:.3g} GFLOP/token by {}; peak {:.4g} TFLOP/s ({})", flops_per_token_ / 1e9,
               models::kFlopsConvention, peak_.tflops, peak_.source);
}

// A measured peak the steps pass: measured again once (the start's may have run beside
// start-up's threads, the data scan, or before the clock rose), out of the steps' time; a rate
// still above it becomes the peak, with a word.
void Trainer::check_peak(int64_t step, double tflops) {
  if (peak_.measured && tflops > peak_.tflops && !peak_remeasured_) {
    // The start's measure may have run beside start-up's threads (the data scan) or before the
    // clock rose: measure again once, now that the steps run alone, out of the steps' time.
    // Up to three tries, the best kept: a try beside another busy process can come out low too.
    peak_remeasured_ = true;
    const auto t0 = std::chrono::steady_clock::now();
    auto again = planner::device_peak(c_, device_, dtype_);
    for (int i = 0; i < 2 && again.tflops <= tflops; ++i)
      if (auto more = planner::device_peak(c_, device_, dtype_); more.tflops > again.tflops)
        again = more;
    last_log_time_ += std::chrono::steady_clock::now() - t0;
    if (again.tflops > peak_.tflops) {
      spdlog::info(
          "MFU: the steps reach {:.4g} TFLOP/s, above the {:.4g} TFLOP/s measured at "
          "start; measured again at step {}: {:.4g} TFLOP/s, the peak from now on",
          tflops, peak_.tflops, step, again.tflops);
      peak_ = {again.tflops, again.source + ", measured again at step " + std::to_string(step),
               true};
    }
  }
  if (peak_.measured && tflops > peak_.tflops) {  // never an MFU above 100% without a word
    spdlog::warn(
        "MFU: the steps reach {:.4g} TFLOP/s, above the {:.4g} TFLOP/s measured at start ({}): "
        "that was not this device's peak; MFU is against {:.4g} from now on (logging.peak_tflops "
        "sets a fixed peak)",
        tflops, peak_.tflops, peak_.source, tflops);
    peak_ = {tflops, "the fastest rate its steps reached", true};
  }
}

void Trainer::log_step(int64_t step, StepOut& out) {
  // The last pipeline stage holds the loss; each data rank its rows' share.
  mesh_->group(parallel::GroupKind::kPp).all_reduce(out.loss).wait();
  mesh_->dp_cp().all_reduce(out.loss).wait();
  check_finite();  // every rank: they all hold the same flag
  // Device timers are read here, where the host waits for the loss anyway (every rank).
  const double loss = out.loss.item<double>(), norm = out.grad_norm.item<double>();  // host sync
  const double steps = static_cast<double>(step - last_log_step_);
  // A replayed graph records no spans (core/observe/timing.h): exposed communication unmeasured.
  const double exposed_ms =
      graph_.captured() ? (take_exposed_comm_ms(), std::nan("")) : take_exposed_comm_ms() / steps;
  const auto pp = executor_->take_times();
  const int64_t timed = step - std::max(last_log_step_, first_step_);  // not the warm-up step
  pp_step_ms_ += pp.step_ms, pp_compute_ms_ += pp.compute_ms, pp_wait_ms_ += pp.wait_ms;
  pp_steps_ += std::max<int64_t>(0, timed);
  const auto now = std::chrono::steady_clock::now();
  const double ms = std::chrono::duration<double, std::milli>(now - last_log_time_).count() / steps;
  last_log_time_ = now;
  last_log_step_ = step;
  // every rank: a world all-reduce
  const auto moe = model_step_ ? model_step_->figures() : observe::MoeFigures{};
  if (!metrics_) return;
  // Per device, as the anchors print it (and as MFU needs it).
  const double tokens_per_s = static_cast<double>(c_.training.global_batch * c_.training.seq_len) /
                              (ms / 1e3) / static_cast<double>(mesh_->world());
  const double tflops = flops_per_token_ * tokens_per_s / 1e12;
  check_peak(step, tflops);
  const double elapsed = std::chrono::duration<double>(now - start_time_).count();
  const double eta = elapsed / static_cast<double>(step - first_step_ + 1) *
                     static_cast<double>(c_.training.steps - step);
  metrics_->step(
      {step,
       c_.training.steps,
       loss,
       optim::lr_at(c_.training, step),
       norm,
       ms,
       tokens_per_s,
       tflops,
       peak_.tflops > 0 ? tflops / peak_.tflops : 0.0,
       device_.is_cuda() ? counters_->take_peak_since_log() : observe::memory_bytes(device_),
       eta,
       exposed_ms,
       scaler_->scale_value(),
       scaler_->skipped_steps(),
       mesh_->world(),
       consumed_,
       consumed_ * c_.training.seq_len,
       elapsed,
       moe,
       c_.data.blend.empty() && data_->sources().size() == 1 ? std::vector<int64_t>{}
                                                             : data_->taken(consumed_)});
}

void Trainer::report_end() {
  if (mesh_->layout().pp > 1) report_pipeline();
  report_memory();
  const int64_t steps = counters_->host_steps();  // a replayed step's payloads go uncounted
  if (const auto& tp = mesh_->group(parallel::GroupKind::kTp); tp.size() > 1 && steps > 0)
    spdlog::info(
        "tensor-parallel traffic: {} bytes per step per rank (collective payloads, training and "
        "logging)",
        tp.bytes() / steps);
  if (const auto& cp = mesh_->group(parallel::GroupKind::kCp); cp.size() > 1 && steps > 0)
    spdlog::info(
        "context-parallel traffic: {} bytes per step per rank in collective payloads, {} sent "
        "point-to-point (training and evaluation)",
        cp.bytes() / steps, cp.sent_bytes() / steps);
}

torch::Tensor Trainer::gather_figures(const std::vector<double>& mine) const {
  auto& world = mesh_->world_group();
  auto t = torch::tensor(mine, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  auto all = torch::empty({world.size() * t.numel()}, t.options());
  world.all_gather(all, t).wait();
  return mesh_->rank() == 0 ? all.view({world.size(), -1}).cpu() : torch::Tensor();
}

void Trainer::write_report(const std::string& file, const nlohmann::json& report) const {
  io::write_file_atomic((std::filesystem::path(c_.run.output_dir) / file).string(),
                        report.dump(1) + "\n");
}

void Trainer::report_memory() {
  // Every rank's state bytes, gathered to rank 0: <output_dir>/memory.json (persistent buffers;
  // ZeRO-3's gathered units and ZeRO-2/3's gradient buckets as measured peaks; the process's
  // peak resident set before the first step and at the end: on CPU their difference is what the
  // steps added, activations mostly).
  const auto b = opt_->bytes();
  const auto pad = opt_->alignment_padding();
  const auto* units = sync_->unit_gatherer();
  // The state as the CPU allocator counted it, each part on its own (-1 on CUDA: not counted).
  auto allocated = [this](observe::Held what) {
    return device_.is_cuda() ? -1 : observe::CpuAllocationCounter::get().live(what);
  };
  const std::vector<std::pair<const char*, int64_t>> figures = {
      {"numel", opt_->numel()},
      {"flat_numel", opt_->layout().numel()},
      {"params_bytes", b.params},
      {"grads_bytes", b.grads},
      {"optimizer_bytes", b.optimizer},
      {"gathered_peak_bytes", units ? units->peak_gathered_bytes() : 0},
      {"largest_unit_bytes", units ? units->largest_unit_bytes() : 0},
      {"grad_bucket_peak_bytes", sync_->reducer().peak_bucket_bytes()},
      {"setup_peak_rss_bytes", setup_rss_},
      {"peak_rss_bytes", observe::peak_rss_bytes()},
      {"step_base_bytes", counters_->step_base_bytes()},
      {"step_peak_bytes", counters_->step_peak_bytes()},
      {"allocated_weights_bytes", allocated(observe::Held::kWeights)},
      {"allocated_grads_bytes", allocated(observe::Held::kGrads)},
      {"allocated_optimizer_bytes", allocated(observe::Held::kOptimizer)},
      {"padding_weights_bytes", pad.params},  // what --dry-run leaves out (optim::kAlignElements)
      {"padding_grads_bytes", pad.grads},
      {"padding_optimizer_bytes", pad.optimizer},
      {"padding_bound_bytes", opt_->alignment_padding_bound()},
      // Per step at most, steps after the first (-1: LibTorch's reads not counted, see
      // core/observe/host_reads.h)
      {"host_reads_per_step",
       observe::counting_host_reads() ? counters_->host_reads_per_step() : -1}};
  std::vector<double> mine;
  for (const auto& [_, v] : figures) mine.push_back(static_cast<double>(v));
  // Then the bytes per training step of every group (the planner's comm figures).
  const auto comm = counters_->comm_bytes_per_step();
  for (const auto& [_, v] : comm) mine.push_back(v);
  const auto all = gather_figures(mine);
  if (!all.defined()) return;
  nlohmann::json out = {
      {"zero", opt_->sharding().stage()},
      {"dtype", c_.training.dtype.name()},
      {"data_ranks", mesh_->dp_cp().size()},
      {"predicted", planner::predicted_bytes(c_, mesh_->layout())},  // --dry-run's
      {"ranks", nlohmann::json::array()}};
  for (int64_t r = 0; r < all.size(0); ++r) {
    nlohmann::json row = {{"rank", r}};
    int64_t k = 0;
    for (const auto& [key, _] : figures)
      row[key] = static_cast<int64_t>(all[r][k++].item<double>());
    for (const auto& [name, _] : comm)
      row["comm_bytes_per_step"][name] = static_cast<int64_t>(all[r][k++].item<double>());
    out["ranks"].push_back(row);
  }
  write_report("memory.json", out);
}

void Trainer::report_pipeline() {
  // Every rank's own figures, gathered to rank 0: <output_dir>/pipeline.json and one line per
  // stage. Measured bubble = idle time / step time, from the executor's clock (steps after the
  // first); theory = the simulator's idle share with backward = 2 forwards.
  const double steps = static_cast<double>(std::max<int64_t>(1, pp_steps_));
  const auto all = gather_figures({static_cast<double>(mesh_->coord().pp),
                                   static_cast<double>(pp_peak_activations_), pp_step_ms_ / steps,
                                   pp_compute_ms_ / steps, pp_wait_ms_ / steps});
  if (!all.defined()) return;
  const auto& s = executor_->schedule();
  const auto sim = parallel::pp::simulate(s);
  nlohmann::json out = {{"schedule", s.name},
                        {"stages", s.stages},
                        {"microbatches", s.microbatches},
                        {"virtual_stages", s.virtual_stages},
                        {"steps_timed", pp_steps_},
                        {"theory_bubble", sim.bubble / (1.0 + sim.bubble)},
                        {"ranks", nlohmann::json::array()}};
  for (int64_t r = 0; r < all.size(0); ++r) {
    auto row = all[r];
    const auto stage = static_cast<int64_t>(row[0].item<double>());
    const double step = row[2].item<double>(), compute = row[3].item<double>();
    const double bubble = step > 0 ? (step - compute) / step : 0.0;
    const auto peak = static_cast<int64_t>(row[1].item<double>());
    out["ranks"].push_back({{"rank", r},
                            {"pp", stage},
                            {"peak_activations", peak},
                            {"schedule_peak_activations", sim.peak_activations[stage]},
                            {"step_ms", step},
                            {"compute_ms", compute},
                            {"wait_ms", row[4].item<double>()},
                            {"bubble", bubble}});
    if (parallel::coord_of(r, mesh_->layout()).tp == 0 &&
        parallel::coord_of(r, mesh_->layout()).dp == 0)
      spdlog::info(
          "pipeline stage {}: at most {} micro-batch chunks of activations held (schedule: {}); "
          "bubble {:.1f}% of {:.1f} ms/step measured (idle / step time), {:.1f}% in theory",
          stage, peak, sim.peak_activations[stage], 100 * bubble, step,
          100 * sim.bubble / (1.0 + sim.bubble));
  }
  write_report("pipeline.json", out);
}

void Trainer::measure_flops() {
  // The whole model's, whatever stages this rank holds (each part's declaration).
  flops_per_token_ = models::DecoderImpl::flops(model_->options(), c_.training.seq_len,
                                                planner::document_figures(c_, *data_).share)
                         .train;
  peak_ = planner::device_peak(c_, device_, dtype_);
  // Tests: a start-up measure that came out low, as one beside start-up's threads can.
  if (const char* s = std::getenv("TESSEL_TEST_START_PEAK_SCALE"); s && peak_.measured)
    peak_.tflops *= std::atof(s);
}

double Trainer::take_exposed_comm_ms() {
  // Reductions backward did not hide, the weight all-gathers the forward waited for (stages 1-2),
  // and waits for ZeRO-3 gathers their prefetch did not hide (CUDA: from events, read now).
  const double carried = carried_exposed_ms_;
  carried_exposed_ms_ = 0;
  return carried + sync_->take_wait_ms();
}

}  // namespace tessel::run
