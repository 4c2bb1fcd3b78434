// Host reads of tensor values: each one, on CUDA, makes the host wait until the device reaches
// it (a host synchronisation), which costs a pipeline its run-ahead and a step its overlap.
// Counted on every device, so that CPU tests see the reads a GPU would wait on:
// - LibTorch operators that read values on the host (item(), nonzero, masked_select, unique),
//   through a callback on every operator, installed only once counting is switched on;
// - Tessel's own copies to the host, which go through read_on_host();
// - copies between the host and a device that the host waits for (t.to(device) or copy_ without
//   non_blocking), which only a run on a device can make.
// engine/run/step_counters.h reports the count per step (memory.json host_reads_per_step).
// A lower bound: an operator that reads on the host inside another (boolean-mask indexing's
// nonzero, repeat_interleave without output_size, CUDA's grouped-matmul fallback) and a host copy
// outside read_on_host (Gloo's staging of CUDA tensors) are not counted, so Tessel's step code
// avoids those by construction and 0 means no read this counter can see.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace tessel::observe {

/// t copied to the host, counted as one host read.
torch::Tensor read_on_host(const torch::Tensor& t);

/// Host reads so far in this process (Tessel's own always; LibTorch operators' once
/// count_host_reads() was called).
int64_t host_reads();

/// Counts LibTorch's host-reading operators from now on (a callback on every operator: a cost
/// per operator, so only when asked: TESSEL_COUNT_HOST_READS=1, and tests). Once per process.
/// `trace` (TESSEL_COUNT_HOST_READS=trace): each read is also logged with the stack that made it.
void count_host_reads(bool trace = false);
bool counting_host_reads();

}  // namespace tessel::observe
