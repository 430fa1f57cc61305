// Peak-rate probes for the AVX-512 matrix instructions the kernels could be
// built on, so a benchmark can judge each candidate path against its own
// limit in the same run (see bench-engine). Each returns the FLOPs done by
// `iters` rounds of 16 independent chains on one thread, or 0 when the CPU
// lacks the instruction.
#ifndef PDSERVE_KERNELS_CPU_MATRIX_PROBES_H_
#define PDSERVE_KERNELS_CPU_MATRIX_PROBES_H_

#include <cstdint>

namespace pdserve::kernels::cpu {

// AVX512-BF16 VDPBF16PS: 16 lanes x 2 products x 2 FLOPs per instruction.
double Bf16DotPeakLoop(int64_t iters);
// AVX512-FP16 VFMADD on 32 half-precision lanes (2 FLOPs each).
double Fp16FmaPeakLoop(int64_t iters);

bool HasAvx512Bf16();
bool HasAvx512Fp16();

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_MATRIX_PROBES_H_
