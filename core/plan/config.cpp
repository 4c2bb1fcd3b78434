#include "core/plan/config.h"
#include "core/plan/blend_field.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "core/plan/rules.h"

namespace tessel::plan {
namespace {

// A bound as a user reads it: 16777216, not 1.67772e+07 (bounds are integers or plain decimals).
std::string bound_text(double v) {
  if (std::abs(v) < 9e15 && v == std::floor(v)) return std::to_string(static_cast<int64_t>(v));
  std::string t = fmt_double(v);
  return t;
}

std::string quote_if_needed(const std::string& s) {
  YAML::Emitter e;
  e << s;
  return e.c_str();
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<std::string> all_keys() {
  Config c;
  std::vector<std::string> keys;
  for (const auto& f : bind_fields(c)) keys.push_back(f.key);
  return keys;
}

// A key's values as --help-config and the errors write them: a|b|c.
std::string choices_text(const std::vector<std::string>& names) {
  std::string all;
  for (const auto& ch : names) all += (all.empty() ? "" : "|") + ch;
  return all;
}

// Why `n` is not one of `c`'s names: the same words as a string field's choices.
std::string not_a_choice(const ChoiceBase& c, const YAML::Node& n) {
  return "must be one of " + choices_text(c.names()) + ", got '" +
         (n.IsScalar() ? n.Scalar() : std::string(n.IsMap() ? "a mapping" : "a list")) + "'";
}

// Parses one YAML node into a field, or returns what was expected.
std::string assign(Field& f, const YAML::Node& n) {
  auto scalar = [&](auto& out, const char* what) -> std::string {
    if (!n.IsScalar()) return std::string("expected ") + what;
    try {
      out = n.as<std::remove_reference_t<decltype(out)>>();
    } catch (const YAML::Exception&) {
      return std::string("expected ") + what + ", got '" + n.Scalar() + "'";
    }
    return "";
  };
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          if (f.auto_zero && n.IsScalar() && n.Scalar() == "auto") {
            *p = 0;
            return "";
          }
          return scalar(*p, f.auto_zero ? "an integer or auto" : "an integer");
        } else if constexpr (std::is_same_v<T, double>) {
          return scalar(*p, "a number");
        } else if constexpr (std::is_same_v<T, bool>) {
          return scalar(*p, "true or false");
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!n.IsScalar()) return "expected a string";
          *p = n.Scalar();
          return "";
        } else if constexpr (std::is_same_v<T, ChoiceBase>) {
          return n.IsScalar() && p->set_name(n.Scalar()) ? "" : not_a_choice(*p, n);
        } else if constexpr (std::is_same_v<T, std::vector<BlendSource>>) {
          return assign_blend(*p, n);
        } else {
          using E = typename T::value_type;
          const char* what = std::is_same_v<E, double> ? "a list of numbers" : "a list of strings";
          T out;
          if (n.IsScalar() && std::is_same_v<E, std::string>) {
            out.push_back(n.as<E>());
          } else if (n.IsSequence()) {
            for (const auto& item : n) {
              E v;
              std::string err = item.IsScalar() ? "" : std::string("expected ") + what;
              if (err.empty()) {
                try {
                  v = item.as<E>();
                } catch (const YAML::Exception&) {
                  err = std::string("expected ") + what + ", got '" + item.Scalar() + "'";
                }
              }
              if (!err.empty()) return err;
              out.push_back(v);
            }
          } else if (!n.IsNull()) {
            return std::string("expected ") + what;
          }
          *p = out;
          return "";
        }
      },
      f.ref);
}

// The field's declared default.
void set_default(Field& f) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, ChoiceBase>)
          p->set_name(std::get<std::string>(f.def));
        else
          *p = std::get<T>(f.def);
      },
      f.ref);
}

// Range and choice checks of one field after assignment.
std::string check_field(const Field& f) {
  auto out_of_range = [&](double v) {
    std::ostringstream s;
    s << "must be ";
    if (std::isfinite(f.min) && std::isfinite(f.max))
      s << "in [" << bound_text(f.min) << ", " << bound_text(f.max) << "]";
    else if (std::isfinite(f.min))
      s << ">= " << bound_text(f.min);
    else
      s << "<= " << bound_text(f.max);
    s << ", got " << f.value_text();
    if (v > f.max && !f.max_why.empty()) s << " (" << f.max_why << ")";
    return (v < f.min || v > f.max) ? s.str() : std::string();
  };
  if (auto* p = std::get_if<int64_t*>(&f.ref)) return out_of_range(static_cast<double>(**p));
  if (auto* p = std::get_if<double*>(&f.ref)) {
    if (!std::isfinite(**p)) return "must be finite, got " + f.value_text();
    return out_of_range(**p);
  }
  auto check_choice = [&](const std::string& v, const char* what) -> std::string {
    if (f.choices.empty() || std::find(f.choices.begin(), f.choices.end(), v) != f.choices.end())
      return "";
    return std::string(what) + "must be one of " + choices_text(f.choices) + ", got '" + v + "'";
  };
  if (auto* p = std::get_if<std::vector<BlendSource>*>(&f.ref)) return check_blend(**p);
  if (auto* p = std::get_if<std::string*>(&f.ref)) return check_choice(**p, "");
  if (auto* p = std::get_if<std::vector<std::string>*>(&f.ref))
    for (const auto& v : **p)
      if (auto e = check_choice(v, "each item "); !e.empty()) return e;
  return "";
}

class Loader {
 public:
  explicit Loader(std::string source) : fields_(bind_fields(c_)) {
    c_.source = std::move(source);
    for (auto& f : fields_) {
      set_default(f);
      by_key_[f.key] = &f;
    }
  }

  void read_yaml(const YAML::Node& root) {
    if (root.IsNull()) return;
    if (!root.IsMap()) fail(line_of(root), "the plan must be a mapping of sections");
    walk(root, "");
  }

  void apply_override(const std::string& kv) {
    auto eq = kv.find('=');
    std::string where = "--set " + kv;
    if (eq == std::string::npos || eq == 0) throw UserError(where + ": expected section.key=value");
    std::string key = kv.substr(0, eq);
    auto it = by_key_.find(key);
    if (it == by_key_.end())
      throw UserError(where + ": unknown key '" + key + "'; did you mean '" + nearest_key(key) +
                      "'?");
    YAML::Node n;
    try {
      n = YAML::Load(kv.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      throw UserError(where + ": cannot parse the value: " + e.msg);
    }
    // A string key's value that YAML reads as nothing (",,", a bare "-") is the text as written,
    // so the key's own rules judge it; "", "null" and "~" are the empty string.
    const std::string raw = kv.substr(eq + 1);
    if (n.IsNull() && std::holds_alternative<std::string*>(it->second->ref))
      n = YAML::Node(raw == "null" || raw == "~" || raw == "Null" || raw == "NULL" ? "" : raw);
    set(*it->second, n, where);
    overridden_.push_back(key);
  }

  Config finish();
  // The plan as read so far, its `given` filled (for a Completion).
  const Config& as_read() {
    c_.given = lines_;
    for (const auto& k : overridden_) c_.given[k] = 0;
    return c_;
  }
  // A completion's setting: applied as --set is, but not counted as given by the plan.
  void complete(const std::string& kv) {
    apply_override(kv);
    overridden_.pop_back();
  }

 private:
  static int line_of(const YAML::Node& n) { return n.Mark().line + 1; }
  [[noreturn]] void fail(int line, const std::string& msg) const {
    throw UserError(c_.source + ":" + std::to_string(line) + ": " + msg);
  }

  bool is_section(const std::string& prefix) const {
    for (const auto& [k, f] : by_key_)
      if (k.rfind(prefix + ".", 0) == 0) return true;
    return false;
  }

  void walk(const YAML::Node& map, const std::string& prefix) {
    std::set<std::string> seen;
    for (const auto& kv : map) {
      std::string name = kv.first.Scalar();
      std::string key = prefix.empty() ? name : prefix + "." + name;
      int line = line_of(kv.first);
      if (!seen.insert(name).second) fail(line, "duplicate key '" + key + "'");
      auto it = by_key_.find(key);
      if (it != by_key_.end()) {
        // The plan gave the other name of this setting already: read it before set() copies.
        const auto* other = alias_of(key);
        const bool both = other && lines_.count(other);
        const std::string earlier = both ? by_key_.at(other)->value_text() : "";
        set(*it->second, kv.second, c_.source + ":" + std::to_string(line));
        if (both && it->second->value_text() != earlier)
          fail(line, key + " (" + it->second->value_text() + ") and " + other + " (" + earlier +
                         ", line " + std::to_string(lines_.at(other)) +
                         ") name the same setting and disagree");
        lines_[key] = line;
      } else if (is_section(key)) {
        if (kv.second.IsNull()) continue;
        if (!kv.second.IsMap()) fail(line, "'" + key + "' is a section: expected a mapping");
        walk(kv.second, key);
      } else {
        fail(line, "unknown key '" + key + "'; did you mean '" + nearest_key(key) + "'?");
      }
    }
  }

  // training.recompute and training.activation_checkpointing (the name earlier releases documented)
  // are one setting: either name sets both, so a --set of one overrides a plan that used the other.
  static const char* alias_of(const std::string& key) {
    if (key == "training.recompute") return "training.activation_checkpointing";
    if (key == "training.activation_checkpointing") return "training.recompute";
    return nullptr;
  }

  void set(Field& f, const YAML::Node& n, const std::string& where) {
    std::string err = assign(f, n);
    if (err.empty()) err = check_field(f);
    if (!err.empty()) throw UserError(where + ": " + f.key + ": " + err);
    if (const auto* other = alias_of(f.key))
      std::get<ChoiceBase*>(by_key_.at(other)->ref)
          ->set_index(std::get<ChoiceBase*>(f.ref)->index());
  }

  Config c_;
  std::vector<Field> fields_;
  std::map<std::string, Field*> by_key_;
  std::map<std::string, int> lines_;
  std::vector<std::string> overridden_;  // keys given by --set
};

Config Loader::finish() {
  check_rules(c_, lines_);
  c_.given = lines_;
  for (const auto& k : overridden_) c_.given[k] = 0;
  return c_;
}

Config load(const std::string& source, const std::function<YAML::Node()>& parse,
            const std::vector<std::string>& overrides, const Completion& complete = nullptr) {
  Loader loader(source);
  YAML::Node root;
  try {
    root = parse();
  } catch (const YAML::BadFile&) {
    throw UserError(source + ": cannot read the plan file");
  } catch (const YAML::Exception& e) {
    throw UserError(source + ":" + std::to_string(e.mark.line + 1) + ": invalid YAML: " + e.msg);
  }
  loader.read_yaml(root);
  for (const auto& o : overrides) loader.apply_override(o);
  if (complete)
    for (const auto& kv : complete(loader.as_read())) loader.complete(kv);
  return loader.finish();
}

}  // namespace

std::string fmt_double(double v) {
  // The shortest of %.15g..%.17g that reads back to the same double: 0.9, not 0.90000000000000002.
  char buf[32];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string t = buf;
  // Keep a visible decimal point so the dumped YAML re-reads as a float.
  if (t.find_first_of(".eEn") == std::string::npos) t += ".0";
  return t;
}

std::string Config::checkpoint_dir() const {
  if (!checkpoint.dir.empty()) return checkpoint.dir;
  return run.output_dir + (run.output_dir.empty() || run.output_dir.back() == '/' ? "" : "/") +
         "checkpoints";
}

std::string Field::type_name() const {
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) return auto_zero ? "int|auto" : "int";
        if constexpr (std::is_same_v<T, double>) return "float";
        if constexpr (std::is_same_v<T, bool>) return "bool";
        if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, ChoiceBase>) {
          return choices.empty() ? "string" : choices_text(choices);
        }
        if constexpr (std::is_same_v<T, std::vector<double>>) return "list of float";
        if constexpr (std::is_same_v<T, std::vector<BlendSource>>) return "list of {weight, path}";
        return "list of string";
      },
      ref);
}

std::string Field::value_text() const {
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          return (auto_zero && *p == 0) ? "auto" : std::to_string(*p);
        } else if constexpr (std::is_same_v<T, double>) {
          return fmt_double(*p);
        } else if constexpr (std::is_same_v<T, bool>) {
          return *p ? "true" : "false";
        } else if constexpr (std::is_same_v<T, std::string>) {
          return quote_if_needed(*p);
        } else if constexpr (std::is_same_v<T, ChoiceBase>) {
          return quote_if_needed(p->name());
        } else if constexpr (std::is_same_v<T, std::vector<double>>) {
          std::string s;
          for (double v : *p) s += (s.empty() ? "" : ", ") + fmt_double(v);
          return "[" + s + "]";
        } else if constexpr (std::is_same_v<T, std::vector<BlendSource>>) {
          return blend_text(*p);
        } else {
          std::string s;
          for (const auto& v : *p) s += (s.empty() ? "" : ", ") + quote_if_needed(v);
          return "[" + s + "]";
        }
      },
      ref);
}

std::string nearest_key(const std::string& key) {
  std::string best;
  size_t best_d = SIZE_MAX;
  std::string leaf = key.substr(key.rfind('.') + 1);
  for (const auto& k : all_keys()) {
    // Compare whole keys, and leaves too, so that a right name in the wrong section is found.
    const std::string k_leaf = k.substr(k.rfind('.') + 1);
    size_t d = std::min(edit_distance(key, k), edit_distance(leaf, k_leaf) + 1);
    if (!leaf.empty() && k_leaf.rfind(leaf, 0) == 0) d = std::min<size_t>(d, 1);  // an abbreviation
    if (d < best_d) best_d = d, best = k;
  }
  return best;
}

namespace {

// The one document of a plan: a second (after `---`) would be silently ignored by YAML::Load.
YAML::Node one_document(const std::string& source, std::vector<YAML::Node> docs) {
  if (docs.size() > 1)
    throw UserError(
        fmt::format("{}: holds {} YAML documents (separated by ---); a plan is one "
                    "document: merge them, or keep one",
                    source, docs.size()));
  return docs.empty() ? YAML::Node() : docs.front();
}

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError(path + ": a folder, not a plan file (name the .yaml file inside it)");
  return load(
      path, [&] { return one_document(path, YAML::LoadAllFromFile(path)); }, overrides);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   const Completion& complete) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError(path + ": a folder, not a plan file (name the .yaml file inside it)");
  return load(
      path, [&] { return one_document(path, YAML::LoadAllFromFile(path)); }, overrides, complete);
}

Config load_config_text(const std::string& yaml, const std::string& source,
                        const std::vector<std::string>& overrides) {
  return load(
      source, [&] { return one_document(source, YAML::LoadAll(yaml)); }, overrides);
}

std::string dump_config(const Config& c_in) {
  Config c = c_in;
  std::ostringstream out;
  std::string section;
  std::vector<std::string> open;  // currently open nested sections
  for (const auto& f : bind_fields(c)) {
    std::vector<std::string> parts;
    std::stringstream ss(f.key);
    for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
    size_t common = 0;
    while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common])
      ++common;
    open.resize(common);
    for (size_t i = common; i + 1 < parts.size(); ++i) {
      out << std::string(2 * i, ' ') << parts[i] << ":\n";
      open.push_back(parts[i]);
    }
    out << std::string(2 * (parts.size() - 1), ' ') << parts.back() << ": " << f.value_text()
        << "\n";
  }
  return out.str();
}

std::string config_reference() {
  Config c;
  auto fields = bind_fields(c);
  for (auto& f : fields) set_default(f);
  std::ostringstream out;
  out << "# Configuration reference\n\n"
      << "Generated by `tessel-train --help-config` from the field declarations in\n"
      << "core/plan/config_fields.cpp (`make docs`). Every key can be set in the YAML plan or "
         "with\n"
      << "`--set section.key=value`; the resolved plan is written to "
         "`<run.output_dir>/config.yaml`.\n";
  std::string section;
  for (const auto& f : fields) {
    std::string s = f.key.substr(0, f.key.find('.'));
    if (s != section) {
      section = s;
      out << "\n## " << section << "\n\n| key | type | default | meaning |\n|---|---|---|---|\n";
    }
    std::string range;
    if (std::isfinite(f.min) || std::isfinite(f.max)) {
      std::ostringstream r;
      r << " Range: " << (std::isfinite(f.min) ? "[" : "(");
      if (std::isfinite(f.min))
        r << bound_text(f.min);
      else
        r << "-inf";
      r << ", ";
      if (std::isfinite(f.max))
        r << bound_text(f.max) << "]";
      else
        r << "inf)";
      range = r.str() + (f.max_why.empty() ? "" : " (" + f.max_why + ")") + ".";
    }
    std::string type = f.type_name();
    for (size_t i = type.find('|'); i != std::string::npos; i = type.find('|', i + 2))
      type.replace(i, 1, "\\|");
    out << "| `" << f.key << "` | " << type << " | `" << f.value_text() << "` | " << f.help << range
        << " |\n";
  }
  return out.str();
}

bool pairs_microbatches(const Config& c, int64_t world, bool cuda, int64_t threads) {
  const auto& t = c.training;
  // Recomputation's rerun backpropagates into the weights' .grad itself (models/recompute.cpp),
  // which the second lane must not touch; MoE's balance state and ZeRO's hooks are per step.
  return t.microbatch_pairs && !cuda && world == 1 && c.parallel.zero == 0 &&
         c.model.moe.experts == 0 && t.recompute == Recompute::kNone && t.micro_batch > 0 &&
         t.global_batch / t.micro_batch >= 2 && threads >= 2;
}

std::pair<int64_t, int64_t> profile_steps(const Config& c, int64_t first_step) {
  const auto& spec = c.logging.profile;
  const int64_t steps = c.training.steps;
  if (spec.empty()) return {0, -1};
  auto bad = [&](const std::string& why) {
    return UserError("logging.profile ('" + spec + "') " + why);
  };
  int64_t a = 0, b = 0;
  size_t used = 0;
  try {
    if (const auto dash = spec.find('-'); dash != std::string::npos && dash > 0) {
      a = std::stoll(spec.substr(0, dash), &used);
      if (used != dash) throw std::invalid_argument("");
      b = std::stoll(spec.substr(dash + 1), &used);
      if (used != spec.size() - dash - 1) throw std::invalid_argument("");
    } else {
      const int64_t n = std::stoll(spec, &used);
      if (used != spec.size() || n < 1) throw std::invalid_argument("");
      const int64_t left = steps - first_step + 1;  // this run's steps
      if (n > left)
        throw bad("asks for " + std::to_string(n) + " steps; this run has " + std::to_string(left) +
                  " (steps " + std::to_string(first_step) + " to " + std::to_string(steps) +
                  ", training.steps)");
      a = first_step + std::clamp<int64_t>(left - n, 0, 3);
      b = a + n - 1;
    }
  } catch (const std::logic_error&) {
    throw bad("must be a step count N (>= 1) or a range A-B of steps, e.g. 5 or 10-14");
  }
  if (a < 1 || b < a || b > steps)
    throw bad("names steps " + std::to_string(a) + " to " + std::to_string(b) +
              ": they must lie in 1.." + std::to_string(steps) +
              " (training.steps), first <= last");
  return {a, b};
}

}  // namespace tessel::plan
