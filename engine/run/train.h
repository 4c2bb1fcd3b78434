// The training run: components are built once (device, model, optimizer, data, metrics,
// checkpoints); train() loops over steps; train_step() runs the micro-batches of one global batch.
#pragma once

#include <torch/types.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/observe/metrics.h"
#include "core/observe/timing.h"
#include "core/optim/loss_scale.h"
#include "core/optim/optim.h"
#include "core/plan/config.h"
#include "engine/checkpoint/save.h"
#include "engine/data/dataset.h"
#include "engine/data/vocabulary.h"
#include "engine/planner/figures.h"
#include "engine/run/build.h"
#include "engine/run/model_step.h"
#include "engine/run/startup.h"
#include "engine/run/step_graph.h"
#include "engine/run/stop.h"
#include "engine/run/validate.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/mesh.h"

namespace tessel::observe {
class StepProfiler;
}  // namespace tessel::observe
namespace tessel::parallel::dp {
class GradSync;
}  // namespace tessel::parallel::dp
namespace tessel::parallel::pp {
class Executor;
struct StageFns;
struct StepStats;
struct Schedule;
}  // namespace tessel::parallel::pp

namespace tessel::run {

struct TrainState;  // engine/run/parallelize.h
class StepCounters;

class Trainer {
 public:
  /// Builds the mesh over the started run's store, then the model, optimizer and data.
  Trainer(Start start, const parallel::WorldInfo& world);
  ~Trainer();
  /// Trains to training.steps (0), or until a signal of checkpoint.on_signal: then every rank
  /// saves after the same step and it returns kExitStopped.
  int train();

 private:
  struct StepOut {
    torch::Tensor loss, grad_norm;  // device scalars: read only when logging
    torch::Tensor stop_votes;       // ranks that had seen a stop signal (engine/run/stop.h)
  };
  /// Communication the steps since the last call did not hide, ms (reads device timers).
  double take_exposed_comm_ms();
  void log_state() const;  // the start lines about parameters and state bytes
  StepOut train_step(int64_t step);
  /// The step's inputs into in_ (host work: the batch, and the rate, step number and stop vote
  /// as device scalars) before device_step runs or a captured step replays.
  void stage_inputs(int64_t step);
  /// Everything a step queues on the device, reading its inputs from in_ only and never waiting
  /// on the host: what training.cuda_graph captures (engine/run/step_graph.h).
  StepOut device_step(bool overflow);
  parallel::pp::StageFns step_fns(double scale, bool overflow, std::vector<torch::Tensor>& losses);
  std::pair<torch::Tensor, torch::Tensor> clip_and_vote();  // the clipped norm, the stop votes
  Validation evaluate();  // every rank: the weights gathered, no step's waits counted
  void sync_replicated_grads();
  void check_finite() const;  // host sync: throws UserError naming the first non-finite step
  void log_step(int64_t step, StepOut& out);
  std::unique_ptr<parallel::pp::Executor> make_executor(parallel::pp::Schedule s) const;
  void take_state(TrainState st);
  void log_layout(const parallel::WorldInfo& world) const;  // the start lines about the layout
  void measure_flops();  // FLOPs per token (over every stage) and the device peak
  /// Every rank's `mine` gathered to rank 0: [world, n] on the CPU there, undefined elsewhere.
  torch::Tensor gather_figures(const std::vector<double>& mine) const;
  void write_report(const std::string& file, const nlohmann::json& report) const;  // output_dir
  void report_pipeline();
  void report_memory();
  void shut_down();   // the end every rank reaches together: parallel::Mesh::shutdown
  void report_end();  // the figures printed and written when the run is done

  plan::Config c_;
  std::shared_ptr<Peers> peers_;  // several ranks: heartbeat and failures (startup.h)
  RunLock lock_;                  // rank 0: the run folder is ours
  std::unique_ptr<parallel::Mesh> mesh_;
  std::string device_why_;  // why this device (the start-up log); before device_, which sets it
  std::string attention_;   // the attention kernel, for the start-up log
  std::string fp8_;         // training.fp8 in words ("" off), for the start-up log
  torch::Device device_;
  torch::ScalarType dtype_;
  models::Decoder model_{nullptr};
  std::unique_ptr<ModelStep> model_step_;  // the model's own hooks around a step; null: none
  std::unique_ptr<optim::FlatAdamW> opt_;
  std::unique_ptr<parallel::dp::GradSync> sync_;  // DDP or ZeRO-1/2/3 (parallel/dp/grad_sync.h)
  std::unique_ptr<optim::LossScaler> scaler_;
  std::unique_ptr<StopOnSignal> stop_;
  std::unique_ptr<StepCounters> counters_;  // per-step comm bytes and memory (the planner's)
  std::unique_ptr<observe::StepProfiler> profiler_;  // logging.profile: null when unset
  // Views of the reduced gradient this rank holds (its ZeRO pieces): parameters whose gradient
  // is summed over tp, and a tied token table on the first or last stage (summed over both).
  std::vector<torch::Tensor> tp_summed_grads_, embedding_grads_;
  torch::Tensor sum_staging_;  // their packed buffer for one all-reduce
  std::unique_ptr<parallel::pp::Executor> executor_;
  std::vector<int64_t> activation_shape_;  // one micro-batch's activation between stages
  // Pipeline figures summed over the steps after the first (which warms up): step, compute, wait.
  double pp_step_ms_ = 0, pp_compute_ms_ = 0, pp_wait_ms_ = 0;
  int64_t pp_steps_ = 0, pp_peak_activations_ = 0;
  StepInputs in_;               // engine/run/step_graph.h
  int64_t doc_eod_ = -1;        // data.document_mask: the id documents end with (-1: no mask)
  int64_t loss_eod_ = -1;       // data.eod_mask_loss: the id masked after (-1: none)
  GraphedStep<StepOut> graph_;  // training.cuda_graph (off: steps run as they are)
  std::unique_ptr<checkpoint::AsyncSaver> saver_;  // checkpoint.async; null otherwise
  void save(int64_t step, bool final);
  std::unique_ptr<data::Dataset> data_;
  std::unique_ptr<Validator> validator_;
  std::unique_ptr<observe::MetricsLog> metrics_;
  double flops_per_token_ = 0;
  planner::Peak peak_;
  bool peak_remeasured_ = false;  // a measured peak the steps passed was measured again
  void check_peak(int64_t step, double tflops);
  // Timing between logged steps: the loss read at a log step is the only host sync.
  std::chrono::steady_clock::time_point last_log_time_, start_time_;
  int64_t last_log_step_ = 0;
  double carried_exposed_ms_ = 0;  // taken early (before an evaluation), not yet logged
  int64_t first_step_ = 1;         // > 1 when resumed
  std::string resumed_from_;       // the checkpoint folder, when resumed
  int64_t consumed_ = 0;           // the data position: global samples consumed so far
  int64_t setup_rss_ = 0;          // peak resident set before the first step
};

}  // namespace tessel::run
