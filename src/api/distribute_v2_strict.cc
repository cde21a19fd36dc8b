// api/distribute_v2_strict.cc — the optional per-product hardware limits of spec/distribute-v2.md §9.
#include "api/distribute_v2_args.h"
#include "common/check.h"

namespace epcomm::moe::detail {

void check_strict_dispatch(const OpOptions& o, const DispatchV2Args&, const engine::v2::Layout&,
                           const Routing&, int64_t) {
  if (o.strict_hardware_limits.empty()) return;
}

void check_strict_combine(const OpOptions& o, const CombineV2Args&, const engine::v2::Layout&, const Routing&,
                          int64_t, DType, bool) {
  if (o.strict_hardware_limits.empty()) return;
}

}  // namespace epcomm::moe::detail
