#include "engine/run/startup.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <optional>

#include "core/observe/interrupt.h"
#include "engine/checkpoint/checkpoint.h"
#include "engine/data/dataset.h"
#include "engine/data/files.h"
#include "engine/data/vocabulary.h"
#include "engine/io/weights.h"
#include "engine/run/build.h"
#include "engine/run/init_plan.h"
#include "engine/run/resume_plan.h"
#include "engine/run/stop.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/comm.h"
#include "parallel/mesh.h"

namespace tessel::run {

std::string init_weights_file(const std::string& init_from) {
  return io::weights_entry(init_from, "model.init_from");
}

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
RunLock check_start(const plan::Config& c, const parallel::WorldInfo& w) {
  if (const int64_t cores = std::thread::hardware_concurrency(); c.training.threads > cores)
    throw plan::UserError(fmt::format(
        "{}: training.threads ({}) is more than this machine's {} hardware threads; set it to "
        "at most {} (or auto)",
        c.source, c.training.threads, cores, cores));
  const auto device = resolve_device(c.training.device, w);  // enough devices for the local ranks
  const auto layout = plan::check_layout(c, w.world, w.local_world);
  // The current device is this rank's before any CUDA or NCCL work (allocations, streams and
  // communicators would otherwise land on device 0 from every rank).
  if (device.is_cuda()) c10::cuda::set_device(device.index());
  data::check_vocabularies(c);                // what tessel-data recorded of each dataset
  data::check_token_ids(c, w.rank, w.world);  // this rank's share of the data
  if (!c.model.init_from.empty()) init_weights_file(c.model.init_from);
  if (const auto dir = checkpoint::checkpoint_to_resume(c); !dir.empty()) {
    plan::Config resolved = c;  // as the checkpoint recorded it: dp resolved
    resolved.parallel.dp = layout.dp;
    check_resume_plan(resolved, dir, w.rank == 0);
  }
  if (!c.checkpoint.export_hf.empty())  // the model's MLP has a Hugging Face form to export
    models::hf_activation(models::model_shape(c.model),
                          "checkpoint.export_hf " + c.checkpoint.export_hf);
  if (w.rank != 0) return RunLock();
  RunLock lock(c.run.output_dir, c.checkpoint_dir());
  checkpoint::check_room_for_checkpoint(c);
  if (!c.checkpoint.export_hf.empty())
    checkpoint::check_export_folder(c.checkpoint.export_hf, c.checkpoint_dir(),
                                    "checkpoint.export_hf");
  return lock;
}

// Runs `fn` aside and waits at most `seconds` for it: TCPStore calls have no deadline when the
// server (rank 0) is stopped. `fn` owns what it uses (captured by value), so a thread that does
// not return in time is left behind safely (this rank is failing and about to exit).
template <class T>
std::optional<T> within(double seconds, std::function<T()> fn) {
  auto done = std::make_shared<std::promise<std::optional<T>>>();
  auto result = done->get_future();
  std::thread([done, fn = std::move(fn)] {
    try {
      done->set_value(fn());
    } catch (const std::exception&) {
      done->set_value(std::nullopt);
    }
  }).detach();
  if (result.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready)
    return std::nullopt;
  return result.get();
}

}  // namespace

RunLock::RunLock(const std::string& output_dir, const std::string& checkpoint_dir) {
  lock("run.output_dir", output_dir);
  // Each folder is also locked on the folder itself, whichever role names it (the run folder,
  // the default <run.output_dir>/checkpoints or checkpoint.dir): another run naming one of this
  // run's folders in either role meets the lock. No file is added to the checkpoint folder (its
  // listing stays step_<N> and latest), and it is checked writable now.
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(checkpoint_dir, ec);
  const std::string probe = (fs::path(checkpoint_dir) / ".tessel-write-test-XXXXXX").string();
  std::vector<char> name(probe.begin(), probe.end());
  name.push_back('\0');
  const int tmp = ::mkstemp(name.data());
  if (tmp < 0)
    throw plan::UserError(fmt::format("checkpoint.dir {}: cannot write there ({})", checkpoint_dir,
                                      ec ? ec.message() : std::strerror(errno)));
  ::close(tmp);
  ::unlink(name.data());
  // One folder in both roles is locked once (a second flock of it here would meet the first).
  if (fs::equivalent(checkpoint_dir, output_dir, ec)) return;
  lock_folder("checkpoint.dir", checkpoint_dir);
}

void RunLock::lock_folder(const std::string& key, const std::string& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    if (err == EWOULDBLOCK) {
      // A run folder's holder notes itself in its .lock; a checkpoint folder has no note.
      std::string who =
          "as its run.output_dir, its checkpoint.dir or its default "
          "<run.output_dir>/checkpoints";
      try {  // a regular file only: a FIFO planted there must not hang this
        const auto note = data::read_regular(folder + "/.lock", key);
        if (note && !note->empty()) who = note->substr(0, std::min(note->find('\n'), size_t{200}));
      } catch (const plan::UserError&) {
      }
      throw plan::UserError(fmt::format(
          "{} {} is in use by another run ({}): two runs would overwrite each other's "
          "checkpoints and metrics, and a resume would load the other run's weights; wait for "
          "it to end, or set {} to another folder",
          key, folder, who, key));
    }
    spdlog::warn(
        "{} {}: this filesystem does not lock folders ({}); make sure no other run "
        "uses it",
        key, folder, std::strerror(err));
    return;
  }
  fds_.push_back(fd);
}

void RunLock::lock(const std::string& key, const std::string& folder) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  lock_folder(key, folder);  // first: a run holding it as its checkpoint folder meets this
  const std::string path = (std::filesystem::path(folder) / ".lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw plan::UserError(fmt::format("{}: cannot create {}: {}", key, path, std::strerror(errno)));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[512] = {0};
    const ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK)
      throw plan::UserError(fmt::format("{}: cannot lock {}: {}", key, path, std::strerror(err)));
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "another process";
    while (!who.empty() && who.back() == '\n') who.pop_back();
    throw plan::UserError(fmt::format(
        "{} {} is in use by another run ({}): two trainers would overwrite each other's "
        "checkpoints and metrics; wait for it to end, or set {} to another folder",
        key, folder, who, key));
  }
  fds_.push_back(fd);
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  const std::string me =
      fmt::format("pid {} on host {}, started {}\n", getpid(), host_name(), when);
  if (ftruncate(fd, 0) != 0 || pwrite(fd, me.data(), me.size(), 0) < 0) {
    // The lock holds without the note; the second trainer is told "another process".
  }
}

RunLock& RunLock::operator=(RunLock&& o) noexcept {
  if (this != &o) {
    for (int fd : fds_) ::close(fd);
    fds_ = std::move(o.fds_);
    o.fds_.clear();
  }
  return *this;
}

RunLock::~RunLock() {
  for (int fd : fds_) ::close(fd);  // releases the flocks
}

Peers::Peers(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world, double timeout_s,
             const std::string& host, int port)
    : store_(std::move(store)),
      host_(host),
      port_(port),
      rank_(rank),
      world_(world),
      timeout_s_(timeout_s),
      where_(fmt::format("{}:{}", host, port)) {}

Peers::~Peers() {
  {
    std::lock_guard<std::mutex> lock(beat_->mu);
    beat_->stop = true;
  }
  beat_->cv.notify_all();
  if (!thread_.joinable()) return;
  if (beat_->failed)
    thread_.detach();  // it may be blocked on a stopped rank 0's store: the process is ending
  else
    thread_.join();
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
    stop_if_signalled("waiting for every rank to start");
    if (Clock::now() > until) {
      std::vector<int64_t> missing;
      for (int64_t r = 0; r < world_; ++r)
        if (!store_->check({key("start", r)})) missing.push_back(r);
      throw plan::UserError(fmt::format(
          "rank {}: waited parallel.timeout_s ({} s) at {} for every rank to start; {} did not "
          "(it failed before reaching the rendezvous, or was never started: see its output)",
          rank_, timeout_s_, where_, list(missing)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop_if_signalled("waiting for every rank to start");
  const int64_t errors = store_->add("tessel/start_errors", 0);
  if (errors == 0) return;
  store_->add("tessel/start_read", 1);
  if (rank_ == 0) {  // rank 0 serves the store: stay until every rank has read the verdict
    const auto read_until = Clock::now() + std::chrono::seconds(10);
    while (store_->add("tessel/start_read", 0) < world_ && Clock::now() < read_until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!my_error.empty()) throw plan::UserError(my_error);
  throw plan::UserError(
      fmt::format("{} of {} ranks failed their start-up checks, so none starts; {}", errors, world_,
                  text(store_->get("tessel/start_error"))));
}

void Peers::stop_if_signalled(const std::string& doing) {
  try {
    observe::stop_if_signalled(doing);
  } catch (const observe::Interrupted& e) {
    report_stop(e.what());
    throw;
  }
  if (store_->check({"tessel/stopped"})) {
    store_->add("tessel/gone", 1);  // rank 0 serves the store until every rank has read it
    observe::stop_as_another_rank_did(text(store_->get("tessel/stopped")));
  }
}

void Peers::report_stop(const std::string& what) {
  post_end("tessel/stopped", fmt::format("rank {} {}", rank_, what));
}

// This rank's end (a failure, a stop during start-up) under `key`, the first one posted winning.
// Rank 0 serves the store: it stays a few seconds so that the others can read it (their heartbeat
// sees it within a second).
void Peers::post_end(const std::string& key, const std::string& text) {
  beat_->failed = true;  // this rank's own exit reports it; its heartbeat need not
  if (store_silent_) return;
  within<bool>(10, [store = store_, rank = rank_, world = world_, key, text] {
    store->compareSet(key, {}, bytes(text));
    store->add("tessel/gone", 1);
    const auto until = Clock::now() + std::chrono::seconds(6);
    while (rank == 0 && store->add("tessel/gone", 0) < world && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return true;
  });
}

void Peers::start_heartbeat() {
  beat_->rank = rank_;
  thread_ = std::thread([b = beat_, host = host_, port = port_] { beat_loop(b, host, port); });
}

// The heartbeat's own connection (5 s per call, so that a gone rank 0 ends it soon). It connects
// from the heartbeat's thread and tries again while the run goes on: on a loaded node rank 0's
// store may take longer than one try to answer, and a heartbeat late to start costs nothing.
void Peers::beat_loop(const std::shared_ptr<Beat>& b, const std::string& host, int port) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.timeout = std::chrono::seconds(5);
  while (!b->store) {
    try {
      b->store = c10::make_intrusive<c10d::TCPStore>(host, o);
    } catch (const std::exception&) {
      std::unique_lock<std::mutex> lock(b->mu);
      if (b->cv.wait_for(lock, std::chrono::seconds(1), [&] { return b->stop; })) return;
    }
  }
  if (const auto prefix = parallel::agent_store_prefix(); !prefix.empty())
    b->store = c10::make_intrusive<c10d::PrefixStore>(prefix, b->store);
  const char* env_rank = std::getenv("RANK");
  int64_t beats = 0;
  std::optional<Clock::time_point> seen_failure;
  std::unique_lock<std::mutex> lock(b->mu);
  while (!b->stop) {
    lock.unlock();
    try {
      b->store->set(key("beat", b->rank),
                    bytes(fmt::format("{} {}", ++beats, b->step.load(std::memory_order_relaxed))));
      if (!b->failed && b->store->check({"tessel/stopped"})) {
        // A rank stopped on a signal during start-up: nothing was trained, so every rank stops
        // as it did, with the stop's exit code (engine/run/stop.h), wherever it is waiting.
        std::fprintf(stderr, "tessel-train[rank %s]: stopping because %s\n",
                     env_rank ? env_rank : std::to_string(b->rank).c_str(),
                     text(b->store->get("tessel/stopped")).c_str());
        std::fflush(nullptr);
        b->store->add("tessel/gone", 1);
        std::_Exit(kExitStopped);
      }
      if (!b->failed && b->store->check({"tessel/failed"})) {
        // Another rank failed: give this rank a moment to fail on its own (the same error on
        // every rank), then end it rather than wait for a collective to time out.
        if (!seen_failure) seen_failure = Clock::now();
        if (Clock::now() - *seen_failure > std::chrono::seconds(3) && !b->failed) {
          std::fprintf(stderr, "tessel-train[rank %s]: error: stopping because %s\n",
                       env_rank ? env_rank : std::to_string(b->rank).c_str(),
                       text(b->store->get("tessel/failed")).c_str());
          std::fflush(nullptr);
          b->store->add("tessel/gone", 1);
          std::_Exit(1);
        }
      }
    } catch (const std::exception&) {
      return;  // the store is gone (rank 0 ended): collectives report what happened
    }
    lock.lock();
    b->cv.wait_for(lock, std::chrono::seconds(1), [&] { return b->stop; });
  }
}

void Peers::report_failure(const std::string& what) {
  // The others' heartbeat sees it within a second and ends them three seconds later.
  post_end("tessel/failed", fmt::format("rank {} failed: {}", rank_, what));
}

std::string Peers::failure() {
  if (store_silent_) return "";
  auto got = within<std::string>(5, [store = store_] {
    return store->check({"tessel/failed"}) ? text(store->get("tessel/failed")) : std::string();
  });
  store_silent_ = !got;
  return got.value_or("");
}

std::string Peers::diagnose() {
  using Beats = std::map<int64_t, std::pair<int64_t, int64_t>>;  // rank -> (beats, step)
  auto sample = [store = store_, world = world_]() -> Beats {
    Beats s;
    for (int64_t r = 0; r < world; ++r) {
      if (!store->check({key("beat", r)})) {
        s[r] = {-1, -1};
        continue;
      }
      int64_t b = 0, st = 0;
      std::sscanf(text(store->get(key("beat", r))).c_str(), "%ld %ld", &b, &st);
      s[r] = {b, st};
    }
    return s;
  };
  const auto before = within<Beats>(5, sample);
  if (before) std::this_thread::sleep_for(std::chrono::milliseconds(3200));
  const auto after = before ? within<Beats>(5, sample) : std::nullopt;
  store_silent_ = !after;
  if (!after)
    return fmt::format(
        "the rendezvous store at {} (served by rank 0) does not answer: rank 0 has stopped or "
        "died",
        where_);
  std::vector<int64_t> silent;
  int64_t newest = 0;
  for (const auto& [r, bs] : *after) newest = std::max(newest, bs.second);
  std::string behind;
  for (const auto& [r, bs] : *after) {
    if (r != rank_ && bs.first == before->at(r).first) silent.push_back(r);
    if (bs.second >= 0 && bs.second < newest && bs.first != before->at(r).first)
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
}

Start start_run(const std::string& plan, const std::vector<std::string>& sets,
                const parallel::WorldInfo& world) {
  Start s;
  if (world.world == 1) {
    s.config = load_plan(plan, sets);
    watch_stop_signals(s.config.checkpoint.on_signal);
    s.lock = check_start(s.config, world);
    return s;
  }
  // Several ranks: a plan that fails to load on one of them is still reported to every rank.
  std::string error;
  bool loaded = false;
  try {
    s.config = load_plan(plan, sets);
    watch_stop_signals(s.config.checkpoint.on_signal);
    loaded = true;
  } catch (const plan::UserError& e) {
    error = e.what();
  }
  double timeout_s = s.config.parallel.timeout_s;
  if (!loaded) {  // the plan's default
    plan::Config defaults;
    for (const auto& f : plan::bind_fields(defaults))
      if (f.key == "parallel.timeout_s") timeout_s = std::get<double>(f.def);
  }
  s.store = parallel::rendezvous(world, timeout_s);
  s.peers = std::make_shared<Peers>(s.store, world.rank, world.world, timeout_s, world.master_addr,
                                    world.master_port);
  if (loaded) {
    try {
      s.lock = check_start(s.config, world);
    } catch (const plan::UserError& e) {
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
  } catch (const observe::Interrupted& e) {
    if (peers) peers->report_stop(e.what());
    throw;
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

}  // namespace tessel::run
