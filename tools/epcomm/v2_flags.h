// tools/epcomm/v2_flags.h — the flags of `epcomm bench|demo --api distribute-v2` that speak the normal-mode
// vocabulary: --quant (and its alias --quant-mode) and --num-nvl-bytes (and its alias --segment-bytes).
#pragma once

#include <string>
#include <vector>

#include "flags.h"

namespace epcomm::cli {

// Adds --quant M|NAME with the alias --quant-mode. `help` describes the modes this command accepts.
void add_v2_quant_flag(FlagParser& p, const std::string& default_mode, const std::string& help);

// The dispatch quant_mode --quant gave: the operator's number (0-4, docs/distribute-v2.md) or the name
// that normal mode's --quant uses for the same algorithm (docs/quant.md §3): none = 0, int8 = 2
// (int8_per_token_a3, int8 codes), mx_fp8_e4m3 = 4 (MX e4m3, FLOOR). Modes 1 and 3 have no name: normal mode
// has no static int8, and its pergroup_fp8_e4m3 is fp8_per_group128, not mode 3's fp8_per_group128_a3. A mode
// outside `accepted` is a UsageError that names the flag as given and `accepted_text`.
int v2_quant_mode(const FlagParser& p, const std::vector<int>& accepted, const std::string& accepted_text);

// Adds --num-nvl-bytes B with the alias --segment-bytes: the shared-memory segment per rank
// (GroupContextOptions::segment_bytes), K/M/G suffixes; 0 = 64 MiB.
void add_v2_segment_flag(FlagParser& p, const std::string& default_text);

}  // namespace epcomm::cli
