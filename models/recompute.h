// Activation checkpointing: run a piece of the model without keeping its activations, and run
// it again in backward to get them (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
// Cost"; the reentrant form of torch.utils.checkpoint). Only the piece's input is kept.
#pragma once

#include <torch/types.h>

#include <functional>

namespace tessel::models {

using Piece = std::function<torch::Tensor(const torch::Tensor&)>;

/// What a recomputed piece keeps per token between its forward and its backward, in units of its
/// input's width: its input.
constexpr double kPieceKeptPerInput = 1.0;
/// What a recomputed piece keeps in host memory to replay its random draws: the CPU generator's
/// state, as LibTorch serialises it (5,056 bytes in 2.11). Device memory when the run computes on
/// the CPU; on a GPU, host memory, not the device's.
double piece_rng_state_bytes();

/// fn(x), with autograd recording one node instead of fn's graph. In backward the node reruns fn
/// on x with gradients on and backpropagates through it: parameters fn uses get their gradients
/// (and their hooks fire) then. fn must be deterministic and issue the same collectives again
/// (every rank of a group recomputes the same piece at the same point of backward). Without grad
/// mode this is fn(x).
torch::Tensor recompute(Piece fn, const torch::Tensor& x);

/// Whether this thread is rerunning a piece in backward (the forward already ran once: what it
/// counts, it has counted).
bool recomputing();

}  // namespace tessel::models
