#include "base/dtype.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(DTypeTest, Bf16RoundTripIsExactForBf16Values) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Bf16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(F32ToBf16(f), h);
  }
}

TEST(DTypeTest, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between two BF16 values (1 and 1 + 2^-7): ties go even.
  EXPECT_EQ(F32ToBf16(1.0f + std::ldexp(1.0f, -8)), F32ToBf16(1.0f));
  EXPECT_EQ(F32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), F32ToBf16(1.0f + std::ldexp(1.0f, -6)));
  EXPECT_EQ(Bf16ToF32(F32ToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::nanf("")))));
}

TEST(DTypeTest, F16KnownValues) {
  EXPECT_EQ(F16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(F16ToF32(0xc000), -2.0f);
  EXPECT_EQ(F16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));  // Smallest subnormal.
  EXPECT_EQ(F16ToF32(0x03ff), std::ldexp(1023.0f, -24));  // Largest subnormal.
  EXPECT_EQ(F16ToF32(0x0400), std::ldexp(1.0f, -14));
  EXPECT_TRUE(std::isinf(F16ToF32(0x7c00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
  EXPECT_EQ(std::signbit(F16ToF32(0x8000)), true);
}

TEST(DTypeTest, F16AllValuesMatchFormula) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const int sign = (h >> 15) ? -1 : 1;
    const int exp = (h >> 10) & 0x1f;
    const int mant = h & 0x3ff;
    if (exp == 0x1f) continue;
    const double want = exp == 0 ? sign * std::ldexp(mant, -24)
                                 : sign * std::ldexp(1024 + mant, exp - 25);
    EXPECT_EQ(static_cast<double>(F16ToF32(static_cast<uint16_t>(h))), want) << h;
  }
}

TEST(DTypeTest, ParseNames) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  EXPECT_EQ(ParseDType("int4").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
