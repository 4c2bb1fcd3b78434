// The policy of training.cuda_graph (engine/run/step_graph.h) against a stand-in backend: warm-up
// steps eager, one capture replayed at once and for every later step, eager steps on request
// without losing the graph, and a failed capture undone and never tried again. The CUDA backend
// itself runs in tests/gpu/gpu_suite.py (CudaGraph), skipped without a GPU. GraphedStep, the
// Trainer's use of it: the outputs a replay answers are the captured step's.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "engine/run/step_graph.h"

namespace tessel::run {
namespace {

struct Calls {
  std::vector<std::string> log;
  bool fail_capture = false;
};

class FakeBackend : public GraphBackend {
 public:
  explicit FakeBackend(Calls& c) : c_(c) {}
  void enter_stream() override { c_.log.push_back("enter"); }
  void leave_stream() override { c_.log.push_back("leave"); }
  void begin() override { c_.log.push_back("begin"); }
  void end() override { c_.log.push_back("end"); }
  void abort() noexcept override { c_.log.push_back("abort"); }
  void replay() override { c_.log.push_back("replay"); }

 private:
  Calls& c_;
};

// A step that records itself and, when capturing fails, throws as a host sync inside a capture
// does ("operation not permitted when stream is capturing").
struct Step {
  Calls& c;
  void operator()() {
    const bool in_capture = !c.log.empty() && c.log.back() == "begin";
    c.log.push_back("step");
    if (in_capture && c.fail_capture) throw std::runtime_error("stream is capturing: a host sync");
  }
};

using Ran = StepGraph::Ran;

TEST(StepGraph, WarmsUpThenCapturesOnceAndReplays) {
  Calls c;
  {
    StepGraph g(std::make_unique<FakeBackend>(c), 2);
    Step step{c};
    int undone = 0;
    auto undo = [&] { ++undone; };
    EXPECT_EQ(g.run(false, step, undo), Ran::kEager);
    EXPECT_EQ(g.run(false, step, undo), Ran::kEager);
    EXPECT_FALSE(g.captured());
    EXPECT_EQ(g.run(false, step, undo), Ran::kCaptured);
    EXPECT_TRUE(g.captured());
    EXPECT_EQ(g.run(false, step, undo), Ran::kReplayed);
    EXPECT_EQ(g.run(true, step, undo), Ran::kEager);  // a step that must run eagerly
    EXPECT_EQ(g.run(false, step, undo), Ran::kReplayed);
    EXPECT_EQ(undone, 0);
    EXPECT_FALSE(g.failed());
  }
  const std::vector<std::string> want = {"enter",  "step",   "step", "begin",  "step", "end",
                                         "replay", "replay", "step", "replay", "leave"};
  EXPECT_EQ(c.log, want);
}

TEST(StepGraph, EagerOnlyStepsDoNotCountAsWarmUp) {
  Calls c;
  StepGraph g(std::make_unique<FakeBackend>(c), 1);
  Step step{c};
  EXPECT_EQ(g.run(true, step, [] {}), Ran::kEager);
  EXPECT_EQ(g.run(false, step, [] {}), Ran::kEager);  // the warm-up step
  EXPECT_EQ(g.run(false, step, [] {}), Ran::kCaptured);
}

TEST(StepGraph, AFailedCaptureIsUndoneRunsEagerlyAndIsNotRetried) {
  Calls c;
  c.fail_capture = true;
  {
    StepGraph g(std::make_unique<FakeBackend>(c), 0);
    Step step{c};
    int undone = 0;
    EXPECT_EQ(g.run(false, step, [&] { ++undone; }), Ran::kEager);
    EXPECT_TRUE(g.failed());
    EXPECT_FALSE(g.captured());
    EXPECT_NE(g.failure().find("host sync"), std::string::npos) << g.failure();
    EXPECT_EQ(undone, 1);
    EXPECT_EQ(g.run(false, step, [&] { ++undone; }), Ran::kEager);
    EXPECT_EQ(undone, 1);
  }
  // The capture began, the step threw inside it, the capture was aborted, the host bookkeeping
  // undone, and the step ran again eagerly; the next step ran eagerly with no capture.
  const std::vector<std::string> want = {"enter", "begin", "step", "abort",
                                         "step",  "step",  "leave"};
  EXPECT_EQ(c.log, want);
}

// What the Trainer reads after each step (engine/run/train.cpp): off, every step's own outputs;
// on, the warm-up steps' own, then the captured step's outputs for the capture and every replay
// (a replay runs no host code, so the step function is not called), replayed() set only then,
// and an eager-only step's own outputs without losing the graph.
TEST(GraphedStep, ReplaysAnswerTheCapturedStepsOutputs) {
  int calls = 0;
  auto step = [&] { return ++calls; };
  GraphedStep<int> off;
  off.start(nullptr);
  EXPECT_FALSE(off.on());
  EXPECT_EQ(off.run(1, false, step, [] {}), 1);
  EXPECT_EQ(off.run(2, false, step, [] {}), 2);
  EXPECT_FALSE(off.replayed());

  Calls c;
  GraphedStep<int> on;
  on.start(std::make_unique<FakeBackend>(c), 1);
  ASSERT_TRUE(on.on());
  calls = 0;
  EXPECT_EQ(on.run(1, false, step, [] {}), 1);  // warm-up
  EXPECT_FALSE(on.captured());
  EXPECT_EQ(on.run(2, false, step, [] {}), 2);  // captured (and replayed at once)
  EXPECT_TRUE(on.captured());
  EXPECT_FALSE(on.replayed());
  EXPECT_EQ(on.run(3, false, step, [] {}), 2);  // a replay: the captured outputs
  EXPECT_TRUE(on.replayed());
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(on.run(4, true, step, [] {}), 3);  // eager only: its own
  EXPECT_FALSE(on.replayed());
  EXPECT_EQ(on.run(5, false, step, [] {}), 2);
  on.stop();
  EXPECT_FALSE(on.on());
  EXPECT_EQ(c.log.back(), "leave");
}

}  // namespace
}  // namespace tessel::run
