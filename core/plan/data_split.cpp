#include "core/plan/data_split.h"

#include <cmath>
#include <cstdlib>

namespace tessel::plan {
namespace {

// A share is written as digits with at most one decimal point ("969", "0.5", ".5", "3.").
// Longer than this it is a typo or an attack, not a share: refused before it is converted.
constexpr size_t kMaxShareChars = 32;

bool is_space(char c) { return c == ' ' || c == '\t'; }

// Reads text[begin, end) as one share into `out`; "" or what is wrong. One pass, no recursion.
std::string read_share(const std::string& text, size_t begin, size_t end, double& out) {
  while (begin < end && is_space(text[begin])) ++begin;
  while (end > begin && is_space(text[end - 1])) --end;
  const std::string item = text.substr(begin, end - begin);
  if (item.empty()) return "an empty share (two commas in a row, or one at an end)";
  if (item.size() > kMaxShareChars)
    return "a share of " + std::to_string(item.size()) + " characters (at most " +
           std::to_string(kMaxShareChars) + ")";
  int digits = 0, points = 0;
  for (char c : item) {
    if (c >= '0' && c <= '9')
      ++digits;
    else if (c == '.')
      ++points;
    else
      return "'" + item + "' is not a number";
  }
  if (digits == 0 || points > 1) return "'" + item + "' is not a number";
  out = std::strtod(item.c_str(), nullptr);  // at most 32 digits: finite, no exception
  return "";
}

}  // namespace

std::string parse_split(const std::string& text, std::array<double, 3>& shares) {
  shares = {1, 0, 0};
  if (text.empty()) return "";
  const std::string want =
      ": expected 1 to 3 non-negative numbers separated by commas (train, validation, test "
      "shares, e.g. 969,30,1)";
  std::array<double, 3> got{0, 0, 0};
  size_t n = 0, begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    if (n == 3) return "more than 3 shares" + want;
    const std::string bad =
        read_share(text, begin, comma == std::string::npos ? text.size() : comma, got[n++]);
    if (!bad.empty()) return bad + want;
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  if (!(got[0] + got[1] + got[2] > 0)) return "the shares sum to 0" + want;
  shares = got;
  return "";
}

}  // namespace tessel::plan
