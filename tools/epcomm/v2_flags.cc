// tools/epcomm/v2_flags.cc — --quant and --num-nvl-bytes of the distribute-v2 commands (v2_flags.h).
#include "v2_flags.h"

#include <algorithm>

namespace epcomm::cli {
namespace {

struct NamedMode {
  const char* name;
  int mode;
};
// Only where the operator mode runs the very algorithm the normal-mode name runs (docs/quant.md §3).
constexpr NamedMode kNamedModes[] = {{"none", 0}, {"int8", 2}, {"mx_fp8_e4m3", 4}};

}  // namespace

void add_v2_quant_flag(FlagParser& p, const std::string& default_mode, const std::string& help) {
  p.add("quant", "M|NAME", default_mode, help);
  p.add_alias("quant-mode", "quant");
}

void add_v2_segment_flag(FlagParser& p, const std::string& default_text) {
  p.add("num-nvl-bytes", "B", default_text,
        "shared-memory segment per rank (GroupContextOptions::segment_bytes), K/M/G suffixes; 0 = 64 MiB");
  p.add_alias("segment-bytes", "num-nvl-bytes");
}

int v2_quant_mode(const FlagParser& p, const std::vector<int>& accepted, const std::string& accepted_text) {
  const std::string text = p.str("quant");
  std::string names;
  int mode = -1;
  for (const NamedMode& n : kNamedModes) {
    if (std::find(accepted.begin(), accepted.end(), n.mode) != accepted.end())
      names += std::string(names.empty() ? "" : "|") + n.name;
    if (text == n.name) mode = n.mode;
  }
  if (text.size() == 1 && text[0] >= '0' && text[0] <= '4') mode = text[0] - '0';
  if (std::find(accepted.begin(), accepted.end(), mode) != accepted.end()) return mode;
  std::string expected = accepted_text + ", or " + names;
  if (text == "pergroup_fp8_e4m3" && std::find(accepted.begin(), accepted.end(), 3) != accepted.end())
    expected +=
        " (mode 3 is per-group fp8 too, but fp8_per_group128_a3, not normal mode's fp8_per_group128: "
        "give --quant 3; docs/quant.md)";
  throw UsageError(bad_value(p.spelled("quant"), expected, text));
}

}  // namespace epcomm::cli
