#include <gtest/gtest.h>
#include <torch/torch.h>

#include <csignal>

#include "core/observe/interrupt.h"
#include "engine/run/stop.h"

namespace tessel {
namespace {

torch::Tensor sum_of(double v) { return torch::full({}, v); }

// The summed votes of step t decide after step t+1: every rank passes the same sums, so every
// rank stops after the same step, one step after any rank saw a signal.
TEST(StopOnSignal, StopsOneStepAfterTheVotesTurnPositive) {
  run::StopOnSignal stop({"SIGUSR2"}, torch::kCPU);
  EXPECT_FALSE(stop.stop_after(sum_of(0)));  // step 1
  EXPECT_FALSE(stop.stop_after(sum_of(0)));  // step 2
  EXPECT_FALSE(stop.stop_after(sum_of(1)));  // step 3: one rank (not necessarily this) saw one
  EXPECT_TRUE(stop.stop_after(sum_of(0)));   // step 4: reads step 3's sum
  EXPECT_EQ(stop.signal(), 0);
  EXPECT_EQ(stop.vote().item<float>(), 0.0f);  // this rank saw none
}

TEST(StopOnSignal, ASignalTurnsThisRanksVoteOn) {
  run::StopOnSignal stop({"SIGUSR2"}, torch::kCPU);
  EXPECT_EQ(stop.vote().item<float>(), 0.0f);
  std::raise(SIGUSR2);
  EXPECT_EQ(stop.signal(), SIGUSR2);
  EXPECT_EQ(stop.vote().item<float>(), 1.0f);
  EXPECT_EQ(stop.vote().scalar_type(), torch::kFloat32);
  observe::forget_signal();  // the other tests' start-up work would stop on it
}

// Start-up's long parts look at the noted signal between pieces of work: a signal noted during
// start-up stops the next piece, naming it; once the run steps, the vote decides and they do not.
TEST(StartUpSignal, StopsTheNextPieceOfStartUpWork) {
  EXPECT_NO_THROW(observe::stop_if_signalled("indexing the data"));
  observe::note_signal(SIGTERM);
  try {
    observe::stop_if_signalled("indexing the data");
    FAIL() << "no stop";
  } catch (const observe::Interrupted& e) {
    EXPECT_EQ(e.signal(), SIGTERM);
    EXPECT_STREQ(e.what(),
                 "stopped on SIGTERM during start-up (indexing the data), before step 1: nothing "
                 "was trained, so nothing is saved; run the same command again");
  }
  observe::forget_signal();
  EXPECT_NO_THROW(observe::stop_if_signalled("indexing the data"));
}

TEST(StopOnSignal, WithoutSignalsNeverStops) {
  run::StopOnSignal stop({}, torch::kCPU);
  EXPECT_FALSE(stop.stop_after(sum_of(3)));
  EXPECT_FALSE(stop.stop_after(sum_of(3)));
}

}  // namespace
}  // namespace tessel
