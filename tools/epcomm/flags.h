// tools/epcomm/flags.h — command-line flags of the epcomm subcommands: a small parser with per-command help,
// and value checks whose messages name the flag, the expected and the actual value (exit status 2).
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace epcomm::cli {

// Exit statuses of every subcommand.
constexpr int kExitOk = 0;
constexpr int kExitFail = 1;   // a check failed, or a runtime error (timeout, peer failure, ...)
constexpr int kExitUsage = 2;  // a bad flag or value, or an argument the library rejected

// A bad command line. main prints "<command>: <what>" and exits with kExitUsage.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Flags are `--name value` or `--name=value`; switches are `--name`. `--help`/`-h` is always accepted.
// An alias is a second spelling of a flag: it shares the flag's value, and every accessor answers the same
// for either name. Not thread-safe; one parser per command invocation.
class FlagParser {
 public:
  FlagParser(std::string command, std::string usage, std::string summary);

  void add(const std::string& name, const std::string& metavar, const std::string& default_text,
           const std::string& help);
  void add_switch(const std::string& name, const std::string& help);
  // `--alias` is another spelling of the flag or switch `target` (already added); help lists it as
  // "alias of --target". Giving both with different values is a UsageError naming both.
  void add_alias(const std::string& alias, const std::string& target);
  void set_epilog(std::string epilog) { epilog_ = std::move(epilog); }

  // Throws UsageError for an unknown flag, a missing value or a positional argument. Returns false when
  // --help was given (the caller prints help() and exits 0).
  bool parse(int argc, char** argv);

  // Every accessor takes the flag's name or an alias of it.
  bool given(const std::string& name) const { return values_.count(target_of(name)) != 0; }
  bool on(const std::string& name) const { return given(name); }  // for switches
  // The value given, else the default text.
  std::string str(const std::string& name) const;
  // An integer within [min, max]; otherwise a UsageError naming the flag, the range and the value.
  int64_t integer(const std::string& name, int64_t min, int64_t max) const;
  // A comma-separated list of integers, each within [min, max] (e.g. 256,1024,4096); at least one.
  std::vector<int64_t> integer_list(const std::string& name, int64_t min, int64_t max) const;
  // A byte count: an integer with an optional K, M or G suffix (powers of 1024), e.g. 64M.
  int64_t bytes(const std::string& name) const;
  // A positive number of seconds.
  double seconds(const std::string& name) const;
  // One of `choices`; otherwise a UsageError listing them.
  std::string choice(const std::string& name, const std::vector<std::string>& choices) const;

  // The spelling the command line used for the flag (the alias when the alias was given), else `name`:
  // what an error message should name.
  std::string spelled(const std::string& name) const;

  const std::string& command() const { return command_; }
  std::string help() const;

 private:
  struct Spec {
    std::string name, metavar, default_text, help;
    bool is_switch = false;
    std::string alias_of;  // non-empty: this spec is an alias of that flag
  };
  const Spec* find(const std::string& name) const;
  std::string target_of(const std::string& name) const;  // an alias's flag, else name itself

  std::string command_, usage_, summary_, epilog_;
  std::vector<Spec> specs_;
  std::map<std::string, std::string> values_;    // by flag name (aliases resolved)
  std::map<std::string, std::string> spelling_;  // by flag name: the name or alias the command line used
};

// Formats "--name: expected <expected>, got '<actual>'".
std::string bad_value(const std::string& name, const std::string& expected, const std::string& actual);

// The benches' --ranks: a comma-separated list of rank counts in [1, 1024]; UsageError naming --ranks.
std::vector<int> parse_rank_counts(const std::string& s);

}  // namespace epcomm::cli
