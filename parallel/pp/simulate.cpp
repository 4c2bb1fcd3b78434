// The schedule simulator: every rank's list run against the others' on unit clocks (what the
// executor will do), the activations each rank holds, the deadlock and order checks, and the
// text picture --dry-run prints. parallel/pp/schedule.cpp builds the schedules.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include <c10/util/Exception.h>
#include "parallel/pp/schedule.h"

namespace tessel::parallel::pp {
namespace {

std::string label(const Action& a, int64_t v) {
  const char c = a.op == Op::kForward ? 'F' : a.op == Op::kBackwardWeight ? 'W' : 'B';
  std::string s = fmt::format("{}{}", c, a.microbatch);
  return v > 1 ? s + "." + std::to_string(a.chunk) : s;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kRecvAct:
      return "recv activation";
    case Op::kForward:
      return "forward";
    case Op::kSendAct:
      return "send activation";
    case Op::kRecvGrad:
      return "recv gradient";
    case Op::kBackward:
      return "backward";
    case Op::kSendGrad:
      return "send gradient";
    case Op::kBackwardInput:
      return "input-gradient backward";
    case Op::kBackwardWeight:
      return "weight-gradient backward";
  }
  return "?";
}

// A message between neighbouring stages: (gradient?, sending stage, micro-batch).
using Msg = std::tuple<bool, int64_t, int64_t>;
// A send or receive of rank r: whether it sends, the peer rank and the message.
struct Transfer {
  bool send;
  int64_t peer;
  Msg msg;
};
std::optional<Transfer> transfer_of(const Schedule& s, const Action& a, int64_t r) {
  const int64_t stage = s.stage_of(r, a.chunk);
  const int64_t prev = stage > 0 ? s.rank_of(stage - 1) : -1, next = s.rank_of(stage + 1);
  switch (a.op) {
    case Op::kSendAct:
      return Transfer{true, next, {false, stage, a.microbatch}};
    case Op::kSendGrad:
      return Transfer{true, prev, {true, stage, a.microbatch}};
    case Op::kRecvAct:
      return Transfer{false, prev, {false, stage - 1, a.microbatch}};
    case Op::kRecvGrad:
      return Transfer{false, next, {true, stage + 1, a.microbatch}};
    default:
      return std::nullopt;
  }
}

using Key = std::pair<int64_t, int64_t>;  // (stage, micro-batch)

// The simulator's clocks: when each pass finished, each message was sent and each receive was
// posted; and per rank, its next action, its time and the chunks it holds activations of.
struct SimState {
  explicit SimState(int64_t p)
      : next(static_cast<size_t>(p), 0),
        clock(static_cast<size_t>(p), 0.0),
        live(static_cast<size_t>(p), 0),
        deferred(static_cast<size_t>(p), 0) {}
  std::map<Key, double> fwd_done, bwd_done, wgt_done, act_sent, grad_sent, act_recv, grad_recv;
  std::vector<size_t> next;
  std::vector<double> clock;
  std::vector<int64_t> live, deferred;
};

const double* time_of(const std::map<Key, double>& m, const Key& k) {
  auto it = m.find(k);
  return it == m.end() ? nullptr : &it->second;
}

// Whether action `a` of pipeline stage `stage` can run now; `dep` is set to when the message a
// pass waits for was sent.
bool ready(const SimState& st, const Action& a, int64_t stage, int64_t stages, const double*& dep) {
  const Key k{stage, a.microbatch};
  switch (a.op) {
    case Op::kRecvAct:  // posted here; the forward waits for it
    case Op::kRecvGrad:
      return true;
    case Op::kForward:
      return stage == 0 ||
             (time_of(st.act_recv, k) && (dep = time_of(st.act_sent, {stage - 1, a.microbatch})));
    case Op::kSendAct:
      return time_of(st.fwd_done, k) != nullptr;
    case Op::kBackward:
    case Op::kBackwardInput:
      return time_of(st.fwd_done, k) &&
             (stage == stages - 1 || (time_of(st.grad_recv, k) &&
                                      (dep = time_of(st.grad_sent, {stage + 1, a.microbatch}))));
    case Op::kSendGrad:
      return time_of(st.bwd_done, k) != nullptr;
    case Op::kBackwardWeight:
      return time_of(st.bwd_done, k) != nullptr;
  }
  return true;
}

// Runs rank r's ready action `a` at the rank's clock: a transfer is recorded at that time, a pass
// takes 1/v of its stage time. False, with sim.problem set, when the pass already ran.
bool run_action(Simulation& sim, SimState& st, const Action& a, int64_t r, const Key& k,
                int64_t v) {
  double& t = st.clock[r];
  switch (a.op) {
    case Op::kRecvAct:
      st.act_recv[k] = t;
      break;
    case Op::kRecvGrad:
      st.grad_recv[k] = t;
      break;
    case Op::kSendAct:
      st.act_sent[k] = t;
      break;
    case Op::kSendGrad:
      st.grad_sent[k] = t;
      break;
    case Op::kForward:
    case Op::kBackward:
    case Op::kBackwardInput:
    case Op::kBackwardWeight: {
      const bool f = a.op == Op::kForward, w = a.op == Op::kBackwardWeight;
      auto& done = f ? st.fwd_done : w ? st.wgt_done : st.bwd_done;
      if (done.count(k)) {
        sim.problem = fmt::format("rank {} runs the {} of micro-batch {} chunk {} twice", r,
                                  op_name(a.op), a.microbatch, a.chunk);
        return false;
      }
      const double d =
          (f ? sim.forward_time : sim.backward_time * (a.op == Op::kBackward ? 1.0 : 0.5)) /
          static_cast<double>(v);
      sim.timeline[r].push_back({t, t + d, a});
      t += d;
      done[k] = t;
      // A micro-batch's activations are held from its forward to its (weight) backward.
      if (a.op != Op::kBackwardInput) st.live[r] += f ? 1 : -1;
      if (a.op == Op::kBackwardInput || a.op == Op::kBackwardWeight) st.deferred[r] += w ? -1 : 1;
      sim.peak_deferred[r] = std::max(sim.peak_deferred[r], st.deferred[r]);
      sim.peak_activations[r] = std::max(sim.peak_activations[r], st.live[r]);
      break;
    }
  }
  return true;
}

// Where each rank that did not reach the end of its list waits; "" when all did.
std::string waiting_ranks(const Schedule& s, const SimState& st) {
  std::string problem;
  for (int64_t r = 0; r < s.stages; ++r)
    if (st.next[r] < s.ranks[r].size()) {
      const auto& a = s.ranks[r][st.next[r]];
      problem += fmt::format("{}rank {} waits at {} of micro-batch {} chunk {}",
                             problem.empty() ? "" : "; ", r, op_name(a.op), a.microbatch, a.chunk);
    }
  return problem;
}

// The first stage that misses a pass of a micro-batch the schedule must run; "" when none.
std::string missing_pass(const Schedule& s, const SimState& st) {
  for (int64_t stage = 0; stage < s.stages * s.virtual_stages; ++stage)
    for (int64_t mb = 0; mb < s.microbatches; ++mb)
      if (!st.fwd_done.count({stage, mb}) || (s.backward && !st.bwd_done.count({stage, mb})))
        return fmt::format("stage {} never runs both passes of micro-batch {}", stage, mb);
  // A split backward: every B has its W, on the same rank.
  for (int64_t r = 0; r < s.stages; ++r)
    for (const auto& a : s.ranks[r])
      if (a.op == Op::kBackwardInput && !st.wgt_done.count({s.stage_of(r, a.chunk), a.microbatch}))
        return fmt::format("stage {} never runs the weight-gradient backward of micro-batch {}",
                           s.stage_of(r, a.chunk), a.microbatch);
  return "";
}

// Message order: what each rank sends to a peer, in list order, against what the peer
// receives from it, in its list order.
bool messages_in_order(const Schedule& s) {
  const int64_t p = s.stages;
  std::map<std::pair<int64_t, int64_t>, std::vector<Msg>> sent, received;  // (from, to)
  for (int64_t r = 0; r < p; ++r)
    for (const auto& a : s.ranks[r])
      if (auto x = transfer_of(s, a, r))
        (x->send ? sent[{r, x->peer}] : received[{x->peer, r}]).push_back(x->msg);
  return sent == received;
}

}  // namespace

Simulation simulate(const Schedule& s, double forward_time, double backward_time) {
  const int64_t p = s.stages, v = s.virtual_stages, stages = p * v;
  Simulation sim;
  sim.forward_time = forward_time;
  sim.backward_time = backward_time;
  sim.timeline.resize(static_cast<size_t>(p));
  sim.peak_activations.assign(static_cast<size_t>(p), 0);
  sim.peak_deferred.assign(static_cast<size_t>(p), 0);
  SimState st(p);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < p; ++r) {
      const auto& list = s.ranks[r];
      while (st.next[r] < list.size()) {
        const Action& a = list[st.next[r]];
        const int64_t stage = s.stage_of(r, a.chunk);
        const double* dep = nullptr;
        if (!ready(st, a, stage, stages, dep)) break;
        if (dep) st.clock[r] = std::max(st.clock[r], *dep);
        if (!run_action(sim, st, a, r, {stage, a.microbatch}, v)) return sim;
        ++st.next[r];
        progress = true;
      }
    }
  }
  sim.problem = waiting_ranks(s, st);
  sim.deadlock = !sim.problem.empty();
  if (sim.deadlock) return sim;
  sim.problem = missing_pass(s, st);
  if (!sim.problem.empty()) return sim;
  sim.ordered_messages = messages_in_order(s);
  for (double t : st.clock) sim.makespan = std::max(sim.makespan, t);
  const double ideal = static_cast<double>(s.microbatches) * (forward_time + backward_time);
  sim.bubble = (sim.makespan - ideal) / ideal;
  return sim;
}

double peak_held(const std::vector<Simulation::Slot>& timeline,
                 const std::vector<ChunkBytes>& chunks, const std::vector<double>& beside,
                 size_t* at) {
  auto grad_pass = [](Op op) { return op == Op::kBackward || op == Op::kBackwardWeight; };
  std::vector<int64_t> passes(chunks.size(), 0), seen(chunks.size(), 0);
  for (const auto& slot : timeline)
    if (grad_pass(slot.action.op)) ++passes.at(static_cast<size_t>(slot.action.chunk));
  double now = 0, peak = 0;
  for (size_t t = 0; t < timeline.size(); ++t) {
    const auto& slot = timeline[t];
    const auto chunk = static_cast<size_t>(slot.action.chunk);
    const auto& c = chunks.at(chunk);
    double during = 0, after = 0;
    switch (slot.action.op) {
      case Op::kForward:
        now += c.whole + c.sent_forward;
        during = c.during_forward;
        break;
      case Op::kBackward:
        now += c.sent_backward - c.whole;
        break;
      case Op::kBackwardInput:
        during = c.during_input;
        now += c.sent_backward + c.deferred - c.whole;
        break;
      case Op::kBackwardWeight:
        now -= c.deferred;
        break;
      default:
        break;
    }
    if (grad_pass(slot.action.op)) {
      const auto& g = slot.action.op == Op::kBackward ? c.backward : c.weight;
      const int64_t k = seen[chunk]++, n = passes[chunk];
      const bool accumulate = c.grads > 0 && n > 1;
      during = !accumulate  ? g.during
               : k == 0     ? g.during_first
               : k == n - 1 ? g.during_last
                            : g.during_middle;
      if (accumulate && k == 0) after = c.grads;
      if (accumulate && k == n - 1) after = -c.grads;
    }
    const double here = now + during + (beside.empty() ? 0.0 : beside.at(t));
    if (here > peak && at) *at = t;
    peak = std::max(peak, here);
    now += after;
  }
  return peak;
}

std::string rendezvous_deadlock(const Schedule& s) {
  const int64_t p = s.stages;
  // The executor's batches: the transfers between two passes.
  std::vector<std::vector<std::vector<Transfer>>> groups(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) {
    std::vector<Transfer> batch;
    for (const auto& a : s.ranks[r]) {
      if (auto x = transfer_of(s, a, r)) {
        batch.push_back(*x);
      } else if (!batch.empty()) {
        groups[r].push_back(std::move(batch));
        batch.clear();
      }
    }
    if (!batch.empty()) groups[r].push_back(std::move(batch));
  }
  std::vector<size_t> at(static_cast<size_t>(p), 0);  // the batch each rank has posted
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < p; ++r) {
      if (at[r] >= groups[r].size()) continue;
      auto& mine = groups[r][at[r]];
      // Match each send with the receive the peer has posted in its current batch.
      for (auto it = mine.begin(); it != mine.end();) {
        const int64_t q = it->peer;
        bool matched = false;
        if (it->send && at[q] < groups[q].size()) {
          auto& theirs = groups[q][at[q]];
          auto m = std::find_if(theirs.begin(), theirs.end(), [&](const Transfer& o) {
            return !o.send && o.peer == r && o.msg == it->msg;
          });
          if (m != theirs.end()) {
            theirs.erase(m);
            matched = true;
          }
        }
        it = matched ? mine.erase(it) : it + 1;
        progress = progress || matched;
      }
      if (mine.empty()) {
        ++at[r];
        progress = true;
      }
    }
  }
  std::string problem;
  for (int64_t r = 0; r < p; ++r)
    if (at[r] < groups[r].size()) {
      const auto& op = groups[r][at[r]].front();
      problem += fmt::format(
          "{}rank {} blocks on its batch {} ({} {} of stage {} micro-batch {} {} "
          "rank {})",
          problem.empty() ? "" : "; ", r, at[r], op.send ? "send" : "receive",
          std::get<0>(op.msg) ? "gradient" : "activation", std::get<1>(op.msg), std::get<2>(op.msg),
          op.send ? "to" : "from", op.peer);
    }
  return problem;
}

std::string render(const Schedule& s, const Simulation& sim) {
  const double unit = sim.forward_time / static_cast<double>(s.virtual_stages);
  const auto cells = static_cast<size_t>(std::ceil(sim.makespan / unit - 1e-9));
  size_t width = 2;
  for (const auto& rank : sim.timeline)
    for (const auto& slot : rank)
      width = std::max(width, label(slot.action, s.virtual_stages).size());
  std::ostringstream out;
  out << fmt::format(
      "schedule {}: {} stages, {} micro-batches{}; one column = {} (forward {}, backward {})\n",
      s.name, s.stages, s.microbatches,
      s.virtual_stages > 1 ? fmt::format(", {} chunks per rank", s.virtual_stages) : "",
      s.virtual_stages > 1 ? "one chunk's forward" : "one forward", sim.forward_time,
      sim.backward_time);
  for (size_t r = 0; r < sim.timeline.size(); ++r) {
    std::vector<std::string> row(cells, std::string(width, '.'));
    for (const auto& slot : sim.timeline[r]) {
      const auto first = static_cast<size_t>(std::llround(slot.start / unit));
      const auto last = static_cast<size_t>(std::llround(slot.end / unit));
      for (size_t c = first; c < last && c < cells; ++c) {
        auto l = label(slot.action, s.virtual_stages);
        row[c] = l + std::string(width - l.size(), ' ');
      }
    }
    out << fmt::format("  rank {:>2} |", r);
    for (const auto& c : row) out << ' ' << c;
    out << "\n";
  }
  return out.str();
}

}  // namespace tessel::parallel::pp
