// The avx2 instantiation of the CPU kernels (see kernels_impl.inc).
#define PDSERVE_ISA_NS avx2
#define PDSERVE_ISA_NAME "avx2"
#include "kernels/cpu/kernels_impl.inc"
