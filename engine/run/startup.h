// What the ranks of a job tell each other through the rendezvous store, so that a failure on one
// rank stops every rank at once and names the rank that caused it:
//  - start-up: each rank loads the plan and runs its own checks of it against its node (device,
//    threads, the layout vs the node's processes and GPUs, the run-folder lock on rank 0), then
//    posts "ready" or its error. Every rank waits for all of them, at most parallel.timeout_s
//    (naming the ranks that never arrived), and every rank stops if any failed, naming it.
//  - heartbeat: a thread beats once a second (a count and the current step) and watches for a
//    failure posted by another rank; it then ends this rank, naming that rank, instead of leaving
//    it to wait for a collective timeout.
//  - diagnosis: when a collective fails or times out, which ranks stopped beating (stopped with
//    SIGSTOP, hung in the kernel, dead, or their host unreachable) or are behind.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/plan/config.h"
#include "parallel/world.h"

namespace tessel::run {

/// Exclusive locks held while the process lives, so that two trainers never write one run: on
/// <run.output_dir>/.lock (flock; the file names its holder, host, pid and start time, for the
/// error the second trainer prints), and on the checkpoint folder itself, whether it is the
/// default <run.output_dir>/checkpoints or checkpoint.dir (two runs writing one checkpoint
/// folder, whichever way each names it, would overwrite each other's step folders, and a resume
/// would load the other run's weights); that folder is also checked writable. The kernel drops
/// the locks when the process dies, however it dies.
class RunLock {
 public:
  RunLock() = default;
  /// Throws UserError naming the key, the folder and (for the run folder) the process holding it,
  /// or why a folder cannot be written.
  RunLock(const std::string& output_dir, const std::string& checkpoint_dir);
  RunLock(RunLock&& o) noexcept : fds_(std::move(o.fds_)) { o.fds_.clear(); }
  RunLock& operator=(RunLock&& o) noexcept;
  ~RunLock();

 private:
  void lock(const std::string& key, const std::string& folder);         // .lock, holder noted
  void lock_folder(const std::string& key, const std::string& folder);  // flock of the folder
  std::vector<int> fds_;
};

/// The file model.init_from opens (io::weights_entry): the file itself, or inside a folder
/// model.safetensors.index.json (Hugging Face's shards) or model.safetensors (a save_pretrained
/// or `tessel-train export` folder). UserError naming the key otherwise.
std::string init_weights_file(const std::string& init_from);

class Peers {
 public:
  /// `store`: the rendezvous store (rank 0 serves it at host:port).
  Peers(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world, double timeout_s,
        const std::string& host, int port);
  ~Peers();
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;

  /// Posts this rank's start-up result ("" = ready) and waits for every rank's; throws UserError
  /// on every rank when any failed (naming it) or did not arrive within the timeout.
  void agree_on_start(const std::string& my_error);
  /// Starts the heartbeat thread (after the start-up agreement). It talks to the store over a
  /// connection of its own with a 5 s timeout: a stopped rank 0 never holds it (or the exit that
  /// joins it) for parallel.timeout_s.
  void start_heartbeat();
  void set_step(int64_t step) { beat_->step.store(step, std::memory_order_relaxed); }
  /// During start-up: stops this rank (observe::Interrupted) when it saw a stop signal, posting
  /// it so that the others stop alike, or when another rank posted one.
  void stop_if_signalled(const std::string& doing);
  /// Posts this rank's stop on a signal during start-up (`what`: its message): the others'
  /// heartbeats end them with the stop's exit code.
  void report_stop(const std::string& what);
  /// Records this rank's failure so that the others stop at once (the first failure wins).
  void report_failure(const std::string& what);
  /// The failure another rank posted ("rank R failed: ..."), or "".
  std::string failure();
  /// After a failed or timed-out collective: the ranks that stopped beating or are behind, as a
  /// sentence ("" when every rank looks alive). Takes about three seconds (it samples the beats).
  std::string diagnose();

 private:
  // What the heartbeat thread uses, shared with it: a thread blocked on a stopped rank 0's store
  // can be left behind when this rank fails, without touching a destroyed Peers.
  struct Beat {
    c10::intrusive_ptr<c10d::Store> store;  // a connection of its own (5 s timeout), the thread's
    int64_t rank = 0;
    std::atomic<int64_t> step{0};
    std::atomic<bool> failed{false};  // this rank reported a failure itself
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
  };
  static void beat_loop(const std::shared_ptr<Beat>& b, const std::string& host, int port);
  void post_end(const std::string& key, const std::string& text);
  c10::intrusive_ptr<c10d::Store> store_;
  std::string host_;
  int port_;
  int64_t rank_, world_;
  double timeout_s_;
  std::string where_;  // host:port of the store
  std::shared_ptr<Beat> beat_ = std::make_shared<Beat>();
  bool store_silent_ = false;  // a failure-path call found the store not answering: skip it now
  std::thread thread_;
};

/// A started run: its plan, and with several ranks the rendezvous store and the peers watch.
struct Start {
  plan::Config config;
  c10::intrusive_ptr<c10d::Store> store;  // null for one process
  std::shared_ptr<Peers> peers;           // null for one process
  RunLock lock;                           // held by rank 0
};

/// Loads the plan and runs this rank's checks; with several ranks, rendezvous first and agree
/// with every rank (a plan that fails to load on one rank stops all of them too).
Start start_run(const std::string& plan, const std::vector<std::string>& sets,
                const parallel::WorldInfo& world);

/// The message a run ends with after `error`: a failed collective gets the diagnosis appended;
/// the failure is posted for the other ranks. Rethrows with the same category (UserError or not).
[[noreturn]] void fail_run(Peers* peers, std::exception_ptr error);

}  // namespace tessel::run
