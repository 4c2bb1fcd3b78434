// Data parallelism (DDP): the flat fp32 gradient buffer is cut into buckets of about
// parallel.ddp.bucket_mb; on the final micro-batch of a step, a post-accumulate-grad hook on each
// parameter counts it in, and the moment a bucket is complete its sum over the dp×cp group starts
// asynchronously while backward goes on with earlier layers. Earlier micro-batches only
// accumulate. The loss rule (sum over the global batch / global target tokens) makes the sum the
// exact gradient, so no averaging happens here.
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
  int64_t ready = 0;   // counted in during the final micro-batch
  Work work;
};

class GradReducer {
 public:
  GradReducer(const Mesh& mesh, models::Decoder& model, FlatAdamW& opt, double bucket_mb);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  /// Before each backward: whether it is the step's last micro-batch (the one that reduces).
  void begin_microbatch(bool final);
  /// After each backward. On the final one, waits for every bucket and returns the time spent
  /// waiting (the communication backward did not hide), in ms; else 0.
  double end_microbatch();

  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  void on_grad_ready(size_t bucket);

  const Mesh& mesh_;
  FlatAdamW& opt_;
  std::vector<torch::Tensor> hooked_;  // parameters carrying our hook (removed on destruction)
  std::vector<Bucket> buckets_;
  bool final_ = false;
  bool reduce_ = false;  // dp×cp > 1
};

}  // namespace tessel::parallel::dp
