#include "launcher/coordinator.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fmt/format.h>

#include <chrono>
#include <future>
#include <map>
#include <thread>

namespace tessel::launcher {
namespace {

class LocalCoordinator : public Coordinator {
 public:
  std::string report_failure(int round, const std::string& what) override {
    return failures_.emplace(round, what).first->second;
  }
  std::optional<std::string> failure(int round) override {
    auto it = failures_.find(round);
    return it == failures_.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
  int report_done(int round) override { return ++done_[round]; }
  int done_count(int round) override { return done_[round]; }
  void barrier(int) override {}
  void leave(double) override {}

 private:
  std::map<int, std::string> failures_;
  std::map<int, int> done_;
};

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

using Clock = std::chrono::steady_clock;

class StoreCoordinator : public Coordinator {
 public:
  StoreCoordinator(int nnodes, int node_rank, const std::string& addr, int port, double timeout_s,
                   const volatile std::sig_atomic_t* signal)
      : nnodes_(nnodes),
        node_rank_(node_rank),
        server_(node_rank == 0),
        timeout_s_(timeout_s),
        signal_(signal),
        where_(fmt::format("{}:{}", addr, port)) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = server_;
    o.numWorkers = nnodes;
    o.waitWorkers = false;  // the barrier below waits, with a deadline and an ear for signals
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    // Connecting retries until the timeout inside c10d: run it aside so that a signal ends the
    // wait at once (the thread is left behind; the launcher is about to exit).
    auto connect = std::make_shared<std::packaged_task<c10::intrusive_ptr<c10d::TCPStore>()>>(
        [addr, o] { return c10::make_intrusive<c10d::TCPStore>(addr, o); });
    auto result = connect->get_future();
    std::thread([connect] { (*connect)(); }).detach();
    while (result.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready)
      if (*signal_ != 0) throw Interrupted{*signal_};
    try {
      store_ = result.get();
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format(
          "node {}: cannot reach node 0's launcher at {} within {} s (--rdzv-timeout-s): is node 0 "
          "running, and does the address resolve from here? ({})",
          node_rank_, where_, timeout_s_, first_line(e.what())));
    }
    store_->set(fmt::format("tessel-launch/node/{}", node_rank_), std::vector<uint8_t>{});
  }
  std::string report_failure(int round, const std::string& what) override {
    auto v = store_->compareSet(key(round, "fail"), {}, bytes(what));
    return {v.begin(), v.end()};
  }
  std::optional<std::string> failure(int round) override {
    if (!store_->check({key(round, "fail")})) return std::nullopt;
    auto v = store_->get(key(round, "fail"));
    return std::string(v.begin(), v.end());
  }
  int report_done(int round) override {
    return static_cast<int>(store_->add(key(round, "done"), 1));
  }
  int done_count(int round) override {
    return static_cast<int>(store_->add(key(round, "done"), 0));
  }
  void barrier(int round) override {
    store_->set(key(round, "ready/" + std::to_string(node_rank_)), std::vector<uint8_t>{});
    store_->add(key(round, "ready"), 1);
    const auto until = Clock::now() + std::chrono::duration<double>(timeout_s_);
    while (store_->add(key(round, "ready"), 0) < nnodes_) {
      if (*signal_ != 0) throw Interrupted{*signal_};
      if (Clock::now() > until) {
        std::string missing;
        for (int n = 0; n < nnodes_; ++n)
          if (!store_->check({key(round, "ready/" + std::to_string(n))}))
            missing += (missing.empty() ? "" : ", ") + std::to_string(n);
        throw std::runtime_error(fmt::format(
            "node {}: waited {} s (--rdzv-timeout-s) at {} for every node's launcher{}; node{} {} "
            "did not come: start tessel-launch there with --nnodes {} and its --node-rank",
            node_rank_, timeout_s_, where_,
            round > 0 ? fmt::format(" to restart (restart {})", round) : "",
            missing.find(',') == std::string::npos ? "" : "s", missing, nnodes_));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  void leave(double timeout_s) override {
    store_->add("tessel-launch/left", 1);
    if (!server_) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (store_->add("tessel-launch/left", 0) < nnodes_ &&
           std::chrono::steady_clock::now() < until && *signal_ == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

 private:
  static std::string key(int round, const std::string& what) {
    return "tessel-launch/" + std::to_string(round) + "/" + what;
  }
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }
  int nnodes_, node_rank_;
  bool server_;
  double timeout_s_;
  const volatile std::sig_atomic_t* signal_;
  std::string where_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

}  // namespace

std::unique_ptr<Coordinator> make_coordinator(int nnodes, int node_rank, const std::string& addr,
                                              int port, double timeout_s,
                                              const volatile std::sig_atomic_t* signal) {
  if (nnodes == 1) return std::make_unique<LocalCoordinator>();
  return std::make_unique<StoreCoordinator>(nnodes, node_rank, addr, port, timeout_s, signal);
}

}  // namespace tessel::launcher
