#include "launcher/coordinator.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
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

class StoreCoordinator : public Coordinator {
 public:
  StoreCoordinator(int nnodes, int node_rank, const std::string& addr, int port, double timeout_s)
      : nnodes_(nnodes), server_(node_rank == 0) {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = node_rank == 0;
    o.numWorkers = nnodes;
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    store_ = c10::make_intrusive<c10d::TCPStore>(addr, o);
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
    store_->add(key(round, "ready"), 1);
    while (store_->add(key(round, "ready"), 0) < nnodes_)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  void leave(double timeout_s) override {
    store_->add("tessel-launch/left", 1);
    if (!server_) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (store_->add("tessel-launch/left", 0) < nnodes_ &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

 private:
  static std::string key(int round, const char* what) {
    return "tessel-launch/" + std::to_string(round) + "/" + what;
  }
  int nnodes_;
  bool server_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

}  // namespace

std::unique_ptr<Coordinator> make_coordinator(int nnodes, int node_rank, const std::string& addr,
                                              int port, double timeout_s) {
  if (nnodes == 1) return std::make_unique<LocalCoordinator>();
  return std::make_unique<StoreCoordinator>(nnodes, node_rank, addr, port, timeout_s);
}

}  // namespace tessel::launcher
