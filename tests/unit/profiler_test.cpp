#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/observe/profiler.h"
#include "core/plan/config.h"

namespace tessel {
namespace {

TEST(Profiler, SelfTimeSubtractsNestedSpansPerThread) {
  // Thread 1: linear [0, 100) holding addmm [10, 70) holding copy [20, 30); thread 2: addmm
  // [0, 50) on its own; a device kernel [5, 25) counts whole.
  std::vector<observe::ProfiledSpan> spans = {{"aten::addmm", 1, 10'000'000, 70'000'000},
                                              {"aten::linear", 1, 0, 100'000'000},
                                              {"aten::copy_", 1, 20'000'000, 30'000'000},
                                              {"aten::addmm", 2, 0, 50'000'000},
                                              {"gemm_kernel", 7, 5'000'000, 25'000'000, true}};
  const auto ops = observe::op_times(spans);
  ASSERT_EQ(ops.size(), 4u);
  EXPECT_EQ(ops[0].name, "aten::addmm");  // 50 + 50 ms self, the most
  EXPECT_EQ(ops[0].calls, 2);
  EXPECT_DOUBLE_EQ(ops[0].self_ms, 100.0);
  EXPECT_EQ(ops[1].name, "aten::linear");  // 100 - 60
  EXPECT_DOUBLE_EQ(ops[1].self_ms, 40.0);
  EXPECT_EQ(ops[2].name, "gemm_kernel");
  EXPECT_TRUE(ops[2].device);
  EXPECT_DOUBLE_EQ(ops[2].self_ms, 20.0);
  EXPECT_DOUBLE_EQ(ops[3].self_ms, 10.0);  // copy_
  const auto table = top_ops_table(ops, 200.0, 2, 2);
  EXPECT_NE(table.find("| aten::addmm | 1.0 | 50.000 | 50.0% |"), std::string::npos) << table;
  EXPECT_NE(table.find("| (all host ops) | | 75.000 | 75.0% |"), std::string::npos) << table;
  EXPECT_NE(table.find("| gemm_kernel | 0.5 | 10.000 | 10.0% |"), std::string::npos) << table;
  EXPECT_EQ(table.find("aten::copy_"), std::string::npos);  // beyond the top 2
  // Two threads at once (micro-batch pairs): host shares of twice the wall time.
  const auto both = top_ops_table(ops, 200.0, 2, 2, 2);
  EXPECT_NE(both.find("| aten::addmm | 1.0 | 50.000 | 25.0% |"), std::string::npos) << both;
  EXPECT_NE(both.find("| (all host ops) | | 75.000 | 37.5% |"), std::string::npos) << both;
  EXPECT_NE(both.find("| gemm_kernel | 0.5 | 10.000 | 10.0% |"), std::string::npos) << both;
  EXPECT_NE(both.find("host operators on 2 threads at once"), std::string::npos) << both;
}

TEST(Profiler, CountsTheThreadsBusyWithOperators) {
  // Thread 1: 100 ms, thread 2: 60 ms, thread 3: 5 ms (a helper's stray span), a device stream.
  const std::vector<observe::ProfiledSpan> spans = {{"a", 1, 0, 100'000'000},
                                                    {"b", 2, 0, 60'000'000},
                                                    {"c", 3, 0, 5'000'000},
                                                    {"k", 7, 0, 500'000'000, true}};
  EXPECT_EQ(observe::busy_host_threads(spans), 2);
  EXPECT_EQ(observe::busy_host_threads({spans[0]}), 1);
  EXPECT_EQ(observe::busy_host_threads({}), 1);
}

TEST(Profiler, ProfilesItsWindowAndWritesTraceAndTable) {
  const auto dir = std::filesystem::temp_directory_path() / "tessel_profiler_test";
  std::filesystem::remove_all(dir);
  observe::StepProfiler p(2, 3, dir.string(), 0, false);
  auto a = torch::randn({64, 64});
  for (int64_t step = 1; step <= 4; ++step) {
    p.before_step(step);
    for (int i = 0; i < step; ++i) a = torch::mm(a, a).tanh();
    const auto table = p.after_step(step);
    EXPECT_EQ(table.empty(), step != 3) << step;
    if (step == 3) {
      EXPECT_NE(table.find("profile of 2 steps"), std::string::npos) << table;
      // Steps 2 and 3 ran 2 + 3 matmuls: 2.5 calls per step.
      EXPECT_NE(table.find("| aten::mm | 2.5 |"), std::string::npos) << table;
    }
  }
  EXPECT_TRUE(p.done());
  std::ifstream trace(dir / "rank0.pt.trace.json");
  std::stringstream s;
  s << trace.rdbuf();
  EXPECT_NE(s.str().find("aten::mm"), std::string::npos);
  EXPECT_TRUE(std::filesystem::exists(dir / "rank0.top.md"));
  std::filesystem::remove_all(dir);
}

TEST(Profiler, StepsFromThePlan) {
  plan::Config c = plan::load_config_text("training: {steps: 20}\ndata: {path: x}\n", "p.yaml",
                                          {"logging.profile=5"});
  EXPECT_EQ(plan::profile_steps(c),
            std::make_pair(int64_t{4}, int64_t{8}));  // after 3 warm-up steps
  c.logging.profile = "3";  // resumed at 17: 4 steps left, 1 of them warm-up
  EXPECT_EQ(plan::profile_steps(c, 17), std::make_pair(int64_t{18}, int64_t{20}));
  c.logging.profile = "5";
  EXPECT_THROW(plan::profile_steps(c, 17), plan::UserError);  // 5 steps asked, 4 left
  c.logging.profile = "10-14";
  EXPECT_EQ(plan::profile_steps(c), std::make_pair(int64_t{10}, int64_t{14}));
  c.logging.profile = "";
  EXPECT_LT(plan::profile_steps(c).second, plan::profile_steps(c).first);
  try {
    plan::load_config_text("training: {steps: 20}\ndata: {path: x}\nlogging: {profile: 15-30}\n",
                           "p.yaml");
    ADD_FAILURE() << "a window past training.steps was accepted";
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("p.yaml:3: logging.profile ('15-30') names steps 15 to "
                                         "30: they must lie in 1..20"),
              std::string::npos)
        << e.what();
  }
  for (const char* bad : {"x", "0", "3-", "-3", "4-2"}) {
    c.logging.profile = bad;
    EXPECT_THROW(plan::profile_steps(c), plan::UserError) << bad;
  }
}

}  // namespace
}  // namespace tessel
