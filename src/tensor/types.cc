// tensor/types.cc — names of the shared enums.
#include "epcomm/types.h"

#include "common/check.h"

namespace epcomm {

const char* receive_order_name(ReceiveOrder order) {
  return order == ReceiveOrder::expert_major ? "expert_major" : "rank_major";
}

const char* quant_mode_name(QuantMode mode) {
  switch (mode) {
    case QuantMode::bf16:
      return "bf16";
    case QuantMode::int8:
      return "int8";
    case QuantMode::pertoken_fp8_e4m3:
      return "pertoken_fp8_e4m3";
    case QuantMode::pergroup_fp8_e4m3:
      return "pergroup_fp8_e4m3";
    case QuantMode::mx_fp8_e4m3:
      return "mx_fp8_e4m3";
    case QuantMode::mx_fp8_e5m2:
      return "mx_fp8_e5m2";
    case QuantMode::mx_fp4_e2m1:
      return "mx_fp4_e2m1";
    case QuantMode::pergroup_fp8_e4m3_pow2:
      return "pergroup_fp8_e4m3_pow2";
    case QuantMode::pergroup_fp8_e4m3_ue8m0:
      return "pergroup_fp8_e4m3_ue8m0";
  }
  return "?";
}

ReceiveOrder parse_receive_order(const std::string& name) {
  if (name == "expert_major") return ReceiveOrder::expert_major;
  if (name == "rank_major") return ReceiveOrder::rank_major;
  EPCOMM_THROW(InvalidUsage, "receive_order: expected one of expert_major, rank_major, got '", name, "'");
}

QuantMode parse_quant_mode(const std::string& name) {
  for (QuantMode m :
       {QuantMode::bf16, QuantMode::int8, QuantMode::pertoken_fp8_e4m3, QuantMode::pergroup_fp8_e4m3,
        QuantMode::mx_fp8_e4m3, QuantMode::mx_fp8_e5m2, QuantMode::mx_fp4_e2m1,
        QuantMode::pergroup_fp8_e4m3_pow2, QuantMode::pergroup_fp8_e4m3_ue8m0})
    if (name == quant_mode_name(m)) return m;
  EPCOMM_THROW(InvalidUsage,
               "quant_mode: expected one of bf16, int8, pertoken_fp8_e4m3, pergroup_fp8_e4m3, mx_fp8_e4m3, "
               "mx_fp8_e5m2, mx_fp4_e2m1, pergroup_fp8_e4m3_pow2, pergroup_fp8_e4m3_ue8m0, got '",
               name, "'");
}

}  // namespace epcomm
