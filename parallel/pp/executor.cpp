#include "parallel/pp/executor.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <tuple>

namespace tessel::parallel::pp {
namespace {

// What one (micro-batch, chunk) holds between its actions.
struct Held {
  torch::Tensor input;         // received activation (a leaf: its .grad goes back to the sender)
  torch::Tensor output;        // activation to send (dropped once posted; the send keeps it alive)
  torch::autograd::Edge edge;  // where backward starts: the output's grad_fn
  torch::Tensor grad;          // received gradient of the output (last stage: ones)
};

}  // namespace

Executor::Executor(Group& pp, Schedule schedule, std::vector<int64_t> activation_shape,
                   torch::TensorOptions options)
    : pp_(pp),
      schedule_(std::move(schedule)),
      shape_(std::move(activation_shape)),
      options_(options),
      step_(time_on_device(options.device(), pp.backend_name())),
      compute_(time_on_device(options.device(), pp.backend_name())),
      wait_(time_on_device(options.device(), pp.backend_name())) {
  TORCH_CHECK(pp_.size() == schedule_.stages, "pipeline group of ", pp_.size(),
              " ranks for a schedule of ", schedule_.stages);
  const auto& list = schedule_.ranks[static_cast<size_t>(pp_.rank())];
  last_backward_.assign(list.size(), false);
  std::vector<bool> seen(static_cast<size_t>(schedule_.virtual_stages), false);
  for (size_t i = list.size(); i-- > 0;)
    if (list[i].op == Op::kBackward && !seen[static_cast<size_t>(list[i].chunk)])
      seen[static_cast<size_t>(list[i].chunk)] = last_backward_[i] = true;
}

StepStats Executor::run(const StageFns& fns) {
  step_.start();
  const int64_t p = schedule_.stages, stages = p * schedule_.virtual_stages, r = pp_.rank();
  const int64_t m = schedule_.microbatches;
  const bool training = torch::GradMode::is_enabled();
  // A message's tag: (activation or gradient, sending stage, micro-batch), unique in the step.
  auto tag = [&](bool grad, int64_t from_stage, int64_t mb) {
    return static_cast<int>(((grad ? stages : 0) + from_stage) * m + mb);
  };
  std::map<std::pair<int64_t, int64_t>, Held> held;  // by (micro-batch, chunk)
  // Gloo's send/recv move host memory only: CUDA tensors travel through host copies.
  const bool staged = options_.device().is_cuda() && pp_.backend_name() == "gloo";
  auto to_send = [&](const torch::Tensor& t) {
    return staged ? t.detach().to(torch::kCPU) : t.detach().contiguous();
  };
  // A posted receive, by (micro-batch, chunk, gradient?): waited for by the pass that needs it.
  struct Pending {
    Work work;
    torch::Tensor host, dst;  // staged: lands in `host`, then copied into `dst`
  };
  using RecvKey = std::tuple<int64_t, int64_t, bool>;
  std::map<RecvKey, Pending> pending;
  std::vector<P2POp> batch;
  std::vector<std::pair<RecvKey, Pending>> posted;  // this batch's receives, in batch order
  auto post_recv = [&](const torch::Tensor& dst, int64_t peer, int tag_, RecvKey key) {
    Pending r{{},
              staged ? torch::empty(shape_, options_.device(torch::kCPU).pinned_memory(true))
                     : torch::Tensor(),
              dst};
    batch.push_back({P2POp::kRecv, staged ? r.host : dst, peer, tag_});
    posted.emplace_back(key, std::move(r));
  };
  std::vector<Work> sends;
  StepStats st;
  int64_t live = 0;
  auto land = [&](Pending& r) {
    wait_.start();
    r.work.wait();
    wait_.stop();
    if (r.host.defined()) r.dst.copy_(r.host, /*non_blocking=*/true);
  };
  // Posts the pending sends and receives together. Over Gloo every operation has its own work:
  // sends finish in the background and each receive is waited for by the pass that needs it.
  // NCCL returns one work for the batch, which orders the compute stream after all of it.
  auto flush = [&] {
    if (batch.empty()) return;
    auto works = pp_.send_recv(batch);
    if (works.size() != batch.size()) {
      wait_.start();
      for (auto& w : works) w.wait();
      wait_.stop();
      for (auto& [key, r] : posted) land(r);
    } else {
      size_t next_recv = 0;
      for (size_t i = 0; i < works.size(); ++i) {
        if (batch[i].kind == P2POp::kSend) {
          sends.push_back(std::move(works[i]));
        } else {
          auto& [key, r] = posted[next_recv++];
          r.work = std::move(works[i]);
          pending.emplace(key, std::move(r));
        }
      }
    }
    batch.clear();
    posted.clear();
    sends.erase(
        std::remove_if(sends.begin(), sends.end(), [](const Work& w) { return w.completed(); }),
        sends.end());
  };
  auto await = [&](int64_t mb, int64_t chunk, bool grad) {
    auto it = pending.find({mb, chunk, grad});
    if (it == pending.end()) return;
    land(it->second);
    pending.erase(it);
  };
  const auto& list = schedule_.ranks[static_cast<size_t>(r)];
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    const int64_t stage = a.chunk * p + r;
    const int64_t prev = (stage - 1 + p) % p, next = (stage + 1) % p;
    Held& h = held[{a.microbatch, a.chunk}];
    switch (a.op) {
      case Op::kRecvAct:
        h.input = torch::empty(shape_, options_);
        post_recv(h.input, prev, tag(false, stage - 1, a.microbatch),
                  {a.microbatch, a.chunk, false});
        break;
      case Op::kSendAct:
        batch.push_back({P2POp::kSend, to_send(h.output), next, tag(false, stage, a.microbatch)});
        h.output = torch::Tensor();
        break;
      case Op::kRecvGrad:
        h.grad = torch::empty(shape_, options_);
        post_recv(h.grad, next, tag(true, stage + 1, a.microbatch), {a.microbatch, a.chunk, true});
        break;
      case Op::kSendGrad:
        TORCH_CHECK(h.input.grad().defined(), "pipeline stage ", stage, ": micro-batch ",
                    a.microbatch, " has no input gradient to send");
        batch.push_back(
            {P2POp::kSend, to_send(h.input.grad()), prev, tag(true, stage, a.microbatch)});
        held.erase({a.microbatch, a.chunk});
        break;
      case Op::kForward: {
        flush();
        await(a.microbatch, a.chunk, false);
        if (training && h.input.defined()) h.input.requires_grad_(true);
        compute_.start();
        auto out = fns.forward(a.microbatch, a.chunk, h.input);
        compute_.stop();
        const bool last = stage == stages - 1;
        if (training) {
          h.edge = torch::autograd::impl::gradient_edge(out);
          if (last) h.grad = torch::ones_like(out);
          st.peak_activations = std::max(st.peak_activations, ++live);
        } else {
          h.input = torch::Tensor();
        }
        if (!last) h.output = out;
        if (!training && last) held.erase({a.microbatch, a.chunk});
        break;
      }
      case Op::kBackward: {
        flush();
        await(a.microbatch, a.chunk, true);
        TORCH_CHECK(h.edge.function, "pipeline stage ", stage, ": backward of micro-batch ",
                    a.microbatch, " before its forward");
        const bool final = last_backward_[i];
        if (fns.before_backward) fns.before_backward(a.chunk, final);
        compute_.start();
        torch::autograd::Engine::get_default_engine().execute(
            {h.edge}, {h.grad}, /*keep_graph=*/false, /*create_graph=*/false,
            /*accumulate_grad=*/true, /*outputs=*/{});
        compute_.stop();
        if (fns.after_backward) fns.after_backward(a.chunk, final);
        --live;
        h.edge = torch::autograd::Edge();
        h.grad = torch::Tensor();
        if (stage == 0) held.erase({a.microbatch, a.chunk});
        break;
      }
    }
  }
  flush();
  TORCH_CHECK(pending.empty(), "pipeline rank ", r, ": ", pending.size(),
              " received tensors were never used");
  wait_.start();
  for (auto& w : sends) w.wait();
  wait_.stop();
  step_.stop();
  return st;
}

StepTimes Executor::take_times() { return {step_.take_ms(), compute_.take_ms(), wait_.take_ms()}; }

}  // namespace tessel::parallel::pp
