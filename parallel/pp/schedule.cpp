#include "parallel/pp/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include <c10/util/Exception.h>
#include "plan/config.h"

namespace tessel::parallel::pp {
namespace {

// A forward or backward of (micro-batch, chunk) with the receive before it and the send after.
void forward(std::vector<Action>& l, int64_t mb, int64_t chunk, int64_t stage, int64_t stages) {
  if (stage > 0) l.push_back({Op::kRecvAct, mb, chunk});
  l.push_back({Op::kForward, mb, chunk});
  if (stage < stages - 1) l.push_back({Op::kSendAct, mb, chunk});
}

void backward(std::vector<Action>& l, int64_t mb, int64_t chunk, int64_t stage, int64_t stages) {
  if (stage < stages - 1) l.push_back({Op::kRecvGrad, mb, chunk});
  l.push_back({Op::kBackward, mb, chunk});
  if (stage > 0) l.push_back({Op::kSendGrad, mb, chunk});
}

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

}  // namespace

Schedule gpipe(int64_t p, int64_t m) {
  Schedule s{"gpipe", p, m, 1, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  for (int64_t r = 0; r < p; ++r) {
    for (int64_t mb = 0; mb < m; ++mb) forward(s.ranks[r], mb, 0, r, p);
    for (int64_t mb = 0; mb < m; ++mb) backward(s.ranks[r], mb, 0, r, p);
  }
  return s;
}

Schedule one_f_one_b(int64_t p, int64_t m) {
  Schedule s{"1f1b", p, m, 1, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  for (int64_t r = 0; r < p; ++r) {
    auto& l = s.ranks[r];
    const int64_t warmup = std::min(p - r - 1, m);
    for (int64_t mb = 0; mb < warmup; ++mb) forward(l, mb, 0, r, p);
    for (int64_t i = 0; i < m - warmup; ++i) {  // steady state: one forward, one backward
      forward(l, warmup + i, 0, r, p);
      backward(l, i, 0, r, p);
    }
    for (int64_t mb = m - warmup; mb < m; ++mb) backward(l, mb, 0, r, p);
  }
  return s;
}

Schedule interleaved(int64_t p, int64_t m, int64_t v) {
  Schedule s{"interleaved", p, m, v, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  const int64_t total = m * v, stages = p * v;
  // The k-th forward of a rank runs chunk (k / p) % v on micro-batch (k / (p·v))·p + k % p:
  // groups of p micro-batches go through chunk 0, then chunk 1, ...; backwards mirror the chunks.
  auto mb_of = [&](int64_t k) { return (k / (p * v)) * p + k % p; };
  auto fwd_chunk = [&](int64_t k) { return (k / p) % v; };
  auto bwd_chunk = [&](int64_t k) { return v - 1 - (k / p) % v; };
  for (int64_t r = 0; r < p; ++r) {
    auto& l = s.ranks[r];
    const int64_t warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    auto f = [&](int64_t k) { forward(l, mb_of(k), fwd_chunk(k), fwd_chunk(k) * p + r, stages); };
    auto b = [&](int64_t k) { backward(l, mb_of(k), bwd_chunk(k), bwd_chunk(k) * p + r, stages); };
    for (int64_t k = 0; k < warmup; ++k) f(k);
    for (int64_t i = 0; i < total - warmup; ++i) {
      f(warmup + i);
      b(i);
    }
    for (int64_t k = total - warmup; k < total; ++k) b(k);
  }
  return lockstep(s);
}

Schedule lockstep(const Schedule& s) {
  // Ticks: each compute takes one tick and starts after its inputs' producers (the simulator with
  // unit times, in units of one chunk's pass; B and W one tick each).
  const int64_t p = s.stages, v = s.virtual_stages, stages = p * v;
  bool split = false;
  for (const auto& l : s.ranks)
    for (const auto& a : l) split = split || a.op == Op::kBackwardInput;
  const auto sim = simulate(s, 1.0, split ? 2.0 : 1.0);
  TORCH_CHECK(sim.problem.empty(), "lockstep: ", sim.problem);
  std::vector<std::map<int64_t, Action>> at(static_cast<size_t>(p));  // rank -> tick -> compute
  int64_t ticks = 0;
  for (int64_t r = 0; r < p; ++r)
    for (const auto& slot : sim.timeline[r]) {
      const int64_t t = std::llround(slot.start * static_cast<double>(v));
      at[r][t] = slot.action;
      ticks = std::max(ticks, t + 1);
    }
  // What a pass sends: a forward its activation (not from the last stage), a backward or B its
  // input's gradient (not from the first).
  auto sends_act = [&](const Action& a, int64_t stage) {
    return a.op == Op::kForward && stage < stages - 1;
  };
  auto sends_grad = [&](const Action& a, int64_t stage) {
    return (a.op == Op::kBackward || a.op == Op::kBackwardInput) && stage > 0;
  };
  Schedule out = s;
  for (auto& l : out.ranks) l.clear();
  for (int64_t t = 0; t < ticks; ++t)
    for (int64_t r = 0; r < p; ++r) {
      auto& l = out.ranks[r];
      auto it = at[r].find(t);
      if (it != at[r].end()) l.push_back(it->second);
      // Boundary t: what this rank's tick-t pass sends, and what the tick-t passes of its
      // neighbours (and of itself, where a V turns) send to it.
      if (it != at[r].end()) {
        const Action& a = it->second;
        const int64_t stage = s.stage_of(r, a.chunk);
        if (sends_act(a, stage)) l.push_back({Op::kSendAct, a.microbatch, a.chunk});
        if (sends_grad(a, stage)) l.push_back({Op::kSendGrad, a.microbatch, a.chunk});
      }
      std::vector<int64_t> neighbours;
      if (p > 1) neighbours.push_back((r - 1 + p) % p);
      if (p > 2) neighbours.push_back((r + 1) % p);
      if (s.v_shape) neighbours.push_back(r);
      for (int64_t q : neighbours) {
        auto jt = at[q].find(t);
        if (jt == at[q].end()) continue;
        const Action& a = jt->second;
        const int64_t stage = s.stage_of(q, a.chunk);  // the sender's stage; the receiver's is ±1
        if (sends_act(a, stage) && s.rank_of(stage + 1) == r)
          l.push_back({Op::kRecvAct, a.microbatch, s.chunk_of(stage + 1)});
        if (sends_grad(a, stage) && s.rank_of(stage - 1) == r)
          l.push_back({Op::kRecvGrad, a.microbatch, s.chunk_of(stage - 1)});
      }
    }
  return out;
}

namespace {

// The zero-bubble schedules' compute order, list-scheduled tick by tick with F, B and W one tick
// each (one chunk's). Each rank runs, of what it may run now: a forward (the oldest micro-batch,
// the later stage first) while it holds fewer than `warmup[r]` micro-batch chunks between F and B
// and fewer than `most[r]` between F and W; else a B (the oldest micro-batch, the later stage
// first); else the oldest W. Forwards first keep the last micro-batch's forward early, which the
// step's tail waits on; W fills what is left. Transfers are added by lockstep().
Schedule list_scheduled(Schedule s, const std::vector<int64_t>& warmup,
                        const std::vector<int64_t>& most) {
  const int64_t p = s.stages, v = s.virtual_stages, m = s.microbatches, stages = p * v;
  // Tick at which each pass of (stage, micro-batch) ran; -1: not yet.
  std::vector<std::vector<int64_t>> f(stages, std::vector<int64_t>(m, -1)), b = f;
  std::vector<int64_t> held(p, 0), done(p, 0);
  std::vector<std::vector<int64_t>> next_f(p, std::vector<int64_t>(v, 0));
  std::vector<std::deque<Action>> w(p);
  auto before = [](int64_t tick, int64_t now) { return tick >= 0 && tick < now; };
  for (int64_t t = 0;
       std::any_of(done.begin(), done.end(), [&](int64_t d) { return d < 3 * m * v; }); ++t) {
    TORCH_CHECK(t < 4 * (3 * m * v + stages), "zero-bubble schedule ", s.name, " p=", p, " m=", m,
                ": no progress");
    for (int64_t r = 0; r < p; ++r) {
      std::optional<Action> pick, back, fwd;
      for (int64_t mb = 0; mb < m && !back; ++mb)
        for (int64_t c = v - 1; c >= 0 && !back; --c) {
          const int64_t st = s.stage_of(r, c);
          if (b[st][mb] < 0 && before(f[st][mb], t) &&
              (st == stages - 1 || before(b[st + 1][mb], t)))
            back = Action{Op::kBackwardInput, mb, c};
        }
      if (held[r] < warmup[r] && held[r] + static_cast<int64_t>(w[r].size()) < most[r]) {
        int64_t best = -1;
        for (int64_t c = v - 1; c >= 0; --c) {
          const int64_t mb = next_f[r][c], st = s.stage_of(r, c);
          if (mb < m && (st == 0 || before(f[st - 1][mb], t)) && (best < 0 || mb < next_f[r][best]))
            best = c;
        }
        if (best >= 0) fwd = Action{Op::kForward, next_f[r][best], best};
      }
      pick = fwd ? fwd : back;
      if (pick && pick->op == Op::kForward) ++next_f[r][pick->chunk];
      if (!pick && !w[r].empty()) {
        pick = w[r].front();
        w[r].pop_front();
      }
      if (!pick) continue;
      const int64_t st = s.stage_of(r, pick->chunk);
      if (pick->op == Op::kForward) f[st][pick->microbatch] = t, ++held[r];
      if (pick->op == Op::kBackwardInput) {
        b[st][pick->microbatch] = t, --held[r];
        w[r].push_back({Op::kBackwardWeight, pick->microbatch, pick->chunk});
      }
      auto& l = s.ranks[r];
      if (pick->op == Op::kForward) {
        forward(l, pick->microbatch, pick->chunk, st, stages);
      } else if (pick->op == Op::kBackwardInput) {  // as backward(), split
        if (st < stages - 1) l.push_back({Op::kRecvGrad, pick->microbatch, pick->chunk});
        l.push_back(*pick);
        if (st > 0) l.push_back({Op::kSendGrad, pick->microbatch, pick->chunk});
      } else {
        l.push_back(*pick);
      }
      ++done[r];
    }
  }
  return lockstep(s);
}

}  // namespace

Schedule zero_bubble_h1(int64_t p, int64_t m) {
  Schedule s{"zb-h1", p, m, 1, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  // Rank r starts as many forwards as under 1F1B (p − r before its first B); every rank holds
  // at most what 1F1B's first rank holds (p micro-batches, from F to W).
  std::vector<int64_t> warmup;
  for (int64_t r = 0; r < p; ++r) warmup.push_back(p - r);
  return list_scheduled(std::move(s), warmup, std::vector<int64_t>(static_cast<size_t>(p), p));
}

Schedule zero_bubble_v(int64_t p, int64_t m) {
  Schedule s{"zbv", p, m, 2, std::vector<std::vector<Action>>(static_cast<size_t>(p))};
  s.v_shape = true;
  // 1F1B's first rank holds p micro-batches of a whole stage: 2p of a half-stage chunk.
  const std::vector<int64_t> most(static_cast<size_t>(p), 2 * p);
  return list_scheduled(std::move(s), most, most);
}

double theory_bubble(const std::string& name, int64_t p, int64_t m, int64_t v) {
  const double base = static_cast<double>(p - 1) / static_cast<double>(m);
  if (name == "interleaved") return base / static_cast<double>(v);
  if (name == "zb-h1") return base / 3;
  if (name == "zbv") return base / 6;
  return base;
}

int64_t stage_of(const std::string& schedule, int64_t p, int64_t rank, int64_t chunk) {
  Schedule s;
  s.stages = p;
  s.v_shape = schedule == "zbv";
  return s.stage_of(rank, chunk);
}

std::vector<std::pair<int64_t, int64_t>> stage_layers(int64_t layers, int64_t stages,
                                                      const std::vector<double>& per_stage) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0;
  for (int64_t st = 0; st < stages; ++st) {
    const int64_t n = per_stage.empty() ? layers / stages + (st < layers % stages ? 1 : 0)
                                        : static_cast<int64_t>(per_stage[static_cast<size_t>(st)]);
    out.emplace_back(begin, begin + n);
    begin += n;
  }
  return out;
}

std::string stage_layer_counts(int64_t layers, int64_t stages,
                               const std::vector<double>& per_stage) {
  std::string out;
  for (auto [b, e] : stage_layers(layers, stages, per_stage))
    out += fmt::format("{}{}", out.empty() ? "" : " ", e - b);
  return out;
}

Schedule forward_only(int64_t p, int64_t m, int64_t v, bool v_shape) {
  Schedule s{"forward", p, m, v, std::vector<std::vector<Action>>(static_cast<size_t>(p)), false};
  s.v_shape = v_shape;
  for (int64_t r = 0; r < p; ++r)
    for (int64_t c = 0; c < v; ++c)
      for (int64_t mb = 0; mb < m; ++mb) forward(s.ranks[r], mb, c, s.stage_of(r, c), p * v);
  return lockstep(s);
}

Schedule make_schedule(const std::string& name, int64_t p, int64_t m, int64_t v) {
  if (name == "gpipe") return gpipe(p, m);
  if (m < p)
    throw UserError(fmt::format(
        "parallel.pipeline.schedule {} needs at least parallel.pp ({}) micro-batches per "
        "step, got {} (training.global_batch / (parallel.dp·training.micro_batch))",
        name, p, m));
  if (name == "1f1b") return one_f_one_b(p, m);
  if (name == "interleaved") {
    if (v < 2)
      throw UserError(fmt::format(
          "parallel.pipeline.schedule interleaved needs parallel.pipeline.virtual_stages >= 2, "
          "got {}",
          v));
    if (m % p != 0)
      throw UserError(fmt::format(
          "parallel.pipeline.schedule interleaved needs micro-batches per step ({}) divisible "
          "by parallel.pp ({})",
          m, p));
    return interleaved(p, m, v);
  }
  if (name == "zb-h1") return zero_bubble_h1(p, m);
  if (name == "zbv") {
    if (v != 2)
      throw UserError(fmt::format(
          "parallel.pipeline.schedule zbv needs parallel.pipeline.virtual_stages: 2, got {}", v));
    return zero_bubble_v(p, m);
  }
  throw UserError("parallel.pipeline.schedule: unknown schedule '" + name +
                  "' (gpipe, 1f1b, interleaved, zb-h1, zbv)");
}

namespace {

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

double peak_held(const Simulation& sim, int64_t rank, double whole, double deferred) {
  double now = 0, peak = 0;
  for (const auto& slot : sim.timeline[static_cast<size_t>(rank)]) {
    switch (slot.action.op) {
      case Op::kForward:
        now += whole;
        break;
      case Op::kBackward:
        now -= whole;
        break;
      case Op::kBackwardInput:
        now += deferred - whole;
        break;
      case Op::kBackwardWeight:
        now -= deferred;
        break;
      default:
        break;
    }
    peak = std::max(peak, now);
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
