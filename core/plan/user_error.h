// The one exception type for a problem with the user's plan or input, shared by every layer.
#pragma once

#include <stdexcept>

namespace tessel::plan {

/// A problem with the user's plan or input. The message is complete (file, line, key, values);
/// main() prints it as is and exits non-zero.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace tessel::plan
