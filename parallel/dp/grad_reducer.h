// Data parallelism (DDP): the flat fp32 gradient buffer is cut into buckets of about
// parallel.ddp.bucket_mb; on the final micro-batch of a step, a post-accumulate-grad hook on each
// parameter counts it in, and the moment a bucket is complete its sum over the dp×cp group starts
// asynchronously while backward goes on with earlier layers. Earlier micro-batches only
// accumulate. Under pipeline parallelism "final" is per model chunk (each chunk's last backward
// of the step), and buckets never straddle two chunks. The loss rule (sum over the global batch /
// global target tokens) makes the sum the exact gradient, so no averaging happens here.
#pragma once

#include <memory>
#include <vector>

#include "engine/optim.h"
#include "models/layers.h"
#include "parallel/mesh.h"

namespace tessel::parallel::dp {

struct Bucket {
  int64_t begin, end;  // range of the flat buffer
  int64_t params;      // parameters in it
  int64_t chunk;       // the pipeline chunk whose backward fills it
  int64_t ready = 0;   // counted in during the final micro-batch
  Work work;
};

class GradReducer {
 public:
  GradReducer(const Mesh& mesh, models::Decoder& model, FlatAdamW& opt, double bucket_mb);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  /// Before each backward of this rank's pipeline chunk `chunk` (0 without pipelining): whether
  /// it is that chunk's last backward of the step (the one that reduces).
  void begin_backward(int64_t chunk, bool final);
  /// After it: a micro-batch that is not reduced folds its bf16 gradients into fp32.
  void end_backward(int64_t chunk, bool final);
  /// After the step's last backward: waits for every bucket and returns the time spent waiting
  /// (the communication backward did not hide), in ms.
  double finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  void on_grad_ready(size_t bucket);

  const Mesh& mesh_;
  FlatAdamW& opt_;
  std::vector<torch::Tensor> hooked_;  // parameters carrying our hook (removed on destruction)
  std::vector<Bucket> buckets_;
  std::vector<std::pair<int64_t, int64_t>> chunk_range_;  // flat range of each chunk's slots
  std::vector<bool> final_;                               // per chunk, during its last backward
  bool reduce_ = false;                                   // dp×cp > 1
};

}  // namespace tessel::parallel::dp
