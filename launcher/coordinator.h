// How the launchers of a job agree on failures and restarts. One node: in memory. Several nodes:
// a c10d TCPStore served by node 0's launcher.
#pragma once

#include <csignal>
#include <memory>
#include <optional>
#include <string>

namespace tessel::launcher {

class Coordinator {
 public:
  virtual ~Coordinator() = default;
  /// Records the first failure of a round (later ones are ignored); returns the recorded one.
  virtual std::string report_failure(int round, const std::string& what) = 0;
  /// The recorded failure of a round, if any node has reported one.
  virtual std::optional<std::string> failure(int round) = 0;
  /// This node's workers all exited 0 in this round; returns how many nodes have said so.
  virtual int report_done(int round) = 0;
  virtual int done_count(int round) = 0;
  /// Blocks until every node is ready to start `round` (after the previous round's teardown);
  /// throws naming the missing nodes after the rendezvous timeout, or Interrupted on a signal.
  virtual void barrier(int round) = 0;
  /// The last call: this node is done with the job. Node 0 serves the store, so it waits (up to
  /// timeout_s) until every node has said so before it goes away.
  virtual void leave(double timeout_s) = 0;
};

/// A signal arrived while waiting for the other nodes.
struct Interrupted {
  int signal;
};

/// Several nodes: node 0 serves the store at addr:port, the others connect to it. Every wait
/// (connecting, barriers) ends after timeout_s with an error naming the nodes that did not come,
/// and as soon as `*signal` turns non-zero (throws Interrupted).
std::unique_ptr<Coordinator> make_coordinator(int nnodes, int node_rank, const std::string& addr,
                                              int port, double timeout_s,
                                              const volatile std::sig_atomic_t* signal);

}  // namespace tessel::launcher
