#include "engine/startup.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>

#include "engine/train.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"

namespace tessel {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
std::string key(const char* what, int64_t rank) { return fmt::format("tessel/{}/{}", what, rank); }

std::string host_name() {
  char h[256] = {0};
  gethostname(h, sizeof h - 1);
  return h;
}

std::string list(const std::vector<int64_t>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i)
    s += (i == 0 ? "" : (i + 1 == ranks.size() ? " and " : ", ")) + std::to_string(ranks[i]);
  return s;
}

// This rank's checks of the plan against its node, before any communicator.
RunLock check_start(const Config& c, const parallel::WorldInfo& w) {
  if (const int64_t cores = std::thread::hardware_concurrency(); c.training.threads > cores)
    throw UserError(fmt::format(
        "{}: training.threads ({}) is more than this machine's {} hardware threads; set it to "
        "at most {} (or auto)",
        c.source, c.training.threads, cores, cores));
  const auto device = resolve_device(c.training.device, w.local_rank);
  parallel::check_layout(c, w.world, w.local_world);  // enough devices for the local ranks
  // The current device is this rank's before any CUDA or NCCL work (allocations, streams and
  // communicators would otherwise land on device 0 from every rank).
  if (device.is_cuda()) c10::cuda::set_device(device.index());
  return w.rank == 0 ? RunLock(c.run.output_dir) : RunLock();
}

}  // namespace

RunLock::RunLock(const std::string& output_dir) {
  std::error_code ec;
  std::filesystem::create_directories(output_dir, ec);
  const std::string path = (std::filesystem::path(output_dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw UserError(
        fmt::format("run.output_dir: cannot create {}: {}", path, std::strerror(errno)));
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[512] = {0};
    const ssize_t n = pread(fd_, holder, sizeof holder - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw UserError(fmt::format("run.output_dir: cannot lock {}: {}", path, std::strerror(err)));
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "another process";
    while (!who.empty() && who.back() == '\n') who.pop_back();
    throw UserError(fmt::format(
        "run.output_dir {} is in use by another run ({}): two trainers would overwrite each "
        "other's checkpoints and metrics; wait for it to end, or set run.output_dir to another "
        "folder",
        output_dir, who));
  }
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  const std::string me =
      fmt::format("pid {} on host {}, started {}\n", getpid(), host_name(), when);
  if (ftruncate(fd_, 0) != 0 || pwrite(fd_, me.data(), me.size(), 0) < 0) {
    // The lock holds without the note; the second trainer is told "another process".
  }
}

RunLock& RunLock::operator=(RunLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

Peers::Peers(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world, double timeout_s,
             std::string where)
    : store_(std::move(store)),
      rank_(rank),
      world_(world),
      timeout_s_(timeout_s),
      where_(std::move(where)) {}

Peers::~Peers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Peers::agree_on_start(const std::string& my_error) {
  store_->set(key("start", rank_), bytes(my_error.empty() ? "ok" : "error: " + my_error));
  if (!my_error.empty()) {
    store_->compareSet("tessel/start_error", {},
                       bytes(fmt::format("rank {}: {}", rank_, my_error)));
    store_->add("tessel/start_errors", 1);
  }
  store_->add("tessel/started", 1);
  const auto until = Clock::now() + std::chrono::duration<double>(timeout_s_);
  while (store_->add("tessel/started", 0) < world_) {
    if (Clock::now() > until) {
      std::vector<int64_t> missing;
      for (int64_t r = 0; r < world_; ++r)
        if (!store_->check({key("start", r)})) missing.push_back(r);
      throw UserError(fmt::format(
          "rank {}: waited parallel.timeout_s ({} s) at {} for every rank to start; {} did not "
          "(it failed before reaching the rendezvous, or was never started: see its output)",
          rank_, timeout_s_, where_, list(missing)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int64_t errors = store_->add("tessel/start_errors", 0);
  if (errors == 0) return;
  store_->add("tessel/start_read", 1);
  if (rank_ == 0) {  // rank 0 serves the store: stay until every rank has read the verdict
    const auto read_until = Clock::now() + std::chrono::seconds(10);
    while (store_->add("tessel/start_read", 0) < world_ && Clock::now() < read_until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!my_error.empty()) throw UserError(my_error);
  throw UserError(fmt::format("{} of {} ranks failed their start-up checks, so none starts; {}",
                              errors, world_, text(store_->get("tessel/start_error"))));
}

void Peers::start_heartbeat() {
  thread_ = std::thread([this] { beat_loop(); });
}

void Peers::beat_loop() {
  const char* env_rank = std::getenv("RANK");
  int64_t beats = 0;
  std::optional<Clock::time_point> seen_failure;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    try {
      store_->set(key("beat", rank_),
                  bytes(fmt::format("{} {}", ++beats, step_.load(std::memory_order_relaxed))));
      if (!failed_ && store_->check({"tessel/failed"})) {
        // Another rank failed: give this rank a moment to fail on its own (the same error on
        // every rank), then end it rather than wait for a collective to time out.
        if (!seen_failure) seen_failure = Clock::now();
        if (Clock::now() - *seen_failure > std::chrono::seconds(3) && !failed_) {
          std::fprintf(stderr, "tessel-train[rank %s]: error: stopping because %s\n",
                       env_rank ? env_rank : std::to_string(rank_).c_str(),
                       text(store_->get("tessel/failed")).c_str());
          std::fflush(nullptr);
          store_->add("tessel/gone", 1);
          std::_Exit(1);
        }
      }
    } catch (const std::exception&) {
      return;  // the store is gone (rank 0 ended): collectives report what happened
    }
    lock.lock();
    cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; });
  }
}

void Peers::report_failure(const std::string& what) {
  failed_ = true;
  try {
    store_->setTimeout(std::chrono::seconds(5));
    store_->compareSet("tessel/failed", {}, bytes(fmt::format("rank {} failed: {}", rank_, what)));
    store_->add("tessel/gone", 1);
    // Rank 0 serves the store: it stays a few seconds so that the others can read the failure
    // (their heartbeat sees it within a second and ends them three seconds later).
    const auto until = Clock::now() + std::chrono::seconds(6);
    while (rank_ == 0 && store_->add("tessel/gone", 0) < world_ && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } catch (const std::exception&) {
    // The store is unreachable; the launcher (or the collectives' timeout) stops the others.
  }
}

std::string Peers::failure() {
  try {
    return store_->check({"tessel/failed"}) ? text(store_->get("tessel/failed")) : "";
  } catch (const std::exception&) {
    return "";
  }
}

std::string Peers::diagnose() {
  try {
    store_->setTimeout(std::chrono::seconds(5));
    auto sample = [&] {
      std::map<int64_t, std::pair<int64_t, int64_t>> s;  // rank -> (beats, step)
      for (int64_t r = 0; r < world_; ++r) {
        if (!store_->check({key("beat", r)})) {
          s[r] = {-1, -1};
          continue;
        }
        int64_t b = 0, st = 0;
        std::sscanf(text(store_->get(key("beat", r))).c_str(), "%ld %ld", &b, &st);
        s[r] = {b, st};
      }
      return s;
    };
    const auto before = sample();
    std::this_thread::sleep_for(std::chrono::milliseconds(3200));
    const auto after = sample();
    std::vector<int64_t> silent;
    int64_t newest = 0;
    for (const auto& [r, bs] : after) newest = std::max(newest, bs.second);
    std::string behind;
    for (const auto& [r, bs] : after) {
      if (r != rank_ && bs.first == before.at(r).first) silent.push_back(r);
      if (bs.second >= 0 && bs.second < newest && bs.first != before.at(r).first)
        behind += fmt::format("{}rank {} at step {}", behind.empty() ? "" : ", ", r, bs.second);
    }
    std::string out;
    if (!silent.empty())
      out = fmt::format(
          "{} stopped responding (no heartbeat for 3 s: stopped, hung, dead, or its host is "
          "unreachable)",
          list(silent));
    if (!behind.empty())
      out += fmt::format("{}behind the others (at step {}): {}", out.empty() ? "" : "; ", newest,
                         behind);
    return out;
  } catch (const std::exception&) {
    return fmt::format(
        "the rendezvous store at {} (served by rank 0) does not answer: rank 0 has stopped or "
        "died",
        where_);
  }
}

Start start_run(const std::string& plan, const std::vector<std::string>& sets,
                const parallel::WorldInfo& world) {
  Start s;
  if (world.world == 1) {
    s.config = load_config(plan, sets);
    s.lock = check_start(s.config, world);
    return s;
  }
  // Several ranks: a plan that fails to load on one of them is still reported to every rank.
  std::string error;
  bool loaded = false;
  try {
    s.config = load_config(plan, sets);
    loaded = true;
  } catch (const UserError& e) {
    error = e.what();
  }
  double timeout_s = s.config.parallel.timeout_s;
  if (!loaded) {  // the plan's default
    Config defaults;
    for (const auto& f : bind_fields(defaults))
      if (f.key == "parallel.timeout_s") timeout_s = std::get<double>(f.def);
  }
  s.store = parallel::rendezvous(world, timeout_s);
  s.peers = std::make_shared<Peers>(s.store, world.rank, world.world, timeout_s,
                                    fmt::format("{}:{}", world.master_addr, world.master_port));
  if (loaded) {
    try {
      s.lock = check_start(s.config, world);
    } catch (const UserError& e) {
      error = e.what();
    }
  }
  s.peers->agree_on_start(error);
  s.peers->start_heartbeat();
  return s;
}

void fail_run(Peers* peers, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const parallel::CommError& e) {
    if (!peers) throw;
    const std::string why = peers->diagnose();
    // Another rank failed first (and closed its connections): that is the cause.
    if (auto first = peers->failure(); !first.empty())
      throw parallel::CommError(
          fmt::format("stopping because {}\n  (then here: {})", first, e.what()));
    const std::string what = why.empty() ? e.what() : fmt::format("{}\n  {}", e.what(), why);
    peers->report_failure(what);
    throw parallel::CommError(what);
  } catch (const c10::Error& e) {
    if (peers) peers->report_failure(e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    if (peers) peers->report_failure(e.what());
    throw;
  }
}

}  // namespace tessel
