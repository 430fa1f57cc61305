#include "kernels/cpu/isa.h"

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::kernels::cpu {
namespace scalar {
extern const KernelTable kTable;
}
namespace avx2 {
extern const KernelTable kTable;
}
namespace avx512 {
extern const KernelTable kTable;
}

absl::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

absl::StatusOr<Isa> ParseIsa(absl::string_view name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ISA '", name, "' (expected scalar, avx2 or avx512)"));
}

bool IsaSupported(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
  }
  return false;
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (IsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

absl::StatusOr<Isa> SelectIsa() {
  if (const char* env = std::getenv("PDSERVE_ISA"); env != nullptr && *env != '\0') {
    absl::StatusOr<Isa> isa = ParseIsa(env);
    if (!isa.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("PDSERVE_ISA: ", isa.status().message()));
    }
    if (!IsaSupported(*isa)) {
      return absl::FailedPreconditionError(
          absl::StrCat("PDSERVE_ISA=", env, ": this CPU does not support it"));
    }
    return *isa;
  }
  return SupportedIsas().back();
}

const KernelTable& GetKernelTable(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return avx512::kTable;
    case Isa::kAvx2:
      return avx2::kTable;
    case Isa::kScalar:
      break;
  }
  return scalar::kTable;
}

}  // namespace pdserve::kernels::cpu
