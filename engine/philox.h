// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC'11): a counter-based generator, so the random draw for any position
// of any request is a pure function of (key, counter) — the same in every
// process, on every machine, and (with the same arithmetic) on the GPU.
#ifndef PDSERVE_ENGINE_PHILOX_H_
#define PDSERVE_ENGINE_PHILOX_H_

#include <array>
#include <cstdint>

namespace pdserve {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// Ten rounds of Philox4x32 on `counter` under `key`.
PhiloxCounter Philox4x32_10(PhiloxCounter counter, PhiloxKey key);

// The uniform draw in [0, 1) for sampling position `position` of a request
// with `seed`: key = (seed low 32 bits, seed high 32 bits), counter =
// (position low, position high, 0, 0); uniform = (first output word >> 8)
// * 2^-24 (its top 24 bits, exactly representable in F32).
float PhiloxUniform(uint64_t seed, uint64_t position);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_PHILOX_H_
