#include "parallel/dp/zero3.h"

#include <c10/core/StorageImpl.h>
#include <torch/torch.h>

#include <chrono>

namespace tessel::parallel::dp {
namespace {

// A gather buffer's storage is dropped and re-allocated in place: every view of it (the model's
// parameters, and views autograd saved in forward) keeps pointing at the same StorageImpl.
void drop_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

}  // namespace

UnitGatherer::UnitGatherer(Group& dp_cp, Group& experts, optim::FlatAdamW& opt, bool keep)
    : dp_cp_(dp_cp),
      experts_(experts),
      opt_(opt),
      keep_(keep),
      wait_(dp_cp.is_nccl()) {  // NCCL: on CUDA
  const auto& buckets = opt.layout().buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& u = units_[buckets[b].unit];
    u.buckets.push_back(b);
    const int64_t bytes = opt.unit_buffers()[b].numel() * opt.unit_buffers()[b].element_size();
    u.bytes += bytes;
    u.resident = true;  // allocated by the optimizer; released below
    live_bytes_ += bytes;
    unit_of_bucket_.push_back(buckets[b].unit);
    if (buckets[b].unit != "root")
      last_layer_ = std::max<int64_t>(last_layer_, std::stoll(buckets[b].unit.substr(7)));
  }
  release_all();
  peak_bytes_ = 0;
}

UnitGatherer::Unit* UnitGatherer::find(const std::string& name) {
  auto it = units_.find(name);
  return it == units_.end() ? nullptr : &it->second;
}

int64_t UnitGatherer::largest_unit_bytes() const {
  int64_t most = 0;
  for (const auto& [name, u] : units_) most = std::max(most, u.bytes);
  return most;
}

void UnitGatherer::start(Unit& u) {
  if (u.resident) return;
  u.resident = true;
  live_bytes_ += u.bytes;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  const auto& layout = opt_.layout();
  auto shard = opt_.low_precision() ? opt_.weight_shard() : opt_.master_shard();
  for (size_t b : u.buckets) {
    const auto& bucket = layout.buckets()[b];
    auto full = opt_.unit_buffers()[b];
    allocate_storage(full);
    u.pending.start(bucket.expert ? experts_ : dp_cp_, full,
                    shard.narrow(0, bucket.shard_offset, layout.piece_numel(bucket)));
  }
}

void UnitGatherer::ready(Unit& u) {
  start(u);
  wait_.start();
  u.pending.wait();
  wait_.stop();
}

void UnitGatherer::release(Unit& u) {
  if (!u.resident) return;
  u.pending.wait();  // never free a buffer a gather is writing
  for (size_t b : u.buckets) drop_storage(opt_.unit_buffers()[b]);
  u.resident = false;
  u.done = 0;
  live_bytes_ -= u.bytes;
}

void UnitGatherer::release_all() {
  for (auto& [name, u] : units_) release(u);
}

void UnitGatherer::before_stage() {
  if (auto* root = find("root")) ready(*root);
}

torch::Tensor UnitGatherer::before_block(int64_t i, const torch::Tensor& x) {
  if (auto* u = layer(i)) ready(*u);
  if (auto* next = layer(i + 1)) start(*next);  // overlaps this block's forward
  return x;
}

torch::Tensor UnitGatherer::after_block(int64_t i, const torch::Tensor& y) {
  auto* u = layer(i);
  if (!u) return y;
  if (!y.requires_grad()) {  // evaluation: nothing comes back for it
    release(*u);
    return y;
  }
  if (i != last_layer_ && !keep_) release(*u);  // the last block's backward comes next: keep it
  // The gradient of this block's output arrives just before the block's own backward.
  y.register_hook([this, i](const torch::Tensor& g) {
    if (auto* me = layer(i)) ready(*me);
    if (auto* previous = layer(i - 1)) start(*previous);  // overlaps this block's backward
    return g;
  });
  return y;
}

void UnitGatherer::bucket_done(size_t b) {
  auto& u = units_.at(unit_of_bucket_[b]);
  if (++u.done < u.buckets.size() || keep_) return;
  // Every bucket of the unit has this pass's gradients. A forward that ran since the unit was
  // gathered for this pass may have freed it already; the count restarts either way (else the
  // next pass's count would pass the bucket count and never free the unit again this step).
  u.done = 0;
  release(u);
}

}  // namespace tessel::parallel::dp
