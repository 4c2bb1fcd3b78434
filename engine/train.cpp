#include "engine/train.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <filesystem>

#include "engine/checkpoint.h"
#include "engine/safetensors.h"
#include "parallel/dp/grad_reducer.h"

namespace tessel {

torch::Device resolve_device(const std::string& device, int64_t local_rank) {
  const bool cuda = torch::cuda::is_available();
  if (device == "cuda" && !cuda)
    throw UserError(
        "training.device is cuda but no CUDA device is available (torch::cuda::is_available() is "
        "false)");
  return (device == "cuda" || (device == "auto" && cuda))
             ? torch::Device(torch::kCUDA, static_cast<int8_t>(local_rank))
             : torch::Device(torch::kCPU);
}

torch::ScalarType resolve_dtype(const std::string& dtype) {
  return dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
}

models::Decoder make_model(const Config& c, const torch::Device& device, torch::ScalarType dtype,
                           parallel::Group* tp) {
  auto model = models::build_model(c.model, c.run.seed, tp, c.parallel.sequence_parallel);
  if (!c.model.init_from.empty()) models::load_weights(model, c.model.init_from);
  model->to(device, dtype);
  return model;
}

Trainer::Trainer(Config c, const parallel::WorldInfo& world)
    : c_(std::move(c)),
      device_(resolve_device(c_.training.device, world.local_rank)),
      dtype_(resolve_dtype(c_.training.dtype)) {
  if (c_.training.threads > 0) torch::set_num_threads(static_cast<int>(c_.training.threads));
  // Every check of the plan against the world runs inside create() before any communicator.
  mesh_ = parallel::Mesh::create(c_, world, device_);
  const auto& l = mesh_->layout();
  if (l.cp > 1 || l.pp > 1)
    throw UserError(
        fmt::format("{}: parallel.cp {}, pp {}: this build trains with data and tensor parallelism "
                    "(context and pipeline parallelism are not in it yet); set them to 1",
                    c_.source, l.cp, l.pp));
  c_.parallel.dp = l.dp;
  if (mesh_->rank() == 0) {
    std::filesystem::create_directories(c_.run.output_dir);
    write_file_atomic((std::filesystem::path(c_.run.output_dir) / "config.yaml").string(),
                      dump_config(c_));
  } else {
    spdlog::set_level(spdlog::level::warn);  // rank 0 reports for everyone
  }
  data_ = std::make_unique<data::Dataset>(c_);
  model_ = make_model(c_, device_, dtype_, &mesh_->group(parallel::GroupKind::kTp));
  opt_ = std::make_unique<FlatAdamW>(model_, c_.training);
  if (auto dir = checkpoint_to_resume(c_); !dir.empty()) {
    auto st = load_checkpoint(dir, model_, *opt_);
    first_step_ = st.step + 1;
    consumed_ = st.consumed_samples;
    spdlog::info("resumed from {} (step {}, {} samples consumed)", dir, st.step,
                 st.consumed_samples);
  }
  if (mesh_->group(parallel::GroupKind::kTp).size() > 1)
    for (const auto& s : opt_->slots())
      if (model_->specs().at(s.name).tp_grad_sum)
        tp_summed_grads_.push_back(opt_->grad().narrow(0, s.offset, s.numel));
  reducer_ =
      std::make_unique<parallel::dp::GradReducer>(*mesh_, model_, *opt_, c_.parallel.ddp_bucket_mb);
  if (mesh_->rank() == 0) metrics_ = std::make_unique<MetricsLog>(c_, first_step_ - 1);
  spdlog::info("{} process{} ({}, {}): dp {} tp {}{} | {} gradient bucket{}", mesh_->world(),
               mesh_->world() > 1 ? "es" : "", world.source, mesh_->backend(), l.dp, l.tp,
               c_.parallel.sequence_parallel && l.tp > 1 ? " (sequence parallel)" : "",
               reducer_->buckets().size(), reducer_->buckets().size() == 1 ? "" : "s");
  flops_per_token_ = flops_per_token(model_, c_.training.seq_len);
  peak_ = device_peak(c_, device_, dtype_);
  spdlog::info("model {} | {} parameters | {} | {} on {}", c_.model.arch, opt_->numel(),
               c_.model.init_from.empty() ? "seeded init" : "weights from " + c_.model.init_from,
               c_.training.dtype, device_.str());
  spdlog::info("data {} | {} training samples ({} tokens), {} validation samples", c_.data.format,
               data_->train_samples(), data_->train_tokens(), data_->val_samples());
  spdlog::info("MFU: {:.3g} GFLOP/token by {}; peak {:.4g} TFLOP/s ({})", flops_per_token_ / 1e9,
               kFlopsConvention, peak_.tflops, peak_.source);
}

Trainer::StepOut Trainer::train_step(int64_t step) {
  const auto& t = c_.training;
  // This data rank's rows of the global batch (the next B positions of the global order).
  const int64_t rows = t.global_batch / mesh_->layout().dp;
  auto batch = data_->train_batch(consumed_ + mesh_->coord().dp * rows, rows);
  consumed_ += t.global_batch;
  batch = device_.is_cuda() ? batch.pin_memory().to(device_, /*non_blocking=*/true) : batch;
  // The loss rule: sum of token losses over the global batch / its number of target tokens.
  const double scale = 1.0 / static_cast<double>(t.global_batch * t.seq_len);
  auto loss = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
  double exposed_ms = 0;
  for (int64_t first = 0; first < rows; first += t.micro_batch) {
    reducer_->begin_microbatch(first + t.micro_batch == rows);
    auto mb_loss = model_->loss_sum(batch.narrow(0, first, t.micro_batch)) * scale;
    mb_loss.backward();
    exposed_ms += reducer_->end_microbatch();
    loss += mb_loss.detach();
  }
  sync_replicated_grads();
  auto& mp = mesh_->group(parallel::GroupKind::kMp);
  auto norm =
      opt_->clip_grad_norm(t.grad_clip, [&mp](torch::Tensor& sq) { mp.all_reduce(sq).wait(); });
  opt_->step(lr_at(t, step));
  return {loss, norm, exposed_ms};
}

double Trainer::evaluate() {
  torch::NoGradGuard no_grad;
  const auto& t = c_.training;
  auto total = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  const int64_t rows = t.eval_batches * t.global_batch, mine = rows / mesh_->layout().dp;
  auto last = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < mine; first += t.micro_batch) {
    auto mb = data_->val_batch(mesh_->coord().dp * mine + first, t.micro_batch).to(device_);
    total += model_->loss_sum(mb).to(torch::kFloat64);
    if (std::chrono::steady_clock::now() - last > std::chrono::seconds(2)) {
      last = std::chrono::steady_clock::now();
      spdlog::info("eval: {}/{} sequences", (first + t.micro_batch) * mesh_->layout().dp, rows);
    }
  }
  mesh_->dp_cp().all_reduce(total).wait();
  return total.item<double>() / static_cast<double>(rows * t.seq_len);
}

void Trainer::log_step(int64_t step, StepOut& out) {
  mesh_->dp_cp().all_reduce(out.loss).wait();  // each data rank holds its rows' share
  if (!metrics_) return;
  const double loss = out.loss.item<double>(), norm = out.grad_norm.item<double>();  // host sync
  const auto now = std::chrono::steady_clock::now();
  const double ms = std::chrono::duration<double, std::milli>(now - last_log_time_).count() /
                    static_cast<double>(step - last_log_step_);
  last_log_time_ = now;
  const double exposed_ms = exposed_comm_ms_sum_ / static_cast<double>(step - last_log_step_);
  exposed_comm_ms_sum_ = 0;
  last_log_step_ = step;
  // Per device, as the anchors print it (and as MFU needs it).
  const double tokens_per_s = static_cast<double>(c_.training.global_batch * c_.training.seq_len) /
                              (ms / 1e3) / static_cast<double>(mesh_->world());
  const double tflops = flops_per_token_ * tokens_per_s / 1e12;
  const double elapsed = std::chrono::duration<double>(now - start_time_).count();
  const double eta = elapsed / static_cast<double>(step - first_step_ + 1) *
                     static_cast<double>(c_.training.steps - step);
  metrics_->step({step, c_.training.steps, loss, lr_at(c_.training, step), norm, ms, tokens_per_s,
                  tflops, peak_.tflops > 0 ? tflops / peak_.tflops : 0.0, memory_bytes(device_),
                  eta, exposed_ms});
}

Trainer::~Trainer() = default;

void Trainer::sync_replicated_grads() {
  // Replicated parameters whose tp ranks each hold part of the gradient (sequence-parallel
  // norms and biases, key/value projections shared by query heads on several ranks): sum them.
  auto& tp = mesh_->group(parallel::GroupKind::kTp);
  for (auto& g : tp_summed_grads_) tp.all_reduce(g).wait();
}

void Trainer::train() {
  const auto& t = c_.training;
  start_time_ = last_log_time_ = std::chrono::steady_clock::now();
  last_log_step_ = first_step_ - 1;
  if (first_step_ > t.steps)
    spdlog::info("nothing to do: the checkpoint is at step {} of {}", first_step_ - 1, t.steps);
  for (int64_t step = first_step_; step <= t.steps; ++step) {
    StepOut out = train_step(step);
    exposed_comm_ms_sum_ += out.exposed_comm_ms;
    const bool last = step == t.steps;
    if (step % c_.logging.every == 0 || last) log_step(step, out);
    if (t.eval_every > 0 && (step % t.eval_every == 0 || last)) {
      auto t0 = std::chrono::steady_clock::now();
      double val = evaluate();
      if (metrics_)
        metrics_->eval(
            step, val,
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
      last_log_time_ += std::chrono::steady_clock::now() - t0;  // keep evaluation out of ms/step
    }
    if ((c_.checkpoint.every > 0 && step % c_.checkpoint.every == 0) || last) {
      auto t0 = std::chrono::steady_clock::now();
      auto dir = save_checkpoint(c_, *mesh_, model_, *opt_, {step, consumed_});
      spdlog::info("checkpoint {}", dir);
      last_log_time_ += std::chrono::steady_clock::now() - t0;
    }
  }
  if (const auto& tp = mesh_->group(parallel::GroupKind::kTp);
      tp.size() > 1 && t.steps >= first_step_)
    spdlog::info(
        "tensor-parallel traffic: {} bytes per step per rank (collective payloads, training and "
        "logging)",
        tp.bytes() / (t.steps - first_step_ + 1));
}

}  // namespace tessel
