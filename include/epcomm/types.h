// epcomm/types.h — small enums shared by every API family: receive order and quantization mode.
// Names match the Python strings ("expert_major", "mx_fp8_e4m3", ...).
#pragma once

#include <string>

namespace epcomm {

enum class ReceiveOrder { expert_major, rank_major };
enum class QuantMode {
  bf16,
  int8,
  pertoken_fp8_e4m3,
  pergroup_fp8_e4m3,
  mx_fp8_e4m3,
  mx_fp8_e5m2,
  mx_fp4_e2m1,
  // fp8_per_group128 with DeepEP's round_scale: power-of-two f32 scales (pow2_scale, docs/quant.md).
  pergroup_fp8_e4m3_pow2,
  // The same codes with one ue8m0 byte per 128-group instead of the f32 scale (DeepEP use_ue8m0).
  pergroup_fp8_e4m3_ue8m0
};

const char* receive_order_name(ReceiveOrder order);
const char* quant_mode_name(QuantMode mode);
ReceiveOrder parse_receive_order(const std::string& name);  // throws InvalidUsage listing the accepted names
QuantMode parse_quant_mode(const std::string& name);

}  // namespace epcomm
