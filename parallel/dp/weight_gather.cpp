#include "parallel/dp/weight_gather.h"

#include <torch/torch.h>

#include <algorithm>

namespace tessel::parallel::dp {

WeightGather::WeightGather(Group& dp_cp, Group& experts, optim::FlatAdamW& opt,
                           observe::SpanTimer& timer)
    : dp_cp_(dp_cp),
      experts_(experts),
      opt_(opt),
      timer_(timer),
      pending_(opt.layout().buckets().size()),
      in_flight_(opt.layout().buckets().size(), false) {
  for (const auto& s : opt.layout().slots()) {
    auto& b = buckets_of_[optim::unit_of(s.name)];
    if (std::find(b.begin(), b.end(), static_cast<size_t>(s.bucket)) == b.end())
      b.push_back(static_cast<size_t>(s.bucket));
  }
}

void WeightGather::start_all() {
  if ((dp_cp_.size() == 1 && experts_.size() == 1) || !due_) return;
  due_ = false;
  wait_in_flight();  // never two gathers into one bucket
  const auto& layout = opt_.layout();
  auto weights = opt_.weights();
  for (size_t i = 0; i < layout.buckets().size(); ++i) {
    const auto& b = layout.buckets()[i];
    if (b.shards == 1) continue;  // whole on every rank
    pending_[i].start(b.expert ? experts_ : dp_cp_, weights.narrow(0, b.begin, b.end - b.begin),
                      weights.narrow(0, layout.piece_flat(b), layout.piece_numel(b)));
    in_flight_[i] = true;
  }
}

void WeightGather::wait(const std::string& unit) {
  auto it = buckets_of_.find(unit);
  if (it == buckets_of_.end()) return;
  for (size_t b : it->second) {
    if (!in_flight_[b]) continue;
    timer_.start();
    pending_[b].wait();
    timer_.stop();
    in_flight_[b] = false;
  }
}

void WeightGather::wait_in_flight() {
  for (const auto& [unit, buckets] : buckets_of_) wait(unit);
}

void WeightGather::wait_all() {
  start_all();  // an update not gathered yet (evaluation or a checkpoint between steps)
  wait_in_flight();
}

void WeightGather::before_stage() { wait("root"); }

torch::Tensor WeightGather::before_block(int64_t layer, const torch::Tensor& x) {
  wait("layers." + std::to_string(layer));
  return x;
}

}  // namespace tessel::parallel::dp
