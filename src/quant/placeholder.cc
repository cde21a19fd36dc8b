// quant/placeholder.cc — keeps epcomm_quant non-empty until the quantizers land.
namespace epcomm::quant {
int quant_placeholder() { return 0; }
}
