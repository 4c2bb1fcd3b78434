#include "engine/run/train.h"

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "core/observe/interrupt.h"
#include "core/observe/profiler.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/io/safetensors.h"
#include "engine/planner/planner.h"
#include "engine/run/parallelize.h"
#include "engine/run/same_plan.h"
#include "engine/run/step_counters.h"
#include "engine/run/stop.h"
#include "parallel/dp/grad_sync.h"
#include "parallel/pp/executor.h"

namespace tessel::run {

Trainer::Trainer(Start start, const parallel::WorldInfo& world)
    : c_(std::move(start.config)),
      peers_(std::move(start.peers)),
      lock_(std::move(start.lock)),
      device_(resolve_device(c_.training.device, world, &device_why_)),
      dtype_(models::resolve_dtype(c_.training.dtype)) {
  // start_run() checked the plan against this node and agreed with every rank.
  configure_device(c_, device_);
  attention_ = attention_kernel(c_, device_, dtype_);
  fp8_ = fp8_matmuls(c_, device_);
  mesh_ = parallel::Mesh::create(c_, world, device_, std::move(start.store));
  const auto& l = mesh_->layout();
  c_.parallel.dp = l.dp;
  if (world.world > world.local_world && world.local_world > 0)  // several nodes
    spdlog::info("groups {}", parallel::node_placement(c_, l, world.local_world));
  check_same_plan(c_, *mesh_);
  if (mesh_->rank() == 0) {
    std::filesystem::create_directories(c_.run.output_dir);
    io::write_file_atomic((std::filesystem::path(c_.run.output_dir) / "config.yaml").string(),
                          plan::dump_config(c_));
  } else {
    spdlog::set_level(spdlog::level::warn);  // rank 0 reports for everyone
  }
  // The test split is score's: a run never reads it.
  data_ = std::make_unique<data::Dataset>(
      c_, std::vector<data::SampleSplit>{data::SampleSplit::kValid});
  observe::stop_if_signalled("reading the data");
  doc_eod_ = data::document_eod(c_);
  loss_eod_ = data::loss_mask_eod(c_);
  if (c_.checkpoint.async) saver_ = std::make_unique<checkpoint::AsyncSaver>(c_, *mesh_);
  take_state(parallelize(c_, *mesh_, device_, dtype_));
  const auto& t = c_.training;
  const bool sp = c_.parallel.sequence_parallel && l.tp > 1;
  // One micro-batch between stages: this cp rank's tokens (SP: its tp share of them).
  activation_shape_ = {t.micro_batch, t.seq_len / l.cp / (sp ? l.tp : 1), c_.model.hidden};
  executor_ = make_executor(parallel::pp::make_schedule(c_.parallel.pipeline_schedule, l.pp,
                                                        t.global_batch / (l.dp * t.micro_batch),
                                                        c_.parallel.virtual_stages));
  if (plan::pairs_microbatches(c_, mesh_->world(), device_.is_cuda(), at::get_num_threads())) {
    std::vector<torch::Tensor> weights;
    for (const auto& p : models::named_params(model_)) weights.push_back(p.tensor);
    executor_->pair_microbatches(std::move(weights));
  }
  validator_ = std::make_unique<Validator>(c_, *mesh_, *data_, device_,
                                           [this](auto s) { return make_executor(std::move(s)); });
  if (mesh_->rank() == 0) metrics_ = std::make_unique<observe::MetricsLog>(c_, first_step_ - 1);
  log_layout(world);
  measure_flops();
  log_state();
  // The last look at start-up's signals; from the next line on the first step's vote sees them.
  observe::stop_if_signalled(resumed_from_.empty() ? "building the run" : "resuming the run");
  observe::end_start_up();
  stop_ = std::make_unique<StopOnSignal>(c_.checkpoint.on_signal, device_);
  counters_ = std::make_unique<StepCounters>(*mesh_, device_);
  if (const auto [a, b] = plan::profile_steps(c_, first_step_); b >= a)
    profiler_ = std::make_unique<observe::StepProfiler>(
        a, b, (std::filesystem::path(c_.run.output_dir) / "profile").string(), mesh_->rank(),
        device_.is_cuda());
  setup_rss_ = observe::peak_rss_bytes();  // before any step: what the steps add is activations
}

// The model, optimizer and gradient synchronisation parallelize() built (from a checkpoint when
// it resumed one).
void Trainer::take_state(TrainState st) {
  model_ = std::move(st.model);
  model_step_ = ModelStep::make(c_, model_, *mesh_, device_);
  opt_ = std::move(st.opt);
  scaler_ = std::move(st.scaler);
  sync_ = std::move(st.sync);
  tp_summed_grads_ = std::move(st.tp_summed_grads);
  embedding_grads_ = std::move(st.embedding_grads);
  resumed_from_ = st.resumed_from;
  model_->set_loss_mask_after(loss_eod_);
  observe::stop_if_signalled(resumed_from_.empty() ? "building the model"
                                                   : "reading the checkpoint");
  if (!resumed_from_.empty()) {
    first_step_ = st.resumed.step + 1;
    consumed_ = st.resumed.consumed_samples;
  }
}

std::unique_ptr<parallel::pp::Executor> Trainer::make_executor(parallel::pp::Schedule s) const {
  return std::make_unique<parallel::pp::Executor>(
      mesh_->group(parallel::GroupKind::kPp), std::move(s), activation_shape_,
      torch::TensorOptions().dtype(dtype_).device(device_));
}

void Trainer::stage_inputs(int64_t step) {
  const auto& t = c_.training;
  // This data rank's rows of the global batch (the next B positions of the global order).
  const int64_t rows = t.global_batch / mesh_->layout().dp;
  const auto host = data_->train_batch(consumed_ + mesh_->coord().dp * rows, rows);
  in_.docs =
      micro_batch_documents(c_, doc_eod_, host, device_);  // found on the host, before the copy
  auto batch = to_device(host, device_);
  // data.eod_mask_loss: the loss is the mean over the global batch's scored targets; every rank
  // counts them on the host from the whole batch's tokens (no collective, no device read).
  // With one data rank its rows are the whole batch: not read twice.
  in_.scored = loss_eod_ < 0 ? t.global_batch * t.seq_len
                             : scored_targets(rows == t.global_batch
                                                  ? host
                                                  : data_->train_batch(consumed_, t.global_batch),
                                              t.seq_len, loss_eod_);
  consumed_ += t.global_batch;
  in_.put(std::move(batch), optim::lr_at(t, step), step, stop_->vote(), graph_.on(), device_);
}

Trainer::StepOut Trainer::train_step(int64_t step) {
  stage_inputs(step);
  // The injected overflow (a test hook) changes what the step computes: never captured.
  const bool overflow = step == c_.training.loss_scale.inject_overflow_step;
  if (saver_ && graph_.on()) saver_->before_state_changes();  // a replayed step is one launch
  auto out = graph_.run(
      step, overflow, [&] { return device_step(overflow); }, [&] { sync_->abandon_step(); });
  if (!graph_.on()) in_.release();
  return out;
}

// One step on the device: the schedule's forwards and backwards, the gradients' synchronisation,
// the clipped norm (with the stop votes), the update.
Trainer::StepOut Trainer::device_step(bool overflow) {
  const auto& t = c_.training;
  // The loss rule: sum of token losses over the global batch / its number of target tokens (with
  // data.eod_mask_loss those it scores; the MoE balance loss stays per token).
  const double every = 1.0 / static_cast<double>(t.global_batch * t.seq_len);
  const double scale = 1.0 / static_cast<double>(std::max<int64_t>(1, in_.scored));
  // Each micro-batch's loss, added in micro-batch order after the step (paired micro-batches
  // finish in either order).
  std::vector<torch::Tensor> losses(static_cast<size_t>(executor_->schedule().microbatches));
  sync_->begin_step();  // ZeRO-1/2: the weights' gathers, waited for unit by unit by forward
  if (model_step_) model_step_->begin(every, *scaler_);
  {
    RECORD_USER_SCOPE("tessel::forward_backward");
    const auto stats = executor_->run(step_fns(scale, overflow, losses));
    pp_peak_activations_ = std::max(pp_peak_activations_, stats.peak_activations);
  }
  RECORD_USER_SCOPE("tessel::grad_sync_and_optimizer");
  sync_->finish_backward();
  sync_replicated_grads();
  auto [norm, votes] = clip_and_vote();
  if (saver_) saver_->before_state_changes();  // an async save's copies to host are done
  sync_->before_optimizer();
  opt_->step(in_.lr, scaler_->update(norm, in_.step));  // a non-finite step is skipped
  sync_->after_optimizer();
  if (model_step_) model_step_->after_update();
  auto loss = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
  for (const auto& l_mb : losses)
    if (l_mb.defined()) loss += l_mb;
  return {loss, norm, votes};
}

// What the schedule runs (one stage: F0 B0 F1 B1 ...): each micro-batch's forward, its loss
// (scaled by the loss rule, and for fp16 into range) kept in `losses`, and the gradient sync
// around each backward.
parallel::pp::StageFns Trainer::step_fns(double scale, bool overflow,
                                         std::vector<torch::Tensor>& losses) {
  const auto& t = c_.training;
  return {
      [this, &t, &losses, scale, overflow](int64_t mb, int64_t chunk, const torch::Tensor& input) {
        auto out = model_->stage_forward(
            chunk, input, in_.batch.narrow(0, mb * t.micro_batch, t.micro_batch),
            in_.docs.empty() ? nullptr : &in_.docs[static_cast<size_t>(mb)]);
        if (!model_->is_last_stage(chunk)) return out;
        out = out * scale;
        losses[static_cast<size_t>(mb)] = out.detach();
        if (scaler_->dynamic()) out = out * scaler_->scale();  // fp16: scaled into range
        return overflow ? out * 1e30 : out;
      },
      [this](int64_t chunk, bool final) { sync_->begin_backward(chunk, final); },
      [this](int64_t chunk, bool final) { sync_->end_backward(chunk, final); }};
}

// The gradient norm, clipped, and the ranks' stop votes. The norm sums over every rank, each
// adding its squares by the data-parallel synchronisation's share (GradSync::norm_share). Every
// rank joins this all-reduce on every step, so it also carries the stop-on-signal votes.
std::pair<torch::Tensor, torch::Tensor> Trainer::clip_and_vote() {
  const double share = sync_->norm_share();
  torch::Tensor votes;
  auto norm = opt_->clip_grad_norm(
      c_.training.grad_clip,
      [&](torch::Tensor& sq) {
        auto both = torch::stack({share == 1.0   ? sq
                                  : share == 0.0 ? torch::zeros_like(sq)
                                                 : sq * share,
                                  in_.vote.to(sq.scalar_type())});
        mesh_->world_group().all_reduce(both).wait();
        sq = both[0];
        votes = both[1];
      },
      scaler_->unscale());
  return {norm, votes};
}

Validation Trainer::evaluate() {
  sync_->weights_ready();
  carried_exposed_ms_ += sync_->take_wait_ms();  // the steps' so far
  const auto v = validator_->run(model_, executor_->schedule());
  sync_->take_wait_ms();  // evaluation's gathers are not a step's
  return v;
}

Trainer::~Trainer() = default;

void Trainer::sync_replicated_grads() {
  // Replicated parameters whose tp ranks each hold part of the gradient (sequence-parallel
  // norms and biases, key/value projections shared by query heads on several ranks): sum them.
  // One all-reduce for all of them (not one per parameter).
  mesh_->group(parallel::GroupKind::kTp).all_reduce_coalesced(tp_summed_grads_, sum_staging_);
  // A tied token table lives on the first stage (embedding) and the last (head): each holds part
  // of its gradient; the sum keeps the two copies equal (Megatron's embedding group).
  mesh_->group(parallel::GroupKind::kEmbedding)
      .all_reduce_coalesced(embedding_grads_, sum_staging_);
}

void Trainer::check_finite() const {
  if (const int64_t bad = scaler_->first_non_finite_step())
    throw plan::UserError(fmt::format(
        "step {}: the loss or the gradient norm is not finite (training.dtype {}); that step's "
        "update was skipped and training stops here, saving nothing from step {} on. Lower "
        "training.optimizer.lr, set training.grad_clip, or check the data; the last checkpoint "
        "in {} resumes the run",
        bad, c_.training.dtype.name(), bad, c_.checkpoint_dir()));
}

int Trainer::train() {
  const auto& t = c_.training;
  start_time_ = last_log_time_ = std::chrono::steady_clock::now();
  last_log_step_ = first_step_ - 1;
  if (first_step_ > t.steps)
    spdlog::info("nothing to do: the checkpoint is at step {} of {}", first_step_ - 1, t.steps);
  graph_.start(t.cuda_graph);  // after the warm-up steps, one captured step replayed
  for (int64_t step = first_step_; step <= t.steps; ++step) {
    if (peers_) peers_->set_step(step);
    counters_->begin_step();
    if (profiler_) profiler_->before_step(step);
    StepOut out = train_step(step);
    if (profiler_)
      if (auto table = profiler_->after_step(step); !table.empty()) spdlog::info("{}", table);
    counters_->end_step(/*host_ran=*/!graph_.replayed());  // a replay's collectives go uncounted
    if (step == first_step_) executor_->take_times();      // the warm-up step is not timed
    const bool last = step == t.steps, stop = stop_->stop_after(out.stop_votes);  // every rank's
    if (step % c_.logging.every == 0 || last || stop) log_step(step, out);
    if (t.eval_every > 0 && (step % t.eval_every == 0 || last)) {
      auto t0 = std::chrono::steady_clock::now();
      const auto val = evaluate();
      if (metrics_)
        metrics_->eval(
            step, val.loss,
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count(),
            consumed_ * t.seq_len, val.by_dataset);
      last_log_time_ += std::chrono::steady_clock::now() - t0;  // keep evaluation out of ms/step
    }
    if ((c_.checkpoint.every > 0 && step % c_.checkpoint.every == 0) || last || stop) {
      auto t0 = std::chrono::steady_clock::now();
      check_finite();  // a non-finite step is never saved
      sync_->weights_ready();
      save(step, last || stop);
      last_log_time_ += std::chrono::steady_clock::now() - t0;
    }
    if (stop && !last) {
      spdlog::warn(
          "stopped after step {} on a signal, its checkpoint saved; exit {}: run the same "
          "command again to resume",
          step, kExitStopped);
      shut_down();
      return kExitStopped;
    }
  }
  graph_.stop();
  report_end();
  // The last checkpoint is complete on every rank (its save ends with a world barrier).
  shut_down();  // before rank 0's export: the others need not wait for it
  if (!c_.checkpoint.export_hf.empty() && mesh_->rank() == 0)
    checkpoint::export_hf(c_.checkpoint_dir(), c_.checkpoint.export_hf, "", "checkpoint.export_hf");
  return 0;
}

// Step `step`'s checkpoint: written now, or (checkpoint.async) copied to host memory and written
// in the background; a `final` one (the last step, a stop) is waited for.
void Trainer::save(int64_t step, bool final) {
  if (!saver_) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto dir =
        checkpoint::save_checkpoint(c_, *mesh_, model_, *opt_, *scaler_, {step, consumed_});
    spdlog::info(
        "checkpoint {} (held training {:.0f} ms)", dir,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    return;
  }
  const auto held = saver_->save(model_, *opt_, *scaler_, {step, consumed_});
  spdlog::info(
      "checkpoint step {}: held training {:.0f} ms to copy it to host memory ({:.2f} MiB{}){}; "
      "written in the background",
      step, held.copy_ms, held.arena_bytes / 1048576.0, device_.is_cuda() ? ", pinned" : "",
      held.wait_ms >= 1
          ? fmt::format(" (after {:.0f} ms waiting for the save before)", held.wait_ms)
          : "");
  if (final) saver_->wait();
}

void Trainer::shut_down() {
  if (saver_) saver_->wait();  // the save in flight published first
  saver_.reset();
  graph_.stop();
  if (sync_) sync_->weights_ready();
  const int64_t n = mesh_->shutdown();
  if (mesh_->world() > 1)
    spdlog::info("every rank reached the end; {} communicators of this rank shut down", n);
}

}  // namespace tessel::run
