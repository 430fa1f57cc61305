// Rotary position embedding tables as Hugging Face applies them: inverse
// frequencies 1 / theta^(2i / head_dim), optionally rescaled by the "llama3"
// rule; the angle of position p is p * inv_freq[i] (absolute positions),
// computed in double and rounded once to F32.
//
// Thread safety: EnsurePositions mutates; callers serialise (the forward).
#ifndef PDSERVE_MODEL_ROPE_H_
#define PDSERVE_MODEL_ROPE_H_

#include <cstdint>
#include <vector>

#include "model/model_config.h"

namespace pdserve {

// The inverse frequencies [head_dim / 2] of `config` (llama3 scaling applied).
std::vector<double> RopeInverseFrequencies(const ModelConfig& config);

class RopeTable {
 public:
  explicit RopeTable(const ModelConfig& config);

  // Grows the tables to cover positions [0, n).
  void EnsurePositions(int32_t n);

  const float* cos() const { return cos_.data(); }  // [positions, head_dim / 2]
  const float* sin() const { return sin_.data(); }
  int32_t num_positions() const { return num_positions_; }

 private:
  std::vector<double> inv_freq_;
  std::vector<float> cos_, sin_;
  int32_t num_positions_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_MODEL_ROPE_H_
