// How the launchers of a job agree on failures and restarts. One node: in memory. Several nodes:
// a c10d TCPStore served by node 0's launcher.
#pragma once

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
  /// Blocks until every node is ready to start `round` (after the previous round's teardown).
  virtual void barrier(int round) = 0;
  /// The last call: this node is done with the job. Node 0 serves the store, so it waits (up to
  /// timeout_s) until every node has said so before it goes away.
  virtual void leave(double timeout_s) = 0;
};

std::unique_ptr<Coordinator> make_coordinator(int nnodes, int node_rank, const std::string& addr,
                                              int port, double timeout_s);

}  // namespace tessel::launcher
