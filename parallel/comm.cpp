#include "parallel/comm.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/plan/config.h"

namespace tessel::parallel {
namespace {

// Gloo's collectives run on the process group's worker thread, which holds the work, and so the
// tensors the work holds, until just after it completes: a moment after wait() returns, later on
// a busy CPU. Tensors a collective held would then be freed at a time that depends on thread
// scheduling (planner_test's step peaks moved by a bucket or a shard between runs). Waiting here
// for the worker to let go frees them at wait(). Bounded: past it they are freed later.
void release(c10::intrusive_ptr<c10d::Work>& w) {
  if (dynamic_cast<c10d::ProcessGroupGloo::AsyncWork*>(w.get())) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (w.use_count() > 1 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
  }
  w.reset();
}

// Reduce-scatter over Gloo, which has none: all-reduce a copy of the input (the input itself when
// the caller gives it up), then take this rank's chunk. c10d's own emulation does the same, but
// wraps the all-reduce in a work of its own, so the copy escaped release() above.
class GlooReduceScatter final : public c10d::Work {
 public:
  GlooReduceScatter(c10d::Backend& gloo, torch::Tensor out, const torch::Tensor& in,
                    c10d::ReduceOp op, bool scratch_input)
      : out_(std::move(out)),
        copy_(scratch_input && in.is_contiguous() ? in.view(-1) : in.flatten().clone()),
        rank_(gloo.getRank()),
        size_(gloo.getSize()) {
    std::vector<at::Tensor> v{copy_};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    allreduce_ = gloo.allreduce(v, o);
  }
  bool isCompleted() override { return !allreduce_ || allreduce_->isCompleted(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!allreduce_) return true;
    allreduce_->wait(timeout);
    release(allreduce_);
    auto mine = copy_.chunk(size_)[rank_];
    if (mine.data_ptr() != out_.data_ptr()) out_.copy_(mine.view_as(out_));  // else in place
    copy_ = torch::Tensor();
    return true;
  }

 private:
  torch::Tensor out_, copy_;
  c10::intrusive_ptr<c10d::Work> allreduce_;
  int64_t rank_, size_;
};

// All-gather over Gloo straight into the output: one in-place broadcast per rank of its slice.
// c10d's Gloo all-gather stages the whole output in a flat buffer of its own while it runs (the
// whole weights for ZeRO-1's gather of the updated weights, alive or not at the step's peak as
// Gloo's worker threads happen to run); the broadcasts move the same bytes, exactly.
class GlooAllGather final : public c10d::Work {
 public:
  GlooAllGather(c10d::Backend& gloo, const torch::Tensor& out, const torch::Tensor& in) {
    const int64_t n = gloo.getSize(), k = in.numel();
    auto flat = out.view(-1);
    flat.narrow(0, gloo.getRank() * k, k).copy_(in.reshape(-1));
    for (int64_t r = 0; r < n; ++r) {
      std::vector<at::Tensor> slice{flat.narrow(0, r * k, k)};
      c10d::BroadcastOptions o;
      o.rootRank = r;
      works_.push_back(gloo.broadcast(slice, o));
    }
  }
  bool isCompleted() override {
    return std::all_of(works_.begin(), works_.end(),
                       [](const auto& w) { return !w || w->isCompleted(); });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : works_)
      if (w) {
        w->wait(timeout);
        release(w);
      }
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

// Gloo on CUDA tensors (several ranks sharing one GPU, where NCCL cannot run): every Gloo call gets
// CPU copies, and wait() copies results back into the CUDA tensors. Gloo's send/recv and some of
// its collectives take raw pointers and would read device memory from the host; staging them all
// in one place means no Gloo call ever sees a device pointer.
class HostStaged final : public c10d::Work {
 public:
  // `back`: (CUDA destination, its host copy) pairs to copy after the inner work finishes.
  HostStaged(c10::intrusive_ptr<c10d::Work> inner,
             std::vector<std::pair<torch::Tensor, torch::Tensor>> back)
      : inner_(std::move(inner)), back_(std::move(back)) {}
  bool isCompleted() override { return !inner_ || inner_->isCompleted(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!inner_) return true;
    inner_->wait(timeout);
    release(inner_);
    for (auto& [device, host] : back_) device.copy_(host);
    back_.clear();
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> back_;
};

}  // namespace

bool Group::staged(const torch::Tensor& t) const { return t.defined() && t.is_cuda() && is_gloo(); }

torch::Tensor Group::host(const torch::Tensor& t) const {
  return staged(t) ? t.to(torch::kCPU) : t;
}

Work Group::finish(c10::intrusive_ptr<c10d::Work> w, const torch::Tensor& device,
                   const torch::Tensor& host_copy, const char* op) {
  if (!staged(device)) return {std::move(w), what(op)};
  return {
      c10::make_intrusive<HostStaged>(
          std::move(w), std::vector<std::pair<torch::Tensor, torch::Tensor>>{{device, host_copy}}),
      what(op)};
}

void Work::wait() {
  if (!w_) return;
  try {
    w_->wait();
  } catch (const c10::Error& e) {
    throw CommError(what_ + " failed: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw CommError(what_ + " failed: " + e.what());
  }
  release(w_);
}

Group::Group(std::string name, std::vector<int64_t> ranks, int64_t global_rank,
             c10::intrusive_ptr<c10d::Backend> backend, bool owner)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      backend_(std::move(backend)),
      owner_(owner) {
  // The communicator's kind, read once from c10d's name for it (the plan's names are c10d's).
  if (backend_)
    for (auto k : {plan::Backend::kGloo, plan::Backend::kNccl})
      if (backend_->getBackendName() == plan::name_of(k)) kind_ = k;
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  TORCH_CHECK(it != ranks_.end(), "rank ", global_rank, " is not in group ", name_);
  rank_ = it - ranks_.begin();
}

c10d::Backend& Group::backend(const char* op) const {
  TORCH_CHECK(backend_, op, " on group ", name_, " of ", size(),
              " ranks, which is not connected: the plan's steps were not expected to use it "
              "(parallel/mesh.h group_used)");
  return *backend_;
}

void Group::set_side(std::unique_ptr<Group> side) {
  TORCH_CHECK(side && side->ranks_ == ranks_ && side->rank_ == rank_, "group ", name_,
              ": a side channel must join the same ranks");
  side_ = std::move(side);
}

std::string Group::what(const char* op) {
  std::string members;
  for (auto r : ranks_) members += (members.empty() ? "" : ",") + std::to_string(r);
  return fmt::format("{} #{} on group {} (ranks [{}]) at rank {}", op, ++seq_, name_, members,
                     ranks_[static_cast<size_t>(rank_)]);
}

Work Group::all_reduce(torch::Tensor& t, c10d::ReduceOp op) {
  if (size() == 1) return {};
  bytes_ += t.numel() * t.element_size();
  auto h = host(t);
  std::vector<at::Tensor> v{h};
  return finish(backend("all_reduce").allreduce(v, c10d::AllreduceOptions{op}), t, h, "all_reduce");
}

void Group::all_reduce_coalesced(const std::vector<torch::Tensor>& tensors,
                                 torch::Tensor& staging) {
  if (size() == 1 || tensors.empty()) return;
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  const auto& first = tensors.front();
  if (!staging.defined() || staging.numel() < n || staging.scalar_type() != first.scalar_type() ||
      staging.device() != first.device())
    staging = torch::empty({n}, first.options());
  auto flat = staging.narrow(0, 0, n);
  // One kernel packs (cat), one multi-tensor kernel unpacks (_foreach_copy_).
  std::vector<torch::Tensor> flats, parts;
  int64_t at = 0;
  for (const auto& t : tensors) {
    flats.push_back(t.reshape({-1}));
    parts.push_back(flat.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
  torch::cat_out(flat, flats);
  all_reduce(flat).wait();
  at::_foreach_copy_(tensors, parts);
}

Work Group::broadcast(torch::Tensor& t, int64_t root) {
  if (size() == 1) return {};
  auto h = host(t);
  std::vector<at::Tensor> v{h};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return finish(backend("broadcast").broadcast(v, o), t, h, "broadcast");
}

Work Group::reduce(torch::Tensor& t, int64_t root, c10d::ReduceOp op) {
  if (size() == 1) return {};
  auto h = host(t);
  std::vector<at::Tensor> v{h};
  c10d::ReduceOptions o;
  o.reduceOp = op;
  o.rootRank = root;
  return finish(backend("reduce").reduce(v, o), t, h, "reduce");
}

Work Group::all_gather(torch::Tensor& out, torch::Tensor& in) {
  TORCH_CHECK(out.numel() == in.numel() * size(), "all_gather: out has ", out.numel(),
              " elements, want ", in.numel() * size());
  if (size() == 1) {
    out.copy_(in.view_as(out));
    return {};
  }
  bytes_ += out.numel() * out.element_size();
  auto h_out = staged(out) ? torch::empty_like(out, torch::kCPU) : out;
  auto h_in = host(in);
  auto& b = backend("all_gather");
  if (is_gloo() && h_out.is_contiguous())
    return finish(c10::make_intrusive<GlooAllGather>(b, h_out, h_in), out, h_out, "all_gather");
  return finish(b._allgather_base(h_out, h_in), out, h_out, "all_gather");
}

Work Group::reduce_scatter(torch::Tensor& out, torch::Tensor& in, c10d::ReduceOp op,
                           bool scratch_input) {
  TORCH_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: in has ", in.numel(),
              " elements, want ", out.numel() * size());
  if (size() == 1) {
    out.copy_(in.view_as(out));
    return {};
  }
  bytes_ += in.numel() * in.element_size();
  auto& b = backend("reduce_scatter");
  if (is_gloo()) {
    auto h_out = staged(out) ? torch::empty_like(out, torch::kCPU) : out;
    return finish(c10::make_intrusive<GlooReduceScatter>(b, h_out, host(in), op, scratch_input),
                  out, h_out, "reduce_scatter");
  }
  c10d::ReduceScatterOptions o;
  o.reduceOp = op;
  return {b._reduce_scatter_base(out, in, o), what("reduce_scatter")};
}

Work Group::all_to_all(torch::Tensor& out, torch::Tensor& in, const std::vector<int64_t>& out_rows,
                       const std::vector<int64_t>& in_rows) {
  if (size() == 1) {
    out.copy_(in);
    return {};
  }
  bytes_ += in.numel() * in.element_size();
  // Empty split sizes: equal slices.
  std::vector<int64_t> out_split = out_rows, in_split = in_rows;
  auto h_out = staged(out) ? torch::empty_like(out, torch::kCPU) : out;
  auto h_in = host(in);
  return finish(backend("all_to_all").alltoall_base(h_out, h_in, out_split, in_split), out, h_out,
                "all_to_all");
}

int64_t Group::shutdown() {
  int64_t n = 0;
  if (backend_ && owner_ && !shut_down_) {
    backend_->shutdown();
    ++n;
  }
  shut_down_ = true;
  for (auto* g : {side_.get(), inner_.get(), outer_.get()})
    if (g) n += g->shutdown();
  for (auto& c : channels_) n += c.group->shutdown();
  return n;
}

void Group::barrier() {
  if (size() == 1) return;
  Work(backend("barrier").barrier(), what("barrier")).wait();
}

std::vector<const Group*> Group::parts() const {
  std::vector<const Group*> out;
  for (const auto* g : {side_.get(), inner_.get(), outer_.get()})
    if (g) out.push_back(g);
  for (const auto& c : channels_) out.push_back(c.group.get());
  return out;
}

int64_t Group::bytes() const {
  int64_t n = bytes_;
  for (const auto* g : parts()) n += g->bytes();  // a split's side channel too
  return n;
}

int64_t Group::sent_bytes() const {
  int64_t n = sent_bytes_;
  for (const auto* g : parts()) n += g->sent_bytes();
  return n;
}

void Group::set_split(std::unique_ptr<Group> inner, std::unique_ptr<Group> outer) {
  TORCH_CHECK(inner && outer && inner->size() * outer->size() == size(), "group ", name_,
              ": a split into ", inner ? inner->size() : 0, " x ", outer ? outer->size() : 0,
              " ranks does not cover its ", size());
  inner_ = std::move(inner);
  outer_ = std::move(outer);
}

void Group::add_channel(int64_t from, int64_t to, std::unique_ptr<Group> channel) {
  TORCH_CHECK(channel && from != to && from >= 0 && to >= 0 && from < size() && to < size() &&
                  channel->ranks_ == std::vector<int64_t>({ranks_[from], ranks_[to]}),
              "group ", name_, ": a channel from ", from, " to ", to,
              " must join those two ranks, sender first");
  channels_.push_back({from, to, std::move(channel)});
}

Group& Group::channel_of(int64_t from, int64_t to) {
  for (auto& c : channels_)
    if (c.from == from && c.to == to) return *c.group;
  TORCH_CHECK(false, "group ", name_, " has no channel from rank ", from, " to rank ", to);
}

Work Group::post(const P2POp& op) {
  if (op.kind == P2POp::kSend) {
    sent_bytes_ += op.tensor.numel() * op.tensor.element_size();
    std::vector<at::Tensor> v{host(op.tensor.contiguous())};
    return finish(backend("send").send(v, static_cast<int>(op.peer), op.tag), {}, {}, "send");
  }
  auto h = staged(op.tensor) ? torch::empty_like(op.tensor, torch::kCPU) : op.tensor;
  std::vector<at::Tensor> v{h};
  return finish(backend("recv").recv(v, static_cast<int>(op.peer), op.tag), op.tensor, h, "recv");
}

std::vector<Work> Group::send_recv(const std::vector<P2POp>& ops) {
  std::vector<Work> works;
  if (!channels_.empty()) {
    // Each on its direction's channel, alone. On NCCL inside a group of one operation, so that
    // it runs on the channel's eagerly connected communicator (a lone send would open a
    // communicator of its own for the pair, blocking until the peer's first operation).
    for (const auto& op : ops) {
      const bool send = op.kind == P2POp::kSend;
      Group& ch = send ? channel_of(rank_, op.peer) : channel_of(op.peer, rank_);
      P2POp one{op.kind, op.tensor, send ? 1 : 0, 0};
      if (ch.is_nccl()) {
        ch.backend_->startCoalescing();
        ch.post(one);
        works.emplace_back(ch.backend_->endCoalescing(), ch.what(send ? "send" : "recv"));
      } else {
        works.push_back(ch.post(one));
      }
    }
    return works;
  }
  // Gloo's send/recv are asynchronous pairs, so posting all of them before waiting is enough;
  // NCCL batches them between startCoalescing/endCoalescing (one grouped launch).
  const bool coalesce = is_nccl();
  if (coalesce) backend("send_recv").startCoalescing();
  for (const auto& op : ops) works.push_back(post(op));
  if (coalesce) {
    auto w = backend_->endCoalescing();
    works.clear();
    works.emplace_back(w, what("send_recv"));
  }
  return works;
}

}  // namespace tessel::parallel
