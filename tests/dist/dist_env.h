#pragma once

#include "parallel/comm.h"

namespace tessel::parallel {
/// The group every distributed test uses: all ranks (it is the mesh's tensor-parallel group).
Group& test_group();
/// A context-parallel group of all ranks split for hybrid attention: all-to-all over pairs of
/// consecutive ranks, ring across the pairs.
Group& test_hybrid_group();
}  // namespace tessel::parallel
