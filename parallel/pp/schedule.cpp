#include "parallel/pp/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include <c10/util/Exception.h>
#include "core/plan/config.h"
#include "core/plan/layout.h"

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

double theory_bubble(plan::PipelineSchedule schedule, int64_t p, int64_t m, int64_t v) {
  const double base = static_cast<double>(p - 1) / static_cast<double>(m);
  switch (schedule) {
    case plan::PipelineSchedule::kInterleaved:
      return base / static_cast<double>(v);
    case plan::PipelineSchedule::kZbH1:
      return base / 3;
    case plan::PipelineSchedule::kZbv:
      return base / 6;
    case plan::PipelineSchedule::kGpipe:
    case plan::PipelineSchedule::k1F1B:
      break;
  }
  return base;
}

int64_t stage_of(plan::PipelineSchedule schedule, int64_t p, int64_t rank, int64_t chunk) {
  Schedule s;
  s.stages = p;
  s.v_shape = plan::schedule_shape(schedule).v_shape;
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

Schedule make_schedule(plan::PipelineSchedule schedule, int64_t p, int64_t m, int64_t v) {
  if (auto problem = plan::schedule_problem(schedule, p, m, v); !problem.empty())
    throw plan::UserError(problem);
  switch (schedule) {
    case plan::PipelineSchedule::kGpipe:
      return gpipe(p, m);
    case plan::PipelineSchedule::k1F1B:
      return one_f_one_b(p, m);
    case plan::PipelineSchedule::kInterleaved:
      return interleaved(p, m, v);
    case plan::PipelineSchedule::kZbH1:
      return zero_bubble_h1(p, m);
    case plan::PipelineSchedule::kZbv:
      return zero_bubble_v(p, m);
  }
  throw std::logic_error(
      fmt::format("make_schedule: schedule {} has no builder", static_cast<int>(schedule)));
}

}  // namespace tessel::parallel::pp
