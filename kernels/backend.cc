// The host-memory defaults of Backend (what the CPU backend uses).
#include "kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::kernels {
namespace {

class HostEmbeddingTable final : public EmbeddingTable {
 public:
  HostEmbeddingTable(int64_t rows, int64_t dim, DType dtype) : rows_(rows), dim_(dim), dtype_(dtype) {}
  int64_t rows() const override { return rows_; }
  int64_t dim() const override { return dim_; }
  DType dtype() const override { return dtype_; }
  size_t bytes() const override {
    return bf16.size() * 2 + f32.size() * 4 + i8.size() + scale.size() * 4;
  }

  std::vector<uint16_t> bf16;  // [rows, dim] for kBF16
  std::vector<float> f32;      // [rows, dim] for kF32
  std::vector<int8_t> i8;      // [rows, dim] for kI8
  std::vector<float> scale;    // [rows] for kI8

 private:
  int64_t rows_, dim_;
  DType dtype_;
};

}  // namespace

absl::StatusOr<void*> Backend::Allocate(size_t bytes) {
  const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  return p;
}

void Backend::Free(void* p) { std::free(p); }

void Backend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}

void Backend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}

void Backend::Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, int64_t rows) {
  if (width == 0) return;
  if (dst_pitch == width && src_pitch == width) {
    std::memcpy(dst, src, width * rows);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
  }
}

namespace {

class HostUploader final : public BackendUploader {
 public:
  absl::Status Upload(void* dst, const void* host_src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, host_src, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<BackendUploader>> Backend::NewUploader() {
  return std::make_unique<HostUploader>();
}

void Backend::Zero(void* dst, size_t bytes) {
  if (bytes > 0) std::memset(dst, 0, bytes);
}

void Backend::Add(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

absl::StatusOr<std::unique_ptr<EmbeddingTable>> Backend::PackEmbedding(const MatrixPart& part, int64_t dim,
                                                                       DType storage) {
  if (part.dtype == DType::kI8) return absl::InvalidArgumentError("an int8 embedding needs its scales");
  if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
    return absl::InvalidArgumentError(absl::StrCat("no embedding storage ", DTypeName(storage)));
  }
  auto t = std::make_unique<HostEmbeddingTable>(part.rows, dim, storage);
  const int64_t stride = part.stride == 0 ? dim : part.stride;
  const size_t esize = DTypeSize(part.dtype);
  std::vector<float> row(dim);
  if (storage == DType::kBF16) t->bf16.resize(part.rows * dim);
  if (storage == DType::kF32) t->f32.resize(part.rows * dim);
  if (storage == DType::kI8) {
    t->i8.resize(part.rows * dim);
    t->scale.resize(part.rows);
  }
  for (int64_t r = 0; r < part.rows; ++r) {
    const void* src = static_cast<const char*>(part.data) + r * stride * esize;
    if (storage == DType::kBF16 && part.dtype == DType::kBF16) {
      std::memcpy(t->bf16.data() + r * dim, src, dim * 2);
      continue;
    }
    ConvertToF32(part.dtype, src, dim, row.data());
    if (storage == DType::kBF16) {
      for (int64_t d = 0; d < dim; ++d) t->bf16[r * dim + d] = F32ToBf16(row[d]);
    } else if (storage == DType::kF32) {
      std::memcpy(t->f32.data() + r * dim, row.data(), dim * 4);
    } else {
      // One scale per token row, like the per-output-channel weight scales.
      float amax = 0;
      for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::abs(row[d]));
      t->scale[r] = amax / 127.0f;
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      for (int64_t d = 0; d < dim; ++d) {
        t->i8[r * dim + d] = static_cast<int8_t>(std::clamp(std::nearbyint(row[d] * inv), -127.0f, 127.0f));
      }
    }
  }
  return t;
}

void Backend::Embed(const EmbeddingTable& table, const int32_t* ids, int64_t n, float* out) {
  const auto& t = static_cast<const HostEmbeddingTable&>(table);
  const int64_t D = t.dim();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    float* o = out + i * D;
    if (id < 0 || id >= t.rows()) {
      std::fill(o, o + D, 0.0f);
    } else if (t.dtype() == DType::kBF16) {
      for (int64_t d = 0; d < D; ++d) o[d] = Bf16ToF32(t.bf16[id * D + d]);
    } else if (t.dtype() == DType::kI8) {
      for (int64_t d = 0; d < D; ++d) o[d] = t.i8[id * D + d] * t.scale[id];
    } else {
      std::memcpy(o, t.f32.data() + id * D, D * sizeof(float));
    }
  }
}

namespace {

// A stateless uniform draw in [-bound, bound] for element i (splitmix64).
float HashUniform(uint64_t seed, uint64_t i, float bound) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
  return (2.0f * u - 1.0f) * bound;
}

std::vector<float> RandomRows(int64_t n, int64_t k, float bound, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n * k));
  for (size_t i = 0; i < v.size(); ++i) v[i] = HashUniform(seed, i, bound);
  return v;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LinearWeight>> Backend::RandomLinear(int64_t n, int64_t k, DType storage, float bound,
                                                                    uint64_t seed) {
  const std::vector<float> rows = RandomRows(n, k, bound, seed);
  const MatrixPart part{DType::kF32, rows.data(), n, 0};
  return PackLinear({&part, 1}, k, storage);
}

absl::StatusOr<std::unique_ptr<EmbeddingTable>> Backend::RandomEmbedding(int64_t rows, int64_t dim, DType storage,
                                                                         float bound, uint64_t seed) {
  const std::vector<float> v = RandomRows(rows, dim, bound, seed);
  return PackEmbedding(MatrixPart{DType::kF32, v.data(), rows, 0}, dim, storage);
}

}  // namespace pdserve::kernels
