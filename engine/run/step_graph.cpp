#include "engine/run/step_graph.h"

#include <spdlog/spdlog.h>

#include <exception>
#include <utility>

#include "core/plan/user_error.h"

namespace tessel::run {

std::unique_ptr<GraphBackend> make_cuda_graph_backend() {
  const auto* cuda = device::cuda_module();
  if (!cuda)
    throw plan::UserError("training.cuda_graph needs CUDA: " + device::cuda_unavailable_reason());
  return cuda->make_graph();
}

StepGraph::StepGraph(std::unique_ptr<GraphBackend> backend, int64_t warmup_steps)
    : backend_(std::move(backend)), warmup_left_(warmup_steps) {
  backend_->enter_stream();
}

StepGraph::~StepGraph() { backend_->leave_stream(); }

StepGraph::Ran StepGraph::run(bool eager_only, const std::function<void()>& step,
                              const std::function<void()>& undo) {
  if (captured_ && !eager_only) {
    backend_->replay();
    return Ran::kReplayed;
  }
  if (eager_only || failed() || captured_ || warmup_left_ > 0) {
    if (!eager_only && warmup_left_ > 0) --warmup_left_;
    step();
    return Ran::kEager;
  }
  try {
    backend_->begin();
    step();
    backend_->end();
  } catch (const std::exception& e) {
    backend_->abort();
    failure_ = e.what();
    if (failure_.empty()) failure_ = "capture failed";
    undo();
    step();
    return Ran::kEager;
  }
  captured_ = true;
  backend_->replay();  // the capture only recorded the step: run it
  return Ran::kCaptured;
}

void StepGraph::log(int64_t step, Ran ran) {
  if (failed() && !failure_logged_) {
    failure_logged_ = true;
    spdlog::warn("training.cuda_graph: capturing step {} failed; every step runs eagerly: {}", step,
                 failure_);
  } else if (ran == Ran::kCaptured) {
    spdlog::info("training.cuda_graph: step {} captured; later steps replay it", step);
  }
}

void StepInputs::put(torch::Tensor rows, double rate, int64_t number,
                     const torch::Tensor& stop_vote, bool fixed, const torch::Device& device) {
  if (!lr.defined()) {
    lr = fixed ? torch::zeros({}, torch::dtype(torch::kFloat32).device(device))
               : torch::zeros({}, torch::dtype(torch::kFloat64));
    step = torch::zeros({}, torch::dtype(torch::kInt64).device(device));
    vote = torch::zeros({}, torch::dtype(torch::kFloat32).device(device));
  }
  if (fixed && batch.defined())
    batch.copy_(rows);
  else
    batch = fixed ? rows.clone() : std::move(rows);
  lr.fill_(rate);
  step.fill_(number);
  vote.copy_(stop_vote);
}

void StepInputs::release() {
  batch = torch::Tensor();
  docs.clear();
}

}  // namespace tessel::run
