// ZeRO-1/2's weight gathers (parallel/dp/weight_gather.h) over every rank: started together after
// the step, each unit's parameters whole once the forward's hook for that unit has waited, even
// where a bucket holds parameters of several units.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/optim/optim.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/dp/weight_gather.h"
#include "tests/dist/dist_env.h"

namespace tessel::parallel {
namespace {

TEST(WeightGather, EachUnitIsWholeOnceItsHookHasWaited) {
  auto& g = test_group();
  const plan::Config c = plan::load_config_text(
      "data: {path: x}\nmodel: {arch: llama, layers: 3, hidden: 16, heads: 2, vocab_size: 301}\n",
      "t");
  auto model = models::build_model(models::model_shape(c.model), 3);
  const auto params = models::named_params(model);
  for (int64_t zero : {1, 2}) {
    // Buckets of 1,000 elements: several units' parameters share buckets.
    optim::FlatAdamW opt(params, c.training,
                         optim::layout_of(params, {1000, g.size(), g.rank(), zero, false}));
    const auto& layout = opt.layout();
    auto weights = opt.weights();
    // Every rank writes its piece of each bucket: rank k's pieces hold k + 1 (+ the bucket index
    // / 1000, to tell buckets apart).
    auto want = torch::empty_like(weights);
    for (size_t b = 0; b < layout.buckets().size(); ++b) {
      const auto& bucket = layout.buckets()[b];
      const int64_t piece = layout.piece_numel(bucket);
      for (int64_t k = 0; k < g.size(); ++k)
        want.narrow(0, bucket.begin + k * piece, piece)
            .fill_(k + 1 + static_cast<double>(b) / 1000);
      weights.narrow(0, layout.piece_flat(bucket), piece)
          .copy_(want.narrow(0, layout.piece_flat(bucket), piece));
    }
    observe::SpanTimer timer(false);
    dp::WeightGather gather(g, g, opt, timer);
    gather.start_all();
    auto whole = [&](const std::string& unit) {
      for (const auto& s : layout.slots())
        if (optim::unit_of(s.name) == unit)
          EXPECT_TRUE(
              torch::equal(weights.narrow(0, s.offset, s.numel), want.narrow(0, s.offset, s.numel)))
              << "zero " << zero << ": " << s.name << " after " << unit << "'s wait";
    };
    gather.before_stage();
    whole("root");
    for (int64_t i = 0; i < 3; ++i) {
      auto x = torch::ones({2});
      EXPECT_TRUE(torch::equal(gather.before_block(i, x), x));
      whole("layers." + std::to_string(i));
    }
    gather.wait_all();
    EXPECT_TRUE(torch::equal(weights, want)) << "zero " << zero;
  }
}

}  // namespace
}  // namespace tessel::parallel
