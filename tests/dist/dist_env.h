#pragma once

#include "parallel/comm.h"

namespace tessel::parallel {
/// The group every distributed test uses: all ranks (it is the mesh's tensor-parallel group).
Group& test_group();
}  // namespace tessel::parallel
