#include "engine/run/step_graph.h"

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

}  // namespace tessel::run
