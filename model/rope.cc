#include "model/rope.h"

#include <cmath>
#include <numbers>

namespace pdserve {

std::vector<double> RopeInverseFrequencies(const ModelConfig& config) {
  const int64_t half = config.head_dim / 2;
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i) {
    inv[i] = 1.0 / std::pow(config.rope_theta, static_cast<double>(2 * i) / config.head_dim);
  }
  if (config.rope_scaling.has_value()) {
    const Llama3RopeScaling& s = *config.rope_scaling;
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_len / s.low_freq_factor;
    const double high_wavelen = old_len / s.high_freq_factor;
    for (double& f : inv) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  return inv;
}

RopeTable::RopeTable(const ModelConfig& config) : inv_freq_(RopeInverseFrequencies(config)) {}

void RopeTable::EnsurePositions(int32_t n) {
  if (n <= num_positions_) return;
  int32_t target = num_positions_ == 0 ? 256 : num_positions_;
  while (target < n) target *= 2;
  const size_t half = inv_freq_.size();
  cos_.resize(static_cast<size_t>(target) * half);
  sin_.resize(static_cast<size_t>(target) * half);
  for (int32_t p = num_positions_; p < target; ++p) {
    for (size_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * inv_freq_[i];
      cos_[p * half + i] = static_cast<float>(std::cos(angle));
      sin_[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }
  num_positions_ = target;
}

}  // namespace pdserve
