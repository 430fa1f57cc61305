// Readable names for parameterised tests over CPU kernel paths.
#ifndef PDSERVE_TESTS_SUPPORT_ISA_PRINTER_H_
#define PDSERVE_TESTS_SUPPORT_ISA_PRINTER_H_

#include <ostream>

#include "kernels/cpu/isa.h"

namespace pdserve::kernels::cpu {
inline void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }
}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_TESTS_SUPPORT_ISA_PRINTER_H_
