#include "parallel/pp/executor.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>

namespace tessel::parallel::pp {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

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
      options_(options) {
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
  const auto t_step = Clock::now();
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
  std::vector<std::pair<torch::Tensor, torch::Tensor>> landed;  // (host buffer, device tensor)
  auto recv_into = [&](const torch::Tensor& dst) {
    if (!staged) return dst;
    auto host = torch::empty(shape_, options_.device(torch::kCPU).pinned_memory(true));
    landed.emplace_back(host, dst);
    return host;
  };
  auto to_send = [&](const torch::Tensor& t) {
    return staged ? t.detach().to(torch::kCPU) : t.detach().contiguous();
  };
  std::vector<P2POp> batch;
  std::vector<Work> sends;
  StepStats st;
  int64_t live = 0;
  // Posts the pending sends and receives together, then waits for the receives (the compute
  // that follows needs them). Sends finish in the background; finished ones are let go.
  auto flush = [&] {
    if (batch.empty()) return;
    auto works = pp_.send_recv(batch);
    const auto t0 = Clock::now();
    if (works.size() != batch.size()) {  // one coalesced work (NCCL): orders the stream
      for (auto& w : works) w.wait();
    } else {
      for (size_t i = 0; i < works.size(); ++i) {
        if (batch[i].kind == P2POp::kRecv)
          works[i].wait();
        else
          sends.push_back(std::move(works[i]));
      }
    }
    st.wait_ms += ms_since(t0);
    for (auto& [host, dst] : landed) dst.copy_(host, /*non_blocking=*/true);
    landed.clear();
    batch.clear();
    sends.erase(
        std::remove_if(sends.begin(), sends.end(), [](const Work& w) { return w.completed(); }),
        sends.end());
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
        batch.push_back(
            {P2POp::kRecv, recv_into(h.input), prev, tag(false, stage - 1, a.microbatch)});
        break;
      case Op::kSendAct:
        batch.push_back({P2POp::kSend, to_send(h.output), next, tag(false, stage, a.microbatch)});
        h.output = torch::Tensor();
        break;
      case Op::kRecvGrad:
        h.grad = torch::empty(shape_, options_);
        batch.push_back(
            {P2POp::kRecv, recv_into(h.grad), next, tag(true, stage + 1, a.microbatch)});
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
        if (training && h.input.defined()) h.input.requires_grad_(true);
        const auto t0 = Clock::now();
        auto out = fns.forward(a.microbatch, a.chunk, h.input);
        st.compute_ms += ms_since(t0);
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
        TORCH_CHECK(h.edge.function, "pipeline stage ", stage, ": backward of micro-batch ",
                    a.microbatch, " before its forward");
        const bool final = last_backward_[i];
        if (fns.before_backward) fns.before_backward(a.chunk, final);
        const auto t0 = Clock::now();
        torch::autograd::Engine::get_default_engine().execute(
            {h.edge}, {h.grad}, /*keep_graph=*/false, /*create_graph=*/false,
            /*accumulate_grad=*/true, /*outputs=*/{});
        st.compute_ms += ms_since(t0);
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
  const auto t0 = Clock::now();
  for (auto& w : sends) w.wait();
  st.wait_ms += ms_since(t0);
  st.step_ms = ms_since(t_step);
  return st;
}

}  // namespace tessel::parallel::pp
