// Run-time choice of the CPU kernels' instruction-set path.
//
// The best path the CPU supports (from CPUID) is used unless the environment
// variable PDSERVE_ISA (or SetIsaOverride, e.g. from a --isa flag) names one:
// "scalar", "avx2" or "avx512". Nothing in the build uses -march=native.
#ifndef PDSERVE_KERNELS_CPU_ISA_H_
#define PDSERVE_KERNELS_CPU_ISA_H_

#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/kernel_args.h"

namespace pdserve::kernels::cpu {

enum class Isa { kScalar, kAvx2, kAvx512 };

absl::string_view IsaName(Isa isa);
absl::StatusOr<Isa> ParseIsa(absl::string_view name);

// Whether this CPU can run `isa` (AVX-512 needs F, BW, VL and DQ; AVX2 needs FMA).
bool IsaSupported(Isa isa);

// Every path this CPU supports, slowest first.
std::vector<Isa> SupportedIsas();

// The path to use: PDSERVE_ISA when set (an error if unknown or unsupported),
// else the best supported one.
absl::StatusOr<Isa> SelectIsa();

const KernelTable& GetKernelTable(Isa isa);

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_ISA_H_
