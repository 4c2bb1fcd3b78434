#include "core/plan/blend_field.h"

#include <cmath>

#include "core/plan/rules.h"

namespace tessel::plan {

std::string assign_blend(std::vector<BlendSource>& out, const YAML::Node& n) {
  const std::string expected = "expected a list of {weight: <number>, path: <files>}";
  std::vector<BlendSource> blend;
  if (n.IsNull()) {
    out = blend;
    return "";
  }
  if (!n.IsSequence()) return expected;
  for (const auto& item : n) {
    if (!item.IsMap()) return expected + ", got an item that is not a mapping";
    BlendSource b;
    bool weight = false, path = false;
    for (const auto& kv : item) {
      const std::string k = kv.first.Scalar();
      if (k == "weight") {
        try {
          b.weight = kv.second.as<double>();
        } catch (const YAML::Exception&) {
          return "item " + std::to_string(blend.size() + 1) + ": weight must be a number";
        }
        weight = true;
      } else if (k == "path") {
        if (kv.second.IsScalar()) {
          b.path = {kv.second.Scalar()};
        } else if (kv.second.IsSequence()) {
          for (const auto& p : kv.second) {
            if (!p.IsScalar())
              return "item " + std::to_string(blend.size() + 1) + ": path must be strings";
            b.path.push_back(p.Scalar());
          }
        } else {
          return "item " + std::to_string(blend.size() + 1) + ": path must be a string or a list";
        }
        path = true;
      } else {
        return "item " + std::to_string(blend.size() + 1) + ": unknown key '" + k +
               "' (an item has weight and path)";
      }
    }
    if (!weight || !path)
      return "item " + std::to_string(blend.size() + 1) + ": needs both weight and path";
    blend.push_back(b);
  }
  out = blend;
  return "";
}

std::string check_blend(const std::vector<BlendSource>& blend) {
  for (size_t i = 0; i < blend.size(); ++i) {
    const auto& b = blend[i];
    if (!std::isfinite(b.weight) || b.weight <= 0)
      return "item " + std::to_string(i + 1) + ": weight must be a finite number > 0, got " +
             fmt_double(b.weight);
    if (b.path.empty()) return "item " + std::to_string(i + 1) + ": path names no files";
  }
  // Each finite, and their sum too: 1e308 + 1e308 is inf, and every share would read as 0.
  double sum = 0;
  for (const auto& b : blend) sum += b.weight;
  if (!std::isfinite(sum))
    return "the weights sum to " + fmt_double(sum) +
           " (past the largest number): give weights of their proportions, e.g. 1 and 3";
  return "";
}

std::string blend_text(const std::vector<BlendSource>& blend) {
  auto quoted = [](const std::string& v) {
    YAML::Emitter e;
    e << v;
    return std::string(e.c_str());
  };
  std::string s;
  for (const auto& b : blend) {
    std::string paths;
    for (const auto& v : b.path) paths += (paths.empty() ? "" : ", ") + quoted(v);
    s +=
        (s.empty() ? "" : ", ") + ("{weight: " + fmt_double(b.weight) + ", path: [" + paths + "]}");
  }
  return "[" + s + "]";
}

}  // namespace tessel::plan
