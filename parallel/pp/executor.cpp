#include "parallel/pp/executor.h"

#include <c10/core/thread_pool.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

#include "parallel/pp/weight_grad.h"

namespace tessel::parallel::pp {
namespace {

// What one (micro-batch, chunk) holds between its actions.
struct Held {
  torch::Tensor input;         // received activation (a leaf: its .grad goes back to the sender)
  torch::Tensor output;        // activation to send (dropped once posted; the send keeps it alive)
  torch::autograd::Edge edge;  // where backward starts: the output's grad_fn
  torch::Tensor grad;          // received gradient of the output (last stage: ones)
};

// A posted receive: waited for by the pass that needs it.
struct Pending {
  Work work;
  torch::Tensor host, dst;  // staged: lands in `host`, then copied into `dst`
};
using RecvKey = std::tuple<int64_t, int64_t, bool>;  // (micro-batch, chunk, gradient?)

// One step's sends and receives: queued as the list names them, posted together by flush().
class Transfers {
 public:
  Transfers(Group& pp, const std::vector<int64_t>& shape, const torch::TensorOptions& options,
            observe::SpanTimer& wait)
      : pp_(pp),
        shape_(shape),
        options_(options),
        wait_(wait),
        // Gloo's send/recv move host memory only: CUDA tensors travel through host copies.
        staged_(options.device().is_cuda() && pp.is_gloo()) {}

  void send(const torch::Tensor& t, int64_t peer, int tag) {
    batch_.push_back({P2POp::kSend, to_send(t), peer, tag});
  }
  void recv(const torch::Tensor& dst, int64_t peer, int tag, RecvKey key) {
    Pending r{{},
              staged_ ? torch::empty(shape_, options_.device(torch::kCPU).pinned_memory(true))
                      : torch::Tensor(),
              dst};
    batch_.push_back({P2POp::kRecv, staged_ ? r.host : dst, peer, tag});
    posted_.emplace_back(key, std::move(r));
  }
  void flush();
  // Waits for the receive `key`, if one is pending.
  void await(const RecvKey& key) {
    auto it = pending_.find(key);
    if (it == pending_.end()) return;
    land(it->second);
    pending_.erase(it);
  }
  // The end of pipeline rank `rank`'s step: posts what is queued, waits for every send.
  void finish(int64_t rank);

 private:
  torch::Tensor to_send(const torch::Tensor& t) const {
    return staged_ ? t.detach().to(torch::kCPU) : t.detach().contiguous();
  }
  void land(Pending& r) {
    wait_.start();
    r.work.wait();
    wait_.stop();
    if (r.host.defined()) r.dst.copy_(r.host, /*non_blocking=*/true);
  }

  Group& pp_;
  const std::vector<int64_t>& shape_;
  torch::TensorOptions options_;
  observe::SpanTimer& wait_;
  const bool staged_;
  std::map<RecvKey, Pending> pending_;
  std::vector<P2POp> batch_;
  std::vector<std::pair<RecvKey, Pending>> posted_;  // this batch's receives, in batch order
  std::vector<Work> sends_;
};

// Posts the pending sends and receives. Over channels every operation has its own work: sends
// finish in the background and each receive is waited for by the pass that needs it. A group
// without channels on NCCL returns one work for the batch, which orders the compute stream after
// all of it.
void Transfers::flush() {
  if (batch_.empty()) return;
  auto works = pp_.send_recv(batch_);
  if (works.size() != batch_.size()) {
    wait_.start();
    for (auto& w : works) w.wait();
    wait_.stop();
    for (auto& [key, r] : posted_) land(r);
  } else {
    size_t next_recv = 0;
    for (size_t i = 0; i < works.size(); ++i) {
      if (batch_[i].kind == P2POp::kSend) {
        sends_.push_back(std::move(works[i]));
      } else {
        auto& [key, r] = posted_[next_recv++];
        r.work = std::move(works[i]);
        pending_.emplace(key, std::move(r));
      }
    }
  }
  batch_.clear();
  posted_.clear();
  sends_.erase(
      std::remove_if(sends_.begin(), sends_.end(), [](const Work& w) { return w.completed(); }),
      sends_.end());
}

void Transfers::finish(int64_t rank) {
  flush();
  TORCH_CHECK(pending_.empty(), "pipeline rank ", rank, ": ", pending_.size(),
              " received tensors were never used");
  wait_.start();
  for (auto& w : sends_) w.wait();
  wait_.stop();
}

// One run of a rank's action list: what each (micro-batch, chunk) holds, and its transfers.
class StepRun {
 public:
  StepRun(const Schedule& s, int64_t rank, const StageFns& fns, Group& pp,
          const std::vector<int64_t>& shape, const torch::TensorOptions& options,
          observe::SpanTimer& compute, observe::SpanTimer& wait)
      : s_(s),
        p_(s.stages),
        stages_(s.stages * s.virtual_stages),
        m_(s.microbatches),
        r_(rank),
        fns_(fns),
        shape_(shape),
        options_(options),
        compute_(compute),
        io_(pp, shape, options, wait) {}

  // `final`: a backward that is its chunk's last of the step.
  void act(const Action& a, bool final);
  StepStats finish() {
    io_.finish(r_);
    TORCH_CHECK(local_.empty() && deferred_.empty(), "pipeline rank ", r_,
                ": a stage-to-stage message on this rank or a weight-gradient backward was left");
    return st_;
  }

 private:
  // A message's tag: (activation or gradient, sending stage, micro-batch), unique in the step.
  int tag(bool grad, int64_t from_stage, int64_t mb) const {
    return static_cast<int>(((grad ? stages_ : 0) + from_stage) * m_ + mb);
  }
  void forward(const Action& a, int64_t stage, Held& h);
  void backward(const Action& a, int64_t stage, Held& h, bool final);
  void backward_input(const Action& a, int64_t stage, Held& h);
  void backward_weight(const Action& a, bool final);
  // A message between two stages of this rank (a V's turn) is handed over here, not sent.
  void put_local(const RecvKey& key, const torch::Tensor& t) { local_[key] = t.detach(); }
  torch::Tensor take_local(const RecvKey& key) {
    auto it = local_.find(key);
    TORCH_CHECK(it != local_.end(), "pipeline rank ", r_, ": receives from itself before sending");
    auto t = std::move(it->second);
    local_.erase(it);
    return t;
  }

  const Schedule& s_;
  const int64_t p_, stages_, m_, r_;
  const bool training_ = torch::GradMode::is_enabled();
  const StageFns& fns_;
  const std::vector<int64_t>& shape_;
  torch::TensorOptions options_;
  observe::SpanTimer& compute_;
  std::map<std::pair<int64_t, int64_t>, Held> held_;             // by (micro-batch, chunk)
  std::map<std::pair<int64_t, int64_t>, WeightGrads> deferred_;  // between a B and its W
  std::map<RecvKey, torch::Tensor> local_;
  Transfers io_;
  StepStats st_;
  int64_t live_ = 0;
};

void StepRun::act(const Action& a, bool final) {
  const int64_t stage = s_.stage_of(r_, a.chunk);
  const int64_t prev = s_.rank_of(stage - 1 + (stage == 0 ? stages_ : 0));
  const int64_t next = s_.rank_of((stage + 1) % stages_);
  if (a.op == Op::kBackwardWeight) return backward_weight(a, final);
  Held& h = held_[{a.microbatch, a.chunk}];
  const RecvKey act{a.microbatch, a.chunk, false}, grad{a.microbatch, a.chunk, true};
  switch (a.op) {
    case Op::kRecvAct:
      if (prev == r_) {
        h.input = take_local(act);
        break;
      }
      h.input = torch::empty(shape_, options_);
      io_.recv(h.input, prev, tag(false, stage - 1, a.microbatch), act);
      break;
    case Op::kSendAct:
      if (next == r_)
        put_local({a.microbatch, s_.chunk_of(stage + 1), false}, h.output);
      else
        io_.send(h.output, next, tag(false, stage, a.microbatch));
      h.output = torch::Tensor();
      break;
    case Op::kRecvGrad:
      if (next == r_) {
        h.grad = take_local(grad);
        break;
      }
      h.grad = torch::empty(shape_, options_);
      io_.recv(h.grad, next, tag(true, stage + 1, a.microbatch), grad);
      break;
    case Op::kSendGrad:
      TORCH_CHECK(h.input.grad().defined(), "pipeline stage ", stage, ": micro-batch ",
                  a.microbatch, " has no input gradient to send");
      if (prev == r_)
        put_local({a.microbatch, s_.chunk_of(stage - 1), true}, h.input.grad());
      else
        io_.send(h.input.grad(), prev, tag(true, stage, a.microbatch));
      held_.erase({a.microbatch, a.chunk});
      break;
    case Op::kForward:
      forward(a, stage, h);
      break;
    case Op::kBackward:
      backward(a, stage, h, final);
      break;
    case Op::kBackwardInput:
      backward_input(a, stage, h);
      break;
    case Op::kBackwardWeight:
      break;
  }
}

void StepRun::forward(const Action& a, int64_t stage, Held& h) {
  io_.flush();
  io_.await({a.microbatch, a.chunk, false});
  if (training_ && h.input.defined()) h.input.requires_grad_(true);
  compute_.start();
  auto out = fns_.forward(a.microbatch, a.chunk, h.input);
  compute_.stop();
  const bool last = stage == stages_ - 1;
  if (training_) {
    h.edge = torch::autograd::impl::gradient_edge(out);
    if (last) h.grad = torch::ones_like(out);
    st_.peak_activations = std::max(st_.peak_activations, ++live_);
  } else {
    h.input = torch::Tensor();
  }
  if (!last) h.output = out;
  if (!training_ && last) held_.erase({a.microbatch, a.chunk});
}

void StepRun::backward(const Action& a, int64_t stage, Held& h, bool final) {
  io_.flush();
  io_.await({a.microbatch, a.chunk, true});
  TORCH_CHECK(h.edge.function, "pipeline stage ", stage, ": backward of micro-batch ", a.microbatch,
              " before its forward");
  if (fns_.before_backward) fns_.before_backward(a.chunk, final);
  compute_.start();
  torch::autograd::Engine::get_default_engine().execute({h.edge}, {h.grad}, /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true, /*outputs=*/{});
  compute_.stop();
  if (fns_.after_backward) fns_.after_backward(a.chunk, final);
  --live_;
  h.edge = torch::autograd::Edge();
  h.grad = torch::Tensor();
  if (stage == 0) held_.erase({a.microbatch, a.chunk});
}

// B: the input's gradient (kept in the input for kSendGrad); the weights' left for W.
void StepRun::backward_input(const Action& a, int64_t stage, Held& h) {
  io_.flush();
  io_.await({a.microbatch, a.chunk, true});
  TORCH_CHECK(h.edge.function, "pipeline stage ", stage, ": backward of micro-batch ", a.microbatch,
              " before its forward");
  compute_.start();
  {
    Deferring scope(deferred_[{a.microbatch, a.chunk}]);
    auto g = pp::backward_input(h.edge, h.grad, {h.input});
    if (h.input.defined()) h.input.mutable_grad() = g[0];
  }
  compute_.stop();
  h.edge = torch::autograd::Edge();
  h.grad = torch::Tensor();
  if (stage == 0) held_.erase({a.microbatch, a.chunk});
}

// W: the weights' gradients into the parameters, between the hooks a whole backward has.
void StepRun::backward_weight(const Action& a, bool final) {
  auto it = deferred_.find({a.microbatch, a.chunk});
  TORCH_CHECK(it != deferred_.end(), "pipeline rank ", r_,
              ": weight-gradient backward of micro-batch ", a.microbatch, " chunk ", a.chunk,
              " before its input-gradient backward");
  if (fns_.before_backward) fns_.before_backward(a.chunk, final);
  compute_.start();
  it->second.deliver();
  compute_.stop();
  if (fns_.after_backward) fns_.after_backward(a.chunk, final);
  deferred_.erase(it);
  --live_;
}

}  // namespace

Executor::Executor(Group& pp, Schedule schedule, std::vector<int64_t> activation_shape,
                   torch::TensorOptions options)
    : pp_(pp),
      schedule_(std::move(schedule)),
      shape_(std::move(activation_shape)),
      options_(options),
      step_(observe::time_on_device(options.device(), pp.is_nccl())),
      compute_(observe::time_on_device(options.device(), pp.is_nccl())),
      wait_(observe::time_on_device(options.device(), pp.is_nccl())) {
  TORCH_CHECK(pp_.size() == schedule_.stages, "pipeline group of ", pp_.size(),
              " ranks for a schedule of ", schedule_.stages);
  if (pp_.size() > 1) {  // channels match messages in order: the lists must agree on it
    const auto sim = simulate(schedule_);
    TORCH_CHECK(sim.problem.empty() && sim.ordered_messages, "pipeline schedule ", schedule_.name,
                ": ",
                sim.problem.empty() ? "a rank receives a peer's messages in another order than "
                                      "the peer sends them"
                                    : sim.problem);
  }
  const auto& list = schedule_.ranks[static_cast<size_t>(pp_.rank())];
  last_backward_.assign(list.size(), false);
  std::vector<bool> seen(static_cast<size_t>(schedule_.virtual_stages), false);
  for (size_t i = list.size(); i-- > 0;)
    if ((list[i].op == Op::kBackward || list[i].op == Op::kBackwardWeight) &&
        !seen[static_cast<size_t>(list[i].chunk)])
      seen[static_cast<size_t>(list[i].chunk)] = last_backward_[i] = true;
}

StepStats Executor::run(const StageFns& fns) {
  if (lane_ && torch::GradMode::is_enabled()) return run_pairs(fns);
  step_.start();
  const int64_t r = pp_.rank();
  StepRun step(schedule_, r, fns, pp_, shape_, options_, compute_, wait_);
  const auto& list = schedule_.ranks[static_cast<size_t>(r)];
  for (size_t i = 0; i < list.size(); ++i) step.act(list[i], last_backward_[i]);
  const StepStats st = step.finish();
  step_.stop();
  return st;
}

StepTimes Executor::take_times() { return {step_.take_ms(), compute_.take_ms(), wait_.take_ms()}; }

}  // namespace tessel::parallel::pp
