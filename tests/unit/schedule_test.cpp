#include <gtest/gtest.h>

#include <map>

#include <fmt/format.h>

#include "core/plan/config.h"
#include "parallel/pp/schedule.h"

namespace tessel::parallel::pp {
namespace {

// A schedule by its plan name, as the YAML reader parses it.
plan::PipelineSchedule schedule(const std::string& name) {
  plan::Choice<plan::PipelineSchedule> c;
  if (!c.set_name(name)) throw std::invalid_argument("no schedule " + name);
  return c;
}

struct Case {
  std::string name;
  int64_t p, m, v;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  for (int64_t p : {int64_t{2}, int64_t{4}, int64_t{8}}) {
    for (int64_t m : {p, 2 * p, 3 * p + 1}) c.push_back({"gpipe", p, m, 1});
    c.push_back({"gpipe", p, 1, 1});  // GPipe needs no minimum number of micro-batches
    if (p > 2) c.push_back({"gpipe", p, p - 1, 1});
    for (int64_t m : {p, 2 * p, 3 * p + 1}) c.push_back({"1f1b", p, m, 1});
    for (int64_t v : {int64_t{2}, int64_t{3}})
      for (int64_t m : {p, 2 * p, 3 * p}) c.push_back({"interleaved", p, m, v});
  }
  return c;
}

class Schedules : public ::testing::TestWithParam<Case> {};

TEST_P(Schedules, RunWithoutDeadlockAndMatchTheBubbleTheory) {
  const auto& c = GetParam();
  auto s = make_schedule(schedule(c.name), c.p, c.m, c.v);
  for (double backward : {1.0, 2.0}) {
    auto sim = simulate(s, 1.0, backward);
    ASSERT_FALSE(sim.deadlock) << sim.problem;
    ASSERT_TRUE(sim.problem.empty()) << sim.problem;
    // Each micro-batch's forward ends before its backward starts, on every stage.
    std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<double, double>>
        fb;  // (rank, chunk, mb)
    for (size_t r = 0; r < sim.timeline.size(); ++r)
      for (const auto& slot : sim.timeline[r]) {
        auto& e = fb[{static_cast<int64_t>(r), slot.action.chunk, slot.action.microbatch}];
        (slot.action.op == Op::kForward ? e.first : e.second) =
            slot.action.op == Op::kForward ? slot.end : slot.start;
      }
    ASSERT_EQ(fb.size(), static_cast<size_t>(c.p * c.v * c.m));
    for (const auto& [key, t] : fb) EXPECT_LE(t.first, t.second);
    const double theory = static_cast<double>(c.p - 1) / static_cast<double>(c.v * c.m);
    EXPECT_NEAR(sim.bubble, theory, 1e-9)
        << c.name << " p=" << c.p << " m=" << c.m << " v=" << c.v << " backward=" << backward;
  }
  auto sim = simulate(s);
  // Every rank receives from a peer in the order the peer sends (what NCCL's matching needs).
  EXPECT_TRUE(sim.ordered_messages);
  // And the executor's batches complete when sends wait for their receive (NCCL's rendezvous).
  EXPECT_EQ(rendezvous_deadlock(s), "");
  // Activations held, counted from the schedule's own action lists (a forward holds one
  // micro-batch chunk until its backward) and compared with the papers' bounds and with what the
  // simulator reports: GPipe m; 1F1B min(m, p-r) on rank r; interleaved (Megatron's warm-up of
  // 2(p-r-1) + (v-1)p forwards, then one more) min(vm, 2(p-r-1) + (v-1)p + 1).
  for (int64_t r = 0; r < c.p; ++r) {
    int64_t held = 0, peak = 0;
    for (const auto& a : s.ranks[static_cast<size_t>(r)]) {
      if (a.op == Op::kForward) ++held;
      if (a.op == Op::kBackward) --held;
      peak = std::max(peak, held);
    }
    EXPECT_EQ(held, 0) << c.name << " rank " << r;
    const int64_t bound = c.name == "gpipe" ? c.m
                          : c.name == "1f1b"
                              ? std::min(c.m, c.p - r)
                              : std::min(c.v * c.m, 2 * (c.p - r - 1) + (c.v - 1) * c.p + 1);
    EXPECT_EQ(peak, bound) << c.name << " p=" << c.p << " m=" << c.m << " v=" << c.v << " rank "
                           << r;
    EXPECT_EQ(sim.peak_activations[static_cast<size_t>(r)], peak) << c.name << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(All, Schedules, ::testing::ValuesIn(cases()), [](const auto& info) {
  const auto& c = info.param;
  return fmt::format("{}_p{}_m{}_v{}", c.name == "1f1b" ? "onef1b" : c.name, c.p, c.m, c.v);
});

TEST(Schedules, ForwardOnlyRunsEveryForwardOnce) {
  for (int64_t p : {int64_t{1}, int64_t{2}, int64_t{4}})
    for (int64_t v : {int64_t{1}, int64_t{2}})
      for (int64_t m : {int64_t{1}, int64_t{3}, int64_t{8}}) {
        if (p == 1 && v > 1) continue;
        auto s = forward_only(p, m, v);
        auto sim = simulate(s);
        ASSERT_FALSE(sim.deadlock) << sim.problem;
        ASSERT_TRUE(sim.problem.empty()) << sim.problem;
        EXPECT_TRUE(sim.ordered_messages);
        EXPECT_EQ(rendezvous_deadlock(s), "") << "p=" << p << " v=" << v << " m=" << m;
        size_t forwards = 0;
        for (const auto& r : sim.timeline) forwards += r.size();
        EXPECT_EQ(forwards, static_cast<size_t>(p * v * m));
      }
}

// Zero-bubble schedules against the paper's figures (Qi et al. 2023) with F, B and W alike
// (forward 1, backward 2: B and W 1 each): ZB-H1's bubble (p−1)/(3m), a third of 1F1B's, within
// 1F1B's first-rank memory (p micro-batches held from F to W); ZBV's (p−1)/(6m), within 2p chunk
// micro-batches (the same memory in half-stage chunks). Every B has its W after it; messages in
// order; no rendezvous deadlock.
TEST(Schedules, ZeroBubbleMatchTheTheory) {
  for (int64_t p : {int64_t{2}, int64_t{4}, int64_t{8}})
    for (int64_t m : {p, 2 * p, 3 * p + 1})
      for (const std::string name : {"zb-h1", "zbv"}) {
        const int64_t v = name == "zbv" ? 2 : 1;
        const auto s = make_schedule(schedule(name), p, m, v);
        const auto sim = simulate(s, 1.0, 2.0);
        const std::string what = fmt::format("{} p={} m={}", name, p, m);
        ASSERT_TRUE(sim.problem.empty()) << what << ": " << sim.problem;
        EXPECT_TRUE(sim.ordered_messages) << what;
        EXPECT_EQ(rendezvous_deadlock(s), "") << what;
        const double h1 = static_cast<double>(p - 1) / static_cast<double>(3 * m);
        const double ofob = simulate(one_f_one_b(p, m), 1.0, 2.0).bubble;
        EXPECT_NEAR(ofob, 3 * h1, 1e-9) << what;
        EXPECT_NEAR(sim.bubble, v == 1 ? h1 : h1 / 2, 1e-9) << what;
        for (int64_t r = 0; r < p; ++r) {
          const auto peak = sim.peak_activations[static_cast<size_t>(r)];
          EXPECT_LE(peak, v == 1 ? std::min(m, p) : 2 * p) << what << " rank " << r;
          int64_t splits = 0;
          for (const auto& a : s.ranks[static_cast<size_t>(r)]) {
            EXPECT_NE(a.op, Op::kBackward) << what;
            splits += a.op == Op::kBackwardInput ? 1 : a.op == Op::kBackwardWeight ? -1 : 0;
            EXPECT_GE(splits, 0) << what << ": a W before its B on rank " << r;
          }
          EXPECT_EQ(splits, 0) << what;
        }
        std::printf("%s: bubble %.4f (1F1B %.4f, ZB-H1 theory %.4f), peak on rank 0 %lld\n",
                    what.c_str(), sim.bubble, ofob, h1,
                    static_cast<long long>(sim.peak_activations[0]));
      }
}

// zbv's V: rank 0 holds the first and the last stage, rank p−1 the two middle ones.
TEST(Schedules, ZbvPlacesChunksInAV) {
  const auto s = zero_bubble_v(4, 8);
  EXPECT_EQ(s.stage_of(0, 0), 0);
  EXPECT_EQ(s.stage_of(0, 1), 7);
  EXPECT_EQ(s.stage_of(3, 0), 3);
  EXPECT_EQ(s.stage_of(3, 1), 4);
  for (int64_t st = 0; st < 8; ++st) EXPECT_EQ(s.stage_of(s.rank_of(st), s.chunk_of(st)), st);
  EXPECT_EQ(stage_of(plan::PipelineSchedule::kZbv, 4, 1, 1), 6);
  EXPECT_EQ(stage_of(plan::PipelineSchedule::kInterleaved, 4, 1, 1), 5);
}

TEST(Schedules, MessageOrderMismatchIsFound) {
  // Rank 0 sends micro-batches 0 and 1; rank 1 receives them the other way round.
  auto s = gpipe(2, 2);
  std::vector<Action> swapped{{Op::kRecvAct, 1, 0},  {Op::kRecvAct, 0, 0},  {Op::kForward, 0, 0},
                              {Op::kForward, 1, 0},  {Op::kBackward, 0, 0}, {Op::kSendGrad, 0, 0},
                              {Op::kBackward, 1, 0}, {Op::kSendGrad, 1, 0}};
  s.ranks[1] = swapped;
  auto sim = simulate(s);
  EXPECT_FALSE(sim.deadlock) << sim.problem;
  EXPECT_FALSE(sim.ordered_messages);
}

TEST(Schedules, StageLayersSplitEvenlyOrAsGiven) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(stage_layers(8, 4), (Ranges{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_EQ(stage_layers(10, 4), (Ranges{{0, 3}, {3, 6}, {6, 8}, {8, 10}}));
  EXPECT_EQ(stage_layers(5, 2, {1, 4}), (Ranges{{0, 1}, {1, 5}}));
  EXPECT_EQ(stage_layers(4, 4), (Ranges{{0, 1}, {1, 2}, {2, 3}, {3, 4}}));
}

TEST(Schedules, DeadlockIsFound) {
  // Stage 0 never sends its activation: stage 1 waits forever.
  Schedule s{
      "broken",
      2,
      1,
      1,
      {{{Op::kForward, 0, 0}, {Op::kRecvGrad, 0, 0}, {Op::kBackward, 0, 0}},
       {{Op::kRecvAct, 0, 0}, {Op::kForward, 0, 0}, {Op::kBackward, 0, 0}, {Op::kSendGrad, 0, 0}}}};
  auto sim = simulate(s);
  EXPECT_TRUE(sim.deadlock);
  EXPECT_NE(sim.problem.find("rank 1 waits at forward of micro-batch 0"), std::string::npos)
      << sim.problem;
  EXPECT_NE(sim.problem.find("rank 0 waits at backward of micro-batch 0"), std::string::npos)
      << sim.problem;
}

TEST(Schedules, NeedsAreCheckedWithValues) {
  auto expect = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      FAIL() << "accepted";
    } catch (const plan::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect([] { make_schedule(schedule("1f1b"), 4, 3, 1); },
         "needs at least parallel.pp (4) micro-batches per step, got 3");
  expect([] { make_schedule(schedule("interleaved"), 4, 6, 2); },
         "micro-batches per step (6) divisible by parallel.pp (4)");
  expect([] { make_schedule(schedule("interleaved"), 2, 4, 1); }, "virtual_stages >= 2, got 1");
  expect([] { make_schedule(schedule("zbv"), 2, 4, 1); },
         "zbv needs parallel.pipeline.virtual_stages: 2, got 1");
  expect([] { make_schedule(schedule("zb-h1"), 4, 2, 1); },
         "needs at least parallel.pp (4) micro-batches");
}

TEST(Schedules, GridShowsEveryPass) {
  auto s = one_f_one_b(2, 2);
  auto text = render(s, simulate(s));
  EXPECT_NE(text.find("rank  0 | F0 F1 .. .. B0 B0 .. B1 B1"), std::string::npos) << text;
  EXPECT_NE(text.find("rank  1 | .. F0 B0 B0 F1 B1 B1"), std::string::npos) << text;
}

// A rank's bytes over its passes: a forward keeps `whole` and peaks `during_forward` above it;
// a backward frees `whole` and peaks at `backward.during` above what is left; a B keeps
// `deferred` of it until its W; `beside` adds per pass (ZeRO-3's gathered units), and `at`
// names the pass at the peak.
TEST(Schedules, PeakHeldFollowsEachPass) {
  using S = Simulation::Slot;
  ChunkBytes c;
  c.whole = 100, c.during_forward = 7;
  c.backward = {130, 130, 130, 130};  // the whole micro-batch and 30 more, at its start
  const std::vector<S> gpipe{{0, 0, {Op::kForward, 0, 0}},
                             {0, 0, {Op::kForward, 1, 0}},
                             {0, 0, {Op::kBackward, 0, 0}},
                             {0, 0, {Op::kBackward, 1, 0}}};
  size_t at = 99;
  EXPECT_DOUBLE_EQ(peak_held(gpipe, {c}, {}, &at), 230);  // B0: 200 held + 30
  EXPECT_EQ(at, 2u);
  EXPECT_DOUBLE_EQ(peak_held(gpipe, {c}, {0, 50, 0, 0}, &at), 257);  // F1 with 50 beside
  EXPECT_EQ(at, 1u);

  c.deferred = 60, c.during_input = 5;
  c.weight = {65, 65, 65, 65};  // the deferred 60 and a weight gradient of 5
  const std::vector<S> zb{{0, 0, {Op::kForward, 0, 0}},
                          {0, 0, {Op::kBackwardInput, 0, 0}},
                          {0, 0, {Op::kForward, 1, 0}},
                          {0, 0, {Op::kBackwardWeight, 0, 0}}};
  EXPECT_DOUBLE_EQ(peak_held(zb, {c}, {}, &at), 167);  // F1: 60 deferred + 100 + 7
  EXPECT_EQ(at, 2u);
  c.weight = {120, 120, 120, 120};                     // a weight gradient of 60
  EXPECT_DOUBLE_EQ(peak_held(zb, {c}, {}, &at), 220);  // W0: 160 held - 60 + 120
  EXPECT_EQ(at, 3u);
}

}  // namespace
}  // namespace tessel::parallel::pp
