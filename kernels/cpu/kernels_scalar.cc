// The scalar instantiation of the CPU kernels (see kernels_impl.inc).
#define PDSERVE_ISA_NS scalar
#define PDSERVE_ISA_NAME "scalar"
#include "kernels/cpu/kernels_impl.inc"
