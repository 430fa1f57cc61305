// The avx512 instantiation of the CPU kernels (see kernels_impl.inc).
#define PDSERVE_ISA_NS avx512
#define PDSERVE_ISA_NAME "avx512"
#include "kernels/cpu/kernels_impl.inc"
