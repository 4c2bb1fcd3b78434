#include "core/plan/data_split.h"

#include <cmath>
#include <regex>

namespace tessel::plan {

std::string parse_split(const std::string& text, std::array<double, 3>& shares) {
  shares = {1, 0, 0};
  if (text.empty()) return "";
  static const std::regex number(R"(\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*)");
  const std::string want =
      "expected 1 to 3 non-negative numbers separated by commas (train, validation, test "
      "shares, e.g. 969,30,1)";
  std::array<double, 3> got{0, 0, 0};
  size_t n = 0, begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string item =
        text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    std::smatch m;
    if (!std::regex_match(item, m, number)) return "'" + item + "' is not a number: " + want;
    if (n == 3) return "more than 3 shares: " + want;
    got[n++] = std::stod(m[1].str());
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  if (!std::isfinite(got[0] + got[1] + got[2]) || got[0] + got[1] + got[2] <= 0)
    return "the shares sum to 0: " + want;
  shares = got;
  return "";
}

}  // namespace tessel::plan
