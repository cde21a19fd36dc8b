// tools/epcomm/flags.cc — the flag parser of the epcomm subcommands.
// Every rejection is a UsageError that names the flag, what it expects and what it got.
#include "flags.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace epcomm::cli {

std::string bad_value(const std::string& name, const std::string& expected, const std::string& actual) {
  return "--" + name + ": expected " + expected + ", got '" + actual + "'";
}

FlagParser::FlagParser(std::string command, std::string usage, std::string summary)
    : command_(std::move(command)), usage_(std::move(usage)), summary_(std::move(summary)) {}

void FlagParser::add(const std::string& name, const std::string& metavar, const std::string& default_text,
                     const std::string& help) {
  specs_.push_back({name, metavar, default_text, help, false});
}

void FlagParser::add_switch(const std::string& name, const std::string& help) {
  specs_.push_back({name, "", "", help, true});
}

void FlagParser::add_alias(const std::string& alias, const std::string& target) {
  const Spec* t = find(target);
  if (!t || !t->alias_of.empty()) throw std::logic_error("add_alias: no flag --" + target);
  specs_.push_back({alias, t->metavar, "", "alias of --" + target, t->is_switch, target});
}

std::string FlagParser::target_of(const std::string& name) const {
  const Spec* spec = find(name);
  return spec && !spec->alias_of.empty() ? spec->alias_of : name;
}

std::string FlagParser::spelled(const std::string& name) const {
  auto it = spelling_.find(target_of(name));
  return it != spelling_.end() ? it->second : name;
}

const FlagParser::Spec* FlagParser::find(const std::string& name) const {
  for (const Spec& s : specs_)
    if (s.name == name) return &s;
  return nullptr;
}

bool FlagParser::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return false;
    if (arg.rfind("--", 0) != 0 || arg.size() == 2)
      throw UsageError("unexpected argument '" + arg + "' (flags start with --; see '" + command_ +
                       " --help')");
    std::string name = arg.substr(2), value;
    bool inline_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      inline_value = true;
    }
    const Spec* spec = find(name);
    if (!spec) throw UsageError("unknown flag --" + name + " (see '" + command_ + " --help')");
    if (spec->is_switch) {
      if (inline_value) throw UsageError("--" + name + " takes no value, got '" + value + "'");
    } else if (!inline_value) {
      if (i + 1 >= argc)
        throw UsageError("--" + name + ": expected a value (" + spec->metavar + "), got none");
      value = argv[++i];
    }
    const std::string flag = spec->alias_of.empty() ? name : spec->alias_of;
    if (auto it = values_.find(flag); it != values_.end()) {
      const std::string& first = spelling_.at(flag);
      if (first == name) throw UsageError("--" + name + " given twice");
      if (it->second != value) {
        const std::string& alias = first == flag ? name : first;
        throw UsageError("--" + first + " '" + it->second + "' and --" + name + " '" + value +
                         "' disagree (--" + alias + " is an alias of --" + flag + "; give one of them)");
      }
      continue;  // the same value under both spellings
    }
    values_[flag] = value;
    spelling_[flag] = name;
  }
  return true;
}

std::string FlagParser::str(const std::string& name) const {
  if (auto it = values_.find(target_of(name)); it != values_.end()) return it->second;
  const Spec* spec = find(target_of(name));
  return spec ? spec->default_text : std::string();
}

static bool parse_int(const std::string& text, int64_t& out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || *end != '\0') return false;
  out = v;
  return true;
}

int64_t FlagParser::integer(const std::string& name, int64_t min, int64_t max) const {
  const std::string text = str(name);
  int64_t v = 0;
  std::string range = max == INT64_MAX
                          ? "an integer >= " + std::to_string(min)
                          : "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  if (!parse_int(text, v) || v < min || v > max) throw UsageError(bad_value(spelled(name), range, text));
  return v;
}

std::vector<int64_t> FlagParser::integer_list(const std::string& name, int64_t min, int64_t max) const {
  const std::string text = str(name);
  const std::string expected =
      "a comma-separated list of integers in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t v = 0;
    if (!parse_int(item, v) || v < min || v > max) throw UsageError(bad_value(spelled(name), expected, text));
    out.push_back(v);
  }
  if (out.empty() || text.back() == ',') throw UsageError(bad_value(spelled(name), expected, text));
  return out;
}

int64_t FlagParser::bytes(const std::string& name) const {
  std::string text = str(name);
  std::string digits = text;
  int shift = 0;
  if (!digits.empty()) {
    char c = digits.back();
    if (c == 'k' || c == 'K') shift = 10;
    if (c == 'm' || c == 'M') shift = 20;
    if (c == 'g' || c == 'G') shift = 30;
    if (shift) digits.pop_back();
  }
  int64_t v = 0;
  if (!parse_int(digits, v) || v < 0 || v > (INT64_MAX >> 31))
    throw UsageError(
        bad_value(spelled(name), "a byte count >= 0 with an optional K, M or G suffix (e.g. 64M)", text));
  return v << shift;
}

double FlagParser::seconds(const std::string& name) const {
  const std::string text = str(name);
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v))
    throw UsageError(bad_value(spelled(name), "a positive number of seconds", text));
  return v;
}

std::string FlagParser::choice(const std::string& name, const std::vector<std::string>& choices) const {
  const std::string text = str(name);
  std::string list;
  for (const auto& c : choices) {
    if (c == text) return text;
    list += (list.empty() ? "" : "|") + c;
  }
  throw UsageError(bad_value(spelled(name), "one of " + list, text));
}

std::string FlagParser::help() const {
  std::ostringstream os;
  os << "usage: " << usage_ << "\n\n" << summary_ << "\n\nflags:\n";
  for (const Spec& s : specs_) {
    std::string left = "  --" + s.name + (s.is_switch ? "" : " " + s.metavar);
    os << left;
    if (left.size() < 28)
      os << std::string(28 - left.size(), ' ');
    else
      os << "\n" << std::string(28, ' ');
    os << s.help;
    if (!s.default_text.empty()) os << " (default: " << s.default_text << ")";
    os << "\n";
  }
  os << "  --help                    this text\n";
  if (!epilog_.empty()) os << "\n" << epilog_;
  return os.str();
}

std::vector<int> parse_rank_counts(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 1024)
      throw UsageError(bad_value("ranks", "a comma-separated list of rank counts in [1, 1024]", s));
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw UsageError(bad_value("ranks", "a comma-separated list of rank counts", s));
  return out;
}

}  // namespace epcomm::cli
