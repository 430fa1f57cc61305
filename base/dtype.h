// Element types of checkpoints, weights and the KV cache, and the exact
// conversions between them.
//
// Thread safety: everything here is a pure function.
#ifndef PDSERVE_BASE_DTYPE_H_
#define PDSERVE_BASE_DTYPE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace pdserve {

// kI8 is symmetric int8 with scales held elsewhere (per output channel for
// weights, per (position, KV head) for the KV cache); checkpoints never hold it.
enum class DType : uint8_t { kF32, kF16, kBF16, kI8 };

// Bytes per element.
constexpr size_t DTypeSize(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kI8 ? 1 : 2;
}

// Lower-case name used on command lines and in logs: "f32", "f16", "bf16",
// "int8".
absl::string_view DTypeName(DType t);

// Parses "f32" | "f16" | "bf16" | "int8" (the command-line spelling).
absl::StatusOr<DType> ParseDType(absl::string_view name);

// BF16 -> F32 is exact (the BF16 bits are the high half of the F32).
inline float Bf16ToF32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// F32 -> BF16 with round-to-nearest-even; NaN stays NaN (quiet).
inline uint16_t F32ToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 -> F32, exact (subnormals, infinities and NaN included).
float F16ToF32(uint16_t h);

// Converts `n` elements of type `src_type` at `src` to F32 at `dst`.
// REQUIRES: src_type is not kI8 (it has no scale here).
void ConvertToF32(DType src_type, const void* src, size_t n, float* dst);

}  // namespace pdserve

#endif  // PDSERVE_BASE_DTYPE_H_
