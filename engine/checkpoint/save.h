// Saving a checkpoint, at once or in the background (checkpoint.async).
//
// A save has four parts: the folder prepared (rank 0 clears what an interrupted save left and
// makes step_<N>.tmp; every rank meets at a barrier), this rank's tensors chosen (what it writes
// of the weights, master copy and moments), its file and index fragment written, and the
// checkpoint published (rank 0: index.json from the fragments, config.yaml, the COMPLETE marker,
// the rename to step_<N>, `latest`, pruning). save_checkpoint (checkpoint.h) runs them in turn.
//
// AsyncSaver runs the first two at the step boundary and copies the chosen tensors to host memory
// (one arena per rank, sized exactly; on CUDA page-locked, the copies on a side stream that only
// what writes the copied state waits for, on the device: the optimizer step, see
// before_state_changes), then writes and publishes on a thread of its own while
// training goes on. Its ranks meet through the rendezvous store, never the training's process
// groups, whose collectives must stay in the same order on every rank: each writer reports its
// file written (or its error), rank 0's writer waits for every report before it publishes, and the
// others wait for its word. The files, checksums and marker are save_checkpoint's. At most one
// save is in flight: a second waits for the first, saying so. A process killed mid-write leaves a
// step_<N>.tmp without its marker, which is never read, and `latest` at the previous checkpoint.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/checkpoint/checkpoint.h"

namespace tessel::checkpoint {

struct SavePart;

class AsyncSaver {
 public:
  AsyncSaver(const plan::Config& c, const parallel::Mesh& mesh);
  ~AsyncSaver();  // abandons the save in flight unless it was waited for (a failing run)
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  /// Milliseconds a save held training: waiting for the save before it, copying; the bytes of
  /// host memory its copy takes.
  struct Held {
    double wait_ms = 0, copy_ms = 0;
    int64_t arena_bytes = 0;
  };
  /// Every rank at the same step: waits for the save in flight, then copies this rank's part of
  /// the checkpoint at `st` to host memory and starts writing it.
  Held save(models::Decoder& model, const optim::FlatAdamW& opt, const optim::LossScaler& scaler,
            const CheckpointState& st);
  /// Before anything writes the state a save copied (weights, master copy, moments, loss scale):
  /// the current stream waits on the device for the copies to host (CUDA; a no-op after the
  /// first call, and on the CPU, whose copies are done when save returns). A step's reads of the
  /// weights (forward, backward) run while the copies do.
  void before_state_changes();
  /// Waits for the save in flight to be published on every rank; rethrows its error. Returns its
  /// folder ("" when none was in flight).
  std::string wait();

 private:
  void write(std::shared_ptr<SavePart> part);
  void wait_keys(c10d::Store& store, const std::vector<std::string>& keys) const;
  std::atomic<bool> abandon_{false};
  std::atomic<bool> writing_{false};  // the writer thread has not finished yet (it may be joined)
  torch::Tensor arena_;               // host copies, kept for the next save (same shapes)
  bool arena_pinned_ = false;
  std::function<void()> device_wait_;  // the copies not yet waited for on the device
  const plan::Config& c_;
  const parallel::Mesh& mesh_;
  std::thread writer_;
  std::exception_ptr error_;
  std::string dir_;  // the save in flight's folder
  int64_t step_ = -1;
};

}  // namespace tessel::checkpoint
