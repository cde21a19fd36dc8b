// quant/row_pending.cc — placeholder until the quantizers land: every quantizing mode is rejected.
#include "common/check.h"
#include "quant/row.h"

namespace epcomm::quant {
[[noreturn]] static void pending(QuantMode mode) {
  EPCOMM_THROW(InvalidUsage, "quant_mode ", quant_mode_name(mode), " is not supported yet");
}
size_t row_data_bytes(QuantMode mode, int64_t H) {
  if (mode == QuantMode::bf16) return static_cast<size_t>(H) * 2;
  pending(mode);
}
size_t row_scale_bytes(QuantMode mode, int64_t) {
  if (mode == QuantMode::bf16) return 0;
  pending(mode);
}
void check_hidden(QuantMode mode, int64_t) {
  if (mode != QuantMode::bf16) pending(mode);
}
void quantize_row(QuantMode mode, DType, const void*, int64_t, void*, void*) { pending(mode); }
void dequantize_row(QuantMode mode, const void*, const void*, int64_t, float*) { pending(mode); }
DType data_dtype(QuantMode mode) {
  if (mode == QuantMode::bf16) return DType::bf16;
  pending(mode);
}
DType scale_dtype(QuantMode mode) { pending(mode); }
}  // namespace epcomm::quant
