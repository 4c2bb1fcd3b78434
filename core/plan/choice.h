// A plan key with a fixed set of values, held as an enum: `Choice<PipelineSchedule>` compares with
// `PipelineSchedule::kZbv`, never with a string, so a new value is found by the compiler at every
// use. Each enum's names are declared once (choice_names, core/plan/choices.h): the YAML reader,
// the errors, --help-config, docs/configuration.md and the resolved-plan dump all read them there.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace tessel::plan {

/// The field table's view of any Choice: its names and which one it holds.
class ChoiceBase {
 public:
  virtual ~ChoiceBase() = default;
  virtual const std::vector<std::string>& names() const = 0;
  virtual size_t index() const = 0;
  virtual void set_index(size_t i) = 0;
  const std::string& name() const { return names()[index()]; }
  /// False (and unchanged) when `n` is not one of names().
  bool set_name(const std::string& n) {
    const auto& all = names();
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i] == n) {
        set_index(i);
        return true;
      }
    return false;
  }
};

template <class E>
class Choice final : public ChoiceBase {
 public:
  Choice() = default;
  Choice(E v) : v_(v) {}  // NOLINT: a Choice is its enum
  Choice(const Choice&) = default;
  Choice& operator=(const Choice&) = default;
  operator E() const { return v_; }  // NOLINT
  const std::vector<std::string>& names() const override { return choice_names(E{}); }
  size_t index() const override { return static_cast<size_t>(v_); }
  void set_index(size_t i) override { v_ = static_cast<E>(i); }

 private:
  E v_{};
};

}  // namespace tessel::plan
