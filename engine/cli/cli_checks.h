// Command-line checks that say in words what is allowed (CLI11's own print "Value 0 not in range
// 0.000000 to 1.79e308") and refuse what the numeric ones let through: nan, inf, numbers past
// the type's range. CLI11 prefixes the option's name to the message.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

namespace tessel::cli {

/// A whole number of at least `min`, within int64.
inline CLI::Validator whole_at_least(long long min) {
  const std::string allowed = "a whole number >= " + std::to_string(min);
  return CLI::Validator(
      [min, allowed](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0') return "'" + s + "' is not " + allowed;
        if (errno == ERANGE) return "'" + s + "' is too large (allowed: " + allowed + ")";
        if (v < min) return "'" + s + "' is too small (allowed: " + allowed + ")";
        return "";
      },
      "INT>=" + std::to_string(min));
}

/// A finite number >= 0 (no nan, no inf).
inline CLI::Validator finite_non_negative() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !std::isfinite(v) || v < 0)
          return "'" + s + "' is not allowed (allowed: a finite number >= 0)";
        return "";
      },
      "NUMBER>=0");
}

}  // namespace tessel::cli

/// CLI11_PARSE, but a bad command line exits 2, as every other input error does (CLI11's own codes
/// are 100-120); --help and --version still exit 0.
#define TESSEL_CLI_PARSE(app, argc, argv) \
  try {                                   \
    (app).parse((argc), (argv));          \
  } catch (const CLI::ParseError& e) {    \
    return (app).exit(e) == 0 ? 0 : 2;    \
  }
