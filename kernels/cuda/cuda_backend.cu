// The CUDA backend (cuda_backend.h).
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace pdserve::kernels::cuda {
namespace {

absl::Status CublasError(const char* what, cublasStatus_t s) {
  return absl::InternalError(
      absl::StrCat(what, ": cuBLAS error ", static_cast<int>(s), " (", cublasGetStatusString(s), ")"));
}

constexpr int kWarp = 32;
// Attention: head_dim up to kMaxHeadDim, each lane holding kMaxHeadDim / 32
// output elements.
constexpr int kMaxHeadDim = 256;
constexpr int kAttnWarps = 4;
// Decode rows at or below this many use the fused int8 GEMV.
constexpr int kI8GemvMaxRows = 8;
// Prefill over int8 weights dequantises this many output rows at a time.
constexpr int64_t kI8DequantRows = 4096;

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Round to nearest even, like F32ToBf16 (NaN kept quiet).
__device__ __forceinline__ uint16_t ToBf16Bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float FromBf16Bits(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }

__device__ __forceinline__ int8_t QuantizeOne(float x, float inv) {
  const float v = rintf(x * inv);
  return static_cast<int8_t>(fminf(fmaxf(v, -127.0f), 127.0f));
}

// --- Elementwise and row kernels.

__global__ void F32ToBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = ToBf16Bits(x[i]);
  }
}

__global__ void AddKernel(float* y, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void AddBiasKernel(float* y, const float* bias, int64_t m, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < m * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += bias[i % n];
  }
}

// One block per row.
__global__ void RmsNormKernel(const float* x, const float* w, int64_t d, float eps, float* y) {
  const float* xr = x + blockIdx.x * d;
  float* yr = y + blockIdx.x * d;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
  __shared__ float part[32];
  ss = WarpSum(ss);
  if (threadIdx.x % kWarp == 0) part[threadIdx.x / kWarp] = ss;
  __syncthreads();
  if (threadIdx.x < kWarp) {
    float v = threadIdx.x < blockDim.x / kWarp ? part[threadIdx.x] : 0.0f;
    v = WarpSum(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float inv = 1.0f / sqrtf(part[0] / static_cast<float>(d) + eps);
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

// One thread per (row, head, pair).
__global__ void RopeKernel(float* x, int64_t rows, int32_t heads, int32_t head_dim, const int32_t* positions,
                           const float* cos, const float* sin) {
  const int32_t half = head_dim / 2;
  const int64_t total = rows * heads * half;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t i = static_cast<int32_t>(t % half);
    const int64_t rh = t / half;
    const int64_t r = rh / heads;
    const int64_t p = positions[r];
    float* v = x + rh * head_dim;
    const float c = cos[p * half + i], s = sin[p * half + i];
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

__global__ void SiluMulKernel(const float* gate_up, int64_t m, int64_t f, float* out) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < m * f;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / f, j = t % f;
    const float g = gate_up[r * 2 * f + j];
    const float u = gate_up[r * 2 * f + f + j];
    out[t] = g / (1.0f + expf(-g)) * u;
  }
}

// One block per row; ids < 0 or >= rows give zeros.
__global__ void EmbedKernel(const void* table, DType dtype, const float* scales, int64_t rows, int64_t dim,
                            const int32_t* ids, float* out) {
  const int64_t id = ids[blockIdx.x];
  float* o = out + blockIdx.x * dim;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float v = 0;
    if (id >= 0 && id < rows) {
      if (dtype == DType::kBF16) {
        v = FromBf16Bits(static_cast<const uint16_t*>(table)[id * dim + d]);
      } else if (dtype == DType::kI8) {
        v = static_cast<const int8_t*>(table)[id * dim + d] * scales[id];
      } else {
        v = static_cast<const float*>(table)[id * dim + d];
      }
    }
    o[d] = v;
  }
}

// --- Weights.

// F32 rows -> the storage format, one row per block (int8: the CPU's
// QuantizeI8 per output row).
__global__ void PackRowsKernel(const float* src, int64_t k, DType storage, void* dst, float* scales) {
  const int64_t r = blockIdx.x;
  const float* x = src + r * k;
  if (storage == DType::kF32) {
    for (int64_t i = threadIdx.x; i < k; i += blockDim.x) static_cast<float*>(dst)[r * k + i] = x[i];
    return;
  }
  if (storage == DType::kBF16) {
    for (int64_t i = threadIdx.x; i < k; i += blockDim.x) static_cast<uint16_t*>(dst)[r * k + i] = ToBf16Bits(x[i]);
    return;
  }
  float amax = 0;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) amax = fmaxf(amax, fabsf(x[i]));
  __shared__ float part[32];
  amax = WarpMax(amax);
  if (threadIdx.x % kWarp == 0) part[threadIdx.x / kWarp] = amax;
  __syncthreads();
  if (threadIdx.x < kWarp) {
    float v = threadIdx.x < blockDim.x / kWarp ? part[threadIdx.x] : 0.0f;
    v = WarpMax(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float a = part[0];
  const float inv = a > 0.0f ? 127.0f / a : 0.0f;
  if (threadIdx.x == 0) scales[r] = a / 127.0f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) static_cast<int8_t*>(dst)[r * k + i] = QuantizeOne(x[i], inv);
}

// A stateless uniform draw in [-bound, bound] for element i (splitmix64).
__device__ __forceinline__ float HashUniform(uint64_t seed, uint64_t i, float bound) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return (2.0f * u - 1.0f) * bound;
}

__global__ void RandomRowsKernel(int64_t k, float bound, uint64_t seed, float* out) {
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) out[r * k + i] = HashUniform(seed, r * k + i, bound);
}

// Reads every float4 once; the sum goes to `sink` only if it is an
// impossible value, so the reads cannot be optimised away.
__global__ void ReadKernel(const float4* p, size_t n, float* sink) {
  float acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float4 v = p[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 1234.5f) *sink = acc;
}

__global__ void FillBf16Kernel(uint16_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = ToBf16Bits(HashUniform(seed, i, 1.0f));
  }
}

__global__ void DequantizeI8Kernel(const int8_t* w, const float* scales, int64_t n, int64_t k, uint16_t* out) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * k;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[t] = ToBf16Bits(w[t] * scales[t / k]);
  }
}

// y[r, j] (=|+=) scale[j] * sum_k w[j, k] x[r, k] for r < m <= 8: one warp
// per output j, the weight row read once for every row.
__global__ void GemvI8Kernel(const int8_t* w, const float* scales, int64_t n, int64_t k, const float* x, int m,
                             float beta, float* y) {
  const int64_t j = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (j >= n) return;
  float acc[kI8GemvMaxRows] = {};
  const int8_t* wr = w + j * k;
  for (int64_t i = lane; i < k; i += kWarp) {
    const float wv = wr[i];
    for (int r = 0; r < kI8GemvMaxRows; ++r) {
      if (r < m) acc[r] += wv * x[r * k + i];
    }
  }
  for (int r = 0; r < kI8GemvMaxRows; ++r) {
    if (r >= m) break;
    const float s = WarpSum(acc[r]);
    if (lane == 0) {
      float* out = y + r * n + j;
      *out = (beta != 0.0f ? *out : 0.0f) + s * scales[j];
    }
  }
}

// --- KV cache.

// One warp per (row, KV head): the CPU backend's layout and encodings.
__global__ void WriteKvKernel(KvLayerView kv, int32_t num_kv_heads, int32_t head_dim, const float* k,
                              const float* v, int64_t rows, const int32_t* blocks, const int32_t* slots) {
  const int64_t item = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (item >= rows * num_kv_heads) return;
  const int64_t r = item / num_kv_heads;
  const int32_t h = static_cast<int32_t>(item % num_kv_heads);
  const int64_t head = blocks[r] * kv.block_stride + h * kv.head_stride;
  const int64_t k_off = head + slots[r];
  const int64_t k_step = kv.block_size;
  const int64_t v_off = head + kv.v_offset + static_cast<int64_t>(slots[r]) * head_dim;
  const float* ks = k + item * head_dim;
  const float* vs = v + item * head_dim;
  if (kv.dtype == DType::kF32) {
    float* base = static_cast<float*>(kv.base);
    for (int32_t i = lane; i < head_dim; i += kWarp) {
      base[k_off + i * k_step] = ks[i];
      base[v_off + i] = vs[i];
    }
  } else if (kv.dtype == DType::kBF16) {
    uint16_t* base = static_cast<uint16_t*>(kv.base);
    for (int32_t i = lane; i < head_dim; i += kWarp) {
      base[k_off + i * k_step] = ToBf16Bits(ks[i]);
      base[v_off + i] = ToBf16Bits(vs[i]);
    }
  } else {
    int8_t* base = static_cast<int8_t*>(kv.base);
    float* scales = reinterpret_cast<float*>(base + blocks[r] * kv.block_stride + kv.scale_offset);
    const int64_t si = static_cast<int64_t>(h) * kv.block_size + slots[r];
    float ka = 0, va = 0;
    for (int32_t i = lane; i < head_dim; i += kWarp) {
      ka = fmaxf(ka, fabsf(ks[i]));
      va = fmaxf(va, fabsf(vs[i]));
    }
    ka = WarpMax(ka);
    va = WarpMax(va);
    const float kinv = ka > 0.0f ? 127.0f / ka : 0.0f;
    const float vinv = va > 0.0f ? 127.0f / va : 0.0f;
    for (int32_t i = lane; i < head_dim; i += kWarp) {
      base[k_off + i * k_step] = QuantizeOne(ks[i], kinv);
      base[v_off + i] = QuantizeOne(vs[i], vinv);
    }
    if (lane == 0) {
      scales[si] = ka / 127.0f;
      scales[si + static_cast<int64_t>(num_kv_heads) * kv.block_size] = va / 127.0f;
    }
  }
}

// Per attended row: where its query and output are, the last position it
// attends (its own), and where its sequence's block table starts in the
// concatenated tables.
struct AttnRow {
  int32_t q_row;
  int32_t last_pos;
  int32_t table_start;
  int32_t pad;
};

template <typename T>
__device__ __forceinline__ float LoadKv(const T* p, int64_t i);
template <>
__device__ __forceinline__ float LoadKv<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float LoadKv<uint16_t>(const uint16_t* p, int64_t i) {
  return FromBf16Bits(p[i]);
}
template <>
__device__ __forceinline__ float LoadKv<int8_t>(const int8_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// Grid (rows, heads, splits), kAttnWarps warps a block. Split s covers
// positions [s * chunk, (s + 1) * chunk) of the row's [0, last_pos]; each
// warp takes 32-position tiles of it in turn: lane j scores position
// tile + j (K is stored [dim][slot], so the lanes' reads of one dimension
// are consecutive), then every lane accumulates its output dimensions over
// the tile's positions (V is [slot][dim]). Online softmax throughout. With
// one split the row's output is written normalised; with several, each
// split's (max, sum, unnormalised output) goes to `partial` for the merge.
template <typename T>
__global__ void AttentionKernel(const float* q, float* out, const AttnRow* rows, const int32_t* tables,
                                KvLayerView kv, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                                float scale, int32_t chunk, float* partial) {
  const AttnRow row = rows[blockIdx.x];
  const int32_t h = blockIdx.y;
  const int32_t split = blockIdx.z, splits = gridDim.z;
  const int32_t kvh = h / (num_heads / num_kv_heads);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t bs = kv.block_size;
  const T* base = static_cast<const T*>(kv.base);
  const int32_t* table = tables + row.table_start;

  __shared__ float qs[kMaxHeadDim];
  __shared__ float wm[kAttnWarps], wl[kAttnWarps];
  __shared__ float wacc[kAttnWarps][kMaxHeadDim];
  const float* qr = q + (static_cast<int64_t>(row.q_row) * num_heads + h) * head_dim;
  for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = qr[d];
  __syncthreads();

  const int32_t begin = split * chunk;
  const int32_t end = min(row.last_pos + 1, begin + chunk);
  float m = -INFINITY, l = 0;
  float acc[kMaxHeadDim / kWarp];
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / kWarp; ++i) acc[i] = 0;

  for (int32_t tile = begin + warp * kWarp; tile < end; tile += kAttnWarps * kWarp) {
    const int32_t pos = tile + lane;
    const bool valid = pos < end;
    int64_t head = 0;
    int32_t slot = 0;
    float score = -INFINITY;
    if (valid) {
      const int32_t block = table[pos / bs];
      slot = pos % bs;
      head = static_cast<int64_t>(block) * kv.block_stride + static_cast<int64_t>(kvh) * kv.head_stride;
      float dot = 0;
      for (int32_t d = 0; d < head_dim; ++d) dot += qs[d] * LoadKv<T>(base, head + static_cast<int64_t>(d) * bs + slot);
      if constexpr (sizeof(T) == 1) {
        const float* sc = reinterpret_cast<const float*>(reinterpret_cast<const int8_t*>(base) +
                                                         static_cast<int64_t>(block) * kv.block_stride +
                                                         kv.scale_offset);
        dot *= sc[static_cast<int64_t>(kvh) * bs + slot];
      }
      score = dot * scale;
    }
    const float tile_max = WarpMax(score);
    const float new_m = fmaxf(m, tile_max);
    const float p = valid ? expf(score - new_m) : 0.0f;
    const float correction = m == -INFINITY ? 0.0f : expf(m - new_m);
    l = l * correction + WarpSum(p);
#pragma unroll
    for (int i = 0; i < kMaxHeadDim / kWarp; ++i) acc[i] *= correction;
    m = new_m;
    // The V scale of an int8 position folds into its weight.
    float pv = p;
    if constexpr (sizeof(T) == 1) {
      if (valid) {
        const int32_t block = table[pos / bs];
        const float* sc = reinterpret_cast<const float*>(reinterpret_cast<const int8_t*>(base) +
                                                         static_cast<int64_t>(block) * kv.block_stride +
                                                         kv.scale_offset);
        pv *= sc[static_cast<int64_t>(num_kv_heads) * bs + static_cast<int64_t>(kvh) * bs + slot];
      }
    }
    const int32_t n = min(kWarp, end - tile);
    for (int32_t j = 0; j < n; ++j) {
      const float w = __shfl_sync(0xffffffffu, pv, j);
      const int64_t vhead = __shfl_sync(0xffffffffu, head, j);
      const int32_t vslot = __shfl_sync(0xffffffffu, slot, j);
      const int64_t vrow = vhead + kv.v_offset + static_cast<int64_t>(vslot) * head_dim;
#pragma unroll
      for (int i = 0; i < kMaxHeadDim / kWarp; ++i) {
        const int32_t d = lane + i * kWarp;
        if (d < head_dim) acc[i] += w * LoadKv<T>(base, vrow + d);
      }
    }
  }

  // Merge the warps.
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kMaxHeadDim / kWarp; ++i) {
    const int32_t d = lane + i * kWarp;
    if (d < head_dim) wacc[warp][d] = acc[i];
  }
  __syncthreads();
  float gm = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) gm = fmaxf(gm, wm[w]);
  float gl = 0;
  float f[kAttnWarps];
  for (int w = 0; w < kAttnWarps; ++w) {
    f[w] = wm[w] == -INFINITY ? 0.0f : expf(wm[w] - gm);
    gl += wl[w] * f[w];
  }
  const int64_t out_at = (static_cast<int64_t>(row.q_row) * num_heads + h) * head_dim;
  if (splits == 1) {
    for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float v = 0;
      for (int w = 0; w < kAttnWarps; ++w) v += wacc[w][d] * f[w];
      out[out_at + d] = gl > 0 ? v / gl : 0.0f;
    }
    return;
  }
  // [rows][heads][splits][head_dim + 2]: max, sum, output.
  float* pr = partial + ((static_cast<int64_t>(blockIdx.x) * num_heads + h) * splits + split) * (head_dim + 2);
  if (threadIdx.x == 0) {
    pr[0] = gm;
    pr[1] = gl;
  }
  for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float v = 0;
    for (int w = 0; w < kAttnWarps; ++w) v += wacc[w][d] * f[w];
    pr[2 + d] = v;
  }
}

// Grid (rows, heads): the splits of one row and head, merged.
__global__ void AttentionMergeKernel(const float* partial, const AttnRow* rows, int32_t num_heads, int32_t head_dim,
                                     int32_t splits, float* out) {
  const int32_t h = blockIdx.y;
  const float* pr = partial + (static_cast<int64_t>(blockIdx.x) * num_heads + h) * splits * (head_dim + 2);
  float gm = -INFINITY;
  for (int32_t s = 0; s < splits; ++s) gm = fmaxf(gm, pr[s * (head_dim + 2)]);
  float gl = 0;
  for (int32_t s = 0; s < splits; ++s) {
    const float ms = pr[s * (head_dim + 2)];
    if (ms != -INFINITY) gl += pr[s * (head_dim + 2) + 1] * expf(ms - gm);
  }
  const int64_t out_at = (static_cast<int64_t>(rows[blockIdx.x].q_row) * num_heads + h) * head_dim;
  for (int32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float v = 0;
    for (int32_t s = 0; s < splits; ++s) {
      const float ms = pr[s * (head_dim + 2)];
      if (ms != -INFINITY) v += pr[s * (head_dim + 2) + 2 + d] * expf(ms - gm);
    }
    out[out_at + d] = gl > 0 ? v / gl : 0.0f;
  }
}

int GridFor(int64_t n, int threads) {
  // At least one block: a launch of none is an error (and sticky here).
  return static_cast<int>(std::clamp<int64_t>((n + threads - 1) / threads, 1, 65535 * 4));
}

class CudaLinear final : public LinearWeight {
 public:
  CudaLinear(int64_t n, int64_t k, DType dtype) : n_(n), k_(k), dtype_(dtype) {}
  ~CudaLinear() override {
    if (w_ != nullptr) cudaFree(w_);
    if (scales_ != nullptr) cudaFree(scales_);
  }
  int64_t n() const override { return n_; }
  int64_t k() const override { return k_; }
  DType dtype() const override { return dtype_; }
  size_t bytes() const override { return n_ * k_ * DTypeSize(dtype_) + (scales_ != nullptr ? n_ * 4 : 0); }

  void* w_ = nullptr;
  float* scales_ = nullptr;  // kI8: [n]

 private:
  int64_t n_, k_;
  DType dtype_;
};

class CudaEmbedding final : public EmbeddingTable {
 public:
  CudaEmbedding(int64_t rows, int64_t dim, DType dtype) : rows_(rows), dim_(dim), dtype_(dtype) {}
  ~CudaEmbedding() override {
    if (data_ != nullptr) cudaFree(data_);
    if (scales_ != nullptr) cudaFree(scales_);
  }
  int64_t rows() const override { return rows_; }
  int64_t dim() const override { return dim_; }
  DType dtype() const override { return dtype_; }
  size_t bytes() const override { return rows_ * dim_ * DTypeSize(dtype_) + (scales_ != nullptr ? rows_ * 4 : 0); }

  void* data_ = nullptr;
  float* scales_ = nullptr;

 private:
  int64_t rows_, dim_;
  DType dtype_;
};

// Its own stream on the backend's device; pageable sources (the transport's
// registered memory) are staged by the driver.
class CudaUploader final : public BackendUploader {
 public:
  CudaUploader(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaUploader() override {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }
  absl::Status Upload(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    (void)cudaSetDevice(device_);
    if (cudaError_t e = cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_); e != cudaSuccess) {
      return CudaError("upload cudaMemcpyAsync", e);
    }
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) return CudaError("upload sync", e);
    return absl::OkStatus();
  }

 private:
  const int device_;
  cudaStream_t stream_;
};

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(int device, cudaStream_t stream, cublasHandle_t blas, cudaDeviceProp prop)
      : device_(device), stream_(stream), blas_(blas), prop_(prop) {}
  ~CudaBackendImpl() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    for (void* p : {static_cast<void*>(x16_), static_cast<void*>(w16_), static_cast<void*>(meta_dev_),
                    static_cast<void*>(partial_)}) {
      if (p != nullptr) cudaFree(p);
    }
    if (meta_host_ != nullptr) cudaFreeHost(meta_host_);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }

  std::string Name() const override {
    return absl::StrCat("cuda/sm_", prop_.major, prop_.minor, " (", prop_.name, ")");
  }
  int num_sms() const override { return prop_.multiProcessorCount; }
  absl::Status status() const override { return error_; }

  absl::StatusOr<GpuMemoryInfo> MemoryInfo() override {
    Use();
    GpuMemoryInfo info;
    if (cudaError_t e = cudaMemGetInfo(&info.free_bytes, &info.total_bytes); e != cudaSuccess) {
      return CudaError("cudaMemGetInfo", e);
    }
    return info;
  }

  bool HostAddressable() const override { return false; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    Use();
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 256)); e != cudaSuccess) {
      cudaGetLastError();  // An out-of-memory error is not sticky.
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ", device_, ": ",
                                                       cudaGetErrorString(e)));
    }
    return p;
  }
  void Free(void* p) override {
    Use();
    Check("cudaFree", cudaFree(p));
  }
  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    Use();
    // Pageable memory: the copy is complete when it returns.
    Check("cudaMemcpy H2D", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    Use();
    Check("cudaMemcpy D2H", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }
  void Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, int64_t rows) override {
    if (width == 0 || rows == 0) return;
    Use();
    // cudaMemcpy2D rejects a width above either pitch, which Backend's
    // contract allows (one row wider than the pitch: the model's copy of
    // consecutive logit rows): such copies go as plain ones, row by row.
    if (rows == 1 || (dst_pitch == width && src_pitch == width)) {
      Check("cudaMemcpyAsync D2D", cudaMemcpyAsync(dst, src, width * rows, cudaMemcpyDeviceToDevice, stream_));
      return;
    }
    if (width > dst_pitch || width > src_pitch) {
      for (int64_t r = 0; r < rows; ++r) {
        Check("cudaMemcpyAsync D2D",
              cudaMemcpyAsync(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch,
                              width, cudaMemcpyDeviceToDevice, stream_));
      }
      return;
    }
    Check("cudaMemcpy2DAsync",
          cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, stream_));
  }
  void Zero(void* dst, size_t bytes) override {
    if (bytes == 0) return;
    Use();
    Check("cudaMemsetAsync", cudaMemsetAsync(dst, 0, bytes, stream_));
  }
  void Add(float* y, const float* x, int64_t n) override {
    if (n == 0) return;
    Use();
    AddKernel<<<GridFor(n, 256), 256, 0, stream_>>>(y, x, n);
    Launched("Add");
  }
  void Synchronize() override {
    Use();
    Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }
  absl::StatusOr<std::unique_ptr<BackendUploader>> NewUploader() override {
    Use();
    cudaStream_t s = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
      return CudaError("cudaStreamCreate", e);
    }
    return std::unique_ptr<BackendUploader>(new CudaUploader(device_, s));
  }

  absl::StatusOr<std::unique_ptr<EmbeddingTable>> PackEmbedding(const MatrixPart& part, int64_t dim,
                                                                DType storage) override {
    if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
      return absl::InvalidArgumentError(absl::StrCat("no embedding storage ", DTypeName(storage)));
    }
    if (part.dtype == DType::kI8) return absl::InvalidArgumentError("an int8 embedding needs its scales");
    auto t = std::make_unique<CudaEmbedding>(part.rows, dim, storage);
    if (absl::Status s = PackRows(part, dim, storage, &t->data_, &t->scales_); !s.ok()) return s;
    return t;
  }
  void Embed(const EmbeddingTable& table, const int32_t* ids, int64_t n, float* out) override {
    if (n == 0) return;
    Use();
    const auto& t = static_cast<const CudaEmbedding&>(table);
    const int32_t* dev_ids = static_cast<const int32_t*>(Upload(ids, n * sizeof(int32_t)));
    if (dev_ids == nullptr) return;
    EmbedKernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(t.data_, t.dtype(), t.scales_, t.rows(), t.dim(),
                                                               dev_ids, out);
    Launched("Embed");
  }

  absl::StatusOr<std::unique_ptr<LinearWeight>> PackLinear(absl::Span<const MatrixPart> parts, int64_t k,
                                                           DType storage) override {
    if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
      return absl::InvalidArgumentError(absl::StrCat("weights cannot be held as ", DTypeName(storage)));
    }
    int64_t n = 0;
    for (const MatrixPart& p : parts) {
      if (p.dtype == DType::kI8) return absl::InvalidArgumentError("int8 sources are not supported");
      if (p.stride != 0 && p.stride < k) {
        return absl::InvalidArgumentError(absl::StrCat("matrix rows ", p.stride, " apart hold fewer than ", k, " elements"));
      }
      n += p.rows;
    }
    // The parts, converted to F32 rows on the host, one matrix.
    std::vector<float> rows(static_cast<size_t>(n * k));
    int64_t at = 0;
    for (const MatrixPart& p : parts) {
      const int64_t stride = p.stride == 0 ? k : p.stride;
      for (int64_t r = 0; r < p.rows; ++r, ++at) {
        ConvertToF32(p.dtype, static_cast<const char*>(p.data) + r * stride * DTypeSize(p.dtype), k,
                     rows.data() + at * k);
      }
    }
    auto w = std::make_unique<CudaLinear>(n, k, storage);
    const MatrixPart all{DType::kF32, rows.data(), n, 0};
    if (absl::Status s = PackRows(all, k, storage, &w->w_, &w->scales_); !s.ok()) return s;
    return w;
  }

  absl::StatusOr<std::unique_ptr<LinearWeight>> RandomLinear(int64_t n, int64_t k, DType storage, float bound,
                                                             uint64_t seed) override {
    auto w = std::make_unique<CudaLinear>(n, k, storage);
    if (absl::Status s = RandomRows(n, k, storage, bound, seed, &w->w_, &w->scales_); !s.ok()) return s;
    return w;
  }
  absl::StatusOr<std::unique_ptr<EmbeddingTable>> RandomEmbedding(int64_t rows, int64_t dim, DType storage,
                                                                  float bound, uint64_t seed) override {
    auto t = std::make_unique<CudaEmbedding>(rows, dim, storage);
    if (absl::Status s = RandomRows(rows, dim, storage, bound, seed, &t->data_, &t->scales_); !s.ok()) return s;
    return t;
  }

  absl::StatusOr<double> ReadBandwidth(size_t bytes) override {
    Use();
    const size_t n4 = bytes / sizeof(float4);
    absl::StatusOr<void*> buf = Allocate(n4 * sizeof(float4) + sizeof(float));
    if (!buf.ok()) return buf.status();
    Zero(*buf, n4 * sizeof(float4));
    float* sink = reinterpret_cast<float*>(static_cast<float4*>(*buf) + n4);
    const int threads = 512, blocks = num_sms() * 8;
    std::vector<double> rates;
    for (int pass = 0; pass < 6; ++pass) {
      const double t = TimeOnStream([&] {
        ReadKernel<<<blocks, threads, 0, stream_>>>(static_cast<const float4*>(*buf), n4, sink);
      });
      if (pass > 0) rates.push_back(static_cast<double>(n4 * sizeof(float4)) / t);
    }
    Free(*buf);
    if (!error_.ok()) return error_;
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
  }

  absl::StatusOr<double> Bf16GemmRate(int64_t m, int64_t n, int64_t k) override {
    Use();
    absl::StatusOr<void*> a = Allocate(m * k * 2), b = Allocate(k * n * 2), c = Allocate(m * n * 4);
    if (!a.ok() || !b.ok() || !c.ok()) return absl::ResourceExhaustedError("GEMM peak: no memory for the operands");
    Zero(*a, m * k * 2);
    Zero(*b, k * n * 2);
    // Random operands (zeros would flatter the power draw).
    FillBf16Kernel<<<GridFor(m * k, 256), 256, 0, stream_>>>(static_cast<uint16_t*>(*a), m * k, 7);
    FillBf16Kernel<<<GridFor(k * n, 256), 256, 0, stream_>>>(static_cast<uint16_t*>(*b), k * n, 8);
    const float one = 1.0f, zero = 0.0f;
    std::vector<double> rates;
    for (int run = 0; run < 6; ++run) {
      const double t = TimeOnStream([&] {
        CheckBlas("cublasGemmEx peak",
                  cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                               static_cast<int>(k), &one, *b, CUDA_R_16BF, static_cast<int>(k), *a, CUDA_R_16BF,
                               static_cast<int>(k), &zero, *c, CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
      });
      if (run > 0) rates.push_back(2.0 * m * n * k / t);
    }
    Free(*a);
    Free(*b);
    Free(*c);
    if (!error_.ok()) return error_;
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
  }

  void Linear(const LinearWeight& weight, const float* x, int64_t m, const float* bias, float* y,
              bool accumulate) override {
    const auto& w = static_cast<const CudaLinear&>(weight);
    const int64_t n = w.n(), k = w.k();
    if (m == 0 || n == 0) return;
    Use();
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (w.dtype() == DType::kI8 && m <= kI8GemvMaxRows) {
      const int warps = 8;
      GemvI8Kernel<<<static_cast<unsigned>((n + warps - 1) / warps), warps * kWarp, 0, stream_>>>(
          static_cast<const int8_t*>(w.w_), w.scales_, n, k, x, static_cast<int>(m), beta, y);
      Launched("GemvI8");
    } else if (w.dtype() == DType::kF32) {
      CheckBlas("cublasGemmEx f32",
                cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                             static_cast<int>(k), &one, w.w_, CUDA_R_32F, static_cast<int>(k), x, CUDA_R_32F,
                             static_cast<int>(k), &beta, y, CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
    } else {
      // BF16 operands, F32 accumulation: the activations rounded to BF16.
      if (!Reserve(&x16_, &x16_bytes_, m * k * 2)) return;
      F32ToBf16Kernel<<<GridFor(m * k, 256), 256, 0, stream_>>>(x, m * k, static_cast<uint16_t*>(x16_));
      Launched("F32ToBf16");
      // Prefill rows of an int8 matrix: dequantise a slab of output rows
      // at a time (bounded scratch: an LM head whole would take ~1 GiB),
      // each slab's GEMM writing its columns of y.
      const int64_t slab = w.dtype() == DType::kI8 ? std::min<int64_t>(n, kI8DequantRows) : n;
      for (int64_t n0 = 0; n0 < n; n0 += slab) {
        const int64_t nn = std::min(slab, n - n0);
        const void* wb = w.w_;
        if (w.dtype() == DType::kI8) {
          if (!Reserve(&w16_, &w16_bytes_, slab * k * 2)) return;
          DequantizeI8Kernel<<<GridFor(nn * k, 256), 256, 0, stream_>>>(
              static_cast<const int8_t*>(w.w_) + n0 * k, w.scales_ + n0, nn, k, static_cast<uint16_t*>(w16_));
          Launched("DequantizeI8");
          wb = w16_;
        }
        CheckBlas("cublasGemmEx bf16",
                  cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(nn), static_cast<int>(m),
                               static_cast<int>(k), &one, wb, CUDA_R_16BF, static_cast<int>(k), x16_, CUDA_R_16BF,
                               static_cast<int>(k), &beta, y + n0, CUDA_R_32F, static_cast<int>(n),
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    }
    if (bias != nullptr) {
      AddBiasKernel<<<GridFor(m * n, 256), 256, 0, stream_>>>(y, bias, m, n);
      Launched("AddBias");
    }
  }

  void RmsNorm(const float* x, const float* weight, int64_t m, int64_t d, float eps, float* y) override {
    if (m == 0) return;
    Use();
    RmsNormKernel<<<static_cast<unsigned>(m), 256, 0, stream_>>>(x, weight, d, eps, y);
    Launched("RmsNorm");
  }

  void Rope(float* x, int64_t rows, int32_t heads, int32_t head_dim, const int32_t* positions, const float* cos,
            const float* sin) override {
    if (rows == 0) return;
    Use();
    const int32_t* dev_pos = static_cast<const int32_t*>(Upload(positions, rows * sizeof(int32_t)));
    if (dev_pos == nullptr) return;
    RopeKernel<<<GridFor(rows * heads * (head_dim / 2), 256), 256, 0, stream_>>>(x, rows, heads, head_dim, dev_pos,
                                                                                 cos, sin);
    Launched("Rope");
  }

  void SiluMul(const float* gate_up, int64_t m, int64_t f, float* out) override {
    if (m == 0) return;
    Use();
    SiluMulKernel<<<GridFor(m * f, 256), 256, 0, stream_>>>(gate_up, m, f, out);
    Launched("SiluMul");
  }

  void WriteKv(const KvLayerView& kv, int32_t num_kv_heads, int32_t head_dim, const float* k, const float* v,
               int64_t rows, const int32_t* blocks, const int32_t* slots) override {
    if (rows == 0) return;
    Use();
    std::vector<int32_t> meta(2 * rows);
    std::memcpy(meta.data(), blocks, rows * sizeof(int32_t));
    std::memcpy(meta.data() + rows, slots, rows * sizeof(int32_t));
    const int32_t* dev = static_cast<const int32_t*>(Upload(meta.data(), meta.size() * sizeof(int32_t)));
    if (dev == nullptr) return;
    const int64_t items = rows * num_kv_heads;
    const int warps = 8;
    WriteKvKernel<<<static_cast<unsigned>((items + warps - 1) / warps), warps * kWarp, 0, stream_>>>(
        kv, num_kv_heads, head_dim, k, v, rows, dev, dev + rows);
    Launched("WriteKv");
  }

  void Attention(const AttentionBatch& batch) override {
    Use();
    if (batch.head_dim > kMaxHeadDim || batch.num_heads % batch.num_kv_heads != 0) {
      Fail(absl::InvalidArgumentError(absl::StrCat("attention of head_dim ", batch.head_dim, " (at most ",
                                                   kMaxHeadDim, ") and ", batch.num_heads, "/",
                                                   batch.num_kv_heads, " heads")));
      return;
    }
    // Rows and tables for the device.
    std::vector<int32_t> meta;
    int32_t nrows = 0, max_len = 0;
    for (const AttentionSequence& s : batch.sequences) nrows += s.num_new;
    if (nrows == 0) return;
    meta.resize(static_cast<size_t>(nrows) * 4);
    std::vector<int32_t> tables;
    int32_t r = 0;
    int64_t positions_read = 0;
    const int64_t bytes_per_pos = 2 * batch.head_dim * DTypeSize(batch.kv.dtype) + (batch.kv.dtype == DType::kI8 ? 8 : 0);
    for (const AttentionSequence& s : batch.sequences) {
      const int32_t start = static_cast<int32_t>(tables.size());
      tables.insert(tables.end(), s.block_table.begin(), s.block_table.end());
      for (int32_t i = 0; i < s.num_new; ++i, ++r) {
        meta[r * 4 + 0] = s.row_offset + i;
        meta[r * 4 + 1] = s.num_cached + i;
        meta[r * 4 + 2] = start;
        meta[r * 4 + 3] = 0;
      }
      max_len = std::max(max_len, s.num_cached + s.num_new);
      positions_read += s.num_cached + s.num_new;
    }
    if (batch.kv_bytes_read != nullptr) *batch.kv_bytes_read += positions_read * batch.num_kv_heads * bytes_per_pos;
    const size_t meta_bytes = meta.size() * sizeof(int32_t);
    std::vector<char> all(meta_bytes + tables.size() * sizeof(int32_t));
    std::memcpy(all.data(), meta.data(), meta_bytes);
    if (!tables.empty()) std::memcpy(all.data() + meta_bytes, tables.data(), tables.size() * sizeof(int32_t));
    const char* dev = static_cast<const char*>(Upload(all.data(), all.size()));
    if (dev == nullptr) return;
    const AttnRow* dev_rows = reinterpret_cast<const AttnRow*>(dev);
    const int32_t* dev_tables = reinterpret_cast<const int32_t*>(dev + meta_bytes);

    // Split long histories when the rows and heads alone leave SMs idle.
    const int64_t blocks = static_cast<int64_t>(nrows) * batch.num_heads;
    int32_t splits = 1;
    if (blocks < 2 * num_sms()) {
      const int64_t want = (2 * num_sms() + blocks - 1) / blocks;
      splits = static_cast<int32_t>(std::min<int64_t>({want, (max_len + 255) / 256, 64}));
      splits = std::max(splits, 1);
    }
    int32_t chunk = (max_len + splits - 1) / splits;
    chunk = (chunk + kWarp - 1) / kWarp * kWarp;
    splits = (max_len + chunk - 1) / chunk;
    if (splits > 1 && !Reserve(&partial_, &partial_bytes_,
                               blocks * splits * (batch.head_dim + 2) * sizeof(float))) {
      return;
    }
    const dim3 grid(static_cast<unsigned>(nrows), static_cast<unsigned>(batch.num_heads),
                    static_cast<unsigned>(splits));
    const int threads = kAttnWarps * kWarp;
    float* partial = static_cast<float*>(partial_);
    switch (batch.kv.dtype) {
      case DType::kF32:
        AttentionKernel<float><<<grid, threads, 0, stream_>>>(batch.q, batch.out, dev_rows, dev_tables, batch.kv,
                                                              batch.num_heads, batch.num_kv_heads, batch.head_dim,
                                                              batch.scale, chunk, partial);
        break;
      case DType::kBF16:
        AttentionKernel<uint16_t><<<grid, threads, 0, stream_>>>(batch.q, batch.out, dev_rows, dev_tables, batch.kv,
                                                                 batch.num_heads, batch.num_kv_heads, batch.head_dim,
                                                                 batch.scale, chunk, partial);
        break;
      case DType::kI8:
        AttentionKernel<int8_t><<<grid, threads, 0, stream_>>>(batch.q, batch.out, dev_rows, dev_tables, batch.kv,
                                                               batch.num_heads, batch.num_kv_heads, batch.head_dim,
                                                               batch.scale, chunk, partial);
        break;
      default:
        Fail(absl::InvalidArgumentError(absl::StrCat("no attention over ", DTypeName(batch.kv.dtype), " KV")));
        return;
    }
    Launched("Attention");
    if (splits > 1) {
      AttentionMergeKernel<<<dim3(static_cast<unsigned>(nrows), static_cast<unsigned>(batch.num_heads)), 128, 0,
                             stream_>>>(partial, dev_rows, batch.num_heads, batch.head_dim, splits, batch.out);
      Launched("AttentionMerge");
    }
  }

 private:
  void Use() { (void)cudaSetDevice(device_); }
  void Fail(absl::Status s) { error_.Update(std::move(s)); }  // Keeps the first.
  void Check(const char* what, cudaError_t e) {
    if (e != cudaSuccess) Fail(CudaError(what, e));
  }
  void CheckBlas(const char* what, cublasStatus_t s) {
    if (s != CUBLAS_STATUS_SUCCESS) Fail(CublasError(what, s));
  }
  void Launched(const char* what) { Check(what, cudaGetLastError()); }

  // Seconds the work `enqueue` puts on the stream takes (CUDA events).
  template <typename F>
  double TimeOnStream(F enqueue) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaEventRecord(start, stream_);
    enqueue();
    cudaEventRecord(stop, stream_);
    Check("cudaEventSynchronize", cudaEventSynchronize(stop));
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return std::max(1e-9, ms / 1e3);
  }

  // n x k random values packed as `storage` into new device memory.
  absl::Status RandomRows(int64_t n, int64_t k, DType storage, float bound, uint64_t seed, void** data,
                          float** scales) {
    if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
      return absl::InvalidArgumentError(absl::StrCat("weights cannot be held as ", DTypeName(storage)));
    }
    Use();
    absl::StatusOr<void*> d = Allocate(std::max<int64_t>(1, n * k) * DTypeSize(storage));
    if (!d.ok()) return d.status();
    *data = *d;
    if (storage == DType::kI8) {
      absl::StatusOr<void*> sc = Allocate(std::max<int64_t>(1, n) * sizeof(float));
      if (!sc.ok()) return sc.status();
      *scales = static_cast<float*>(*sc);
    }
    // In slabs of rows through an F32 scratch, packed as a checkpoint's
    // would be; each slab draws from its own seed (seed + its first element).
    const int64_t slab = std::max<int64_t>(1, (int64_t{64} << 20) / std::max<int64_t>(1, k * 4));
    absl::StatusOr<void*> scratch = Allocate(std::max<int64_t>(1, std::min(slab, n) * k) * sizeof(float));
    if (!scratch.ok()) return scratch.status();
    for (int64_t r = 0; r < n; r += slab) {
      const int64_t rn = std::min(slab, n - r);
      RandomRowsKernel<<<static_cast<unsigned>(rn), 256, 0, stream_>>>(k, bound, seed + r * k,
                                                                       static_cast<float*>(*scratch));
      PackRowsKernel<<<static_cast<unsigned>(rn), 256, 0, stream_>>>(
          static_cast<float*>(*scratch), k, storage, static_cast<char*>(*data) + r * k * DTypeSize(storage),
          storage == DType::kI8 ? *scales + r : nullptr);
      Launched("RandomRows");
    }
    Synchronize();
    Free(*scratch);
    return error_;
  }

  // Grows a device scratch buffer; its old contents are discarded.
  bool Reserve(void** p, size_t* have, size_t bytes) {
    if (bytes <= *have) return true;
    if (*p != nullptr) {
      Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
      cudaFree(*p);
      *p = nullptr;
      *have = 0;
    }
    absl::StatusOr<void*> a = Allocate(bytes);
    if (!a.ok()) {
      Fail(a.status());
      return false;
    }
    *p = *a;
    *have = bytes;
    return true;
  }

  // Per-call metadata (ids, positions, tables) to the device: through a
  // pinned arena mirrored on the device, each upload at a fresh offset;
  // the arena wraps only after the stream drained, so no pending kernel
  // reads a region being overwritten.
  const void* Upload(const void* host, size_t bytes) {
    const size_t need = (bytes + 255) / 256 * 256;
    if (need > meta_bytes_) {
      Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
      if (meta_host_ != nullptr) cudaFreeHost(meta_host_);
      if (meta_dev_ != nullptr) cudaFree(meta_dev_);
      meta_host_ = nullptr;
      meta_dev_ = nullptr;
      meta_bytes_ = std::max<size_t>(need * 2, size_t{8} << 20);
      Check("cudaMallocHost", cudaMallocHost(&meta_host_, meta_bytes_));
      Check("cudaMalloc", cudaMalloc(&meta_dev_, meta_bytes_));
      meta_at_ = 0;
      if (!error_.ok()) {
        meta_bytes_ = 0;
        return nullptr;
      }
    }
    if (meta_at_ + need > meta_bytes_) {
      Check("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
      meta_at_ = 0;
    }
    char* h = static_cast<char*>(meta_host_) + meta_at_;
    char* d = static_cast<char*>(meta_dev_) + meta_at_;
    std::memcpy(h, host, bytes);
    Check("cudaMemcpyAsync meta", cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_));
    meta_at_ += need;
    return d;
  }

  // Host rows of `part` (F32, F16 or BF16) -> device storage.
  absl::Status PackRows(const MatrixPart& part, int64_t k, DType storage, void** data, float** scales) {
    Use();
    const int64_t n = part.rows;
    absl::StatusOr<void*> d = Allocate(std::max<int64_t>(1, n * k) * DTypeSize(storage));
    if (!d.ok()) return d.status();
    *data = *d;
    if (storage == DType::kI8) {
      absl::StatusOr<void*> sc = Allocate(std::max<int64_t>(1, n) * sizeof(float));
      if (!sc.ok()) return sc.status();
      *scales = static_cast<float*>(*sc);
    }
    // Through an F32 slab on the device, a few MiB at a time.
    const int64_t slab = std::max<int64_t>(1, (int64_t{16} << 20) / std::max<int64_t>(1, k * 4));
    std::vector<float> host(static_cast<size_t>(std::min(slab, n) * k));
    absl::StatusOr<void*> scratch = Allocate(std::max<size_t>(1, host.size()) * sizeof(float));
    if (!scratch.ok()) return scratch.status();
    const int64_t stride = part.stride == 0 ? k : part.stride;
    for (int64_t r = 0; r < n; r += slab) {
      const int64_t rn = std::min(slab, n - r);
      for (int64_t i = 0; i < rn; ++i) {
        ConvertToF32(part.dtype, static_cast<const char*>(part.data) + (r + i) * stride * DTypeSize(part.dtype), k,
                     host.data() + i * k);
      }
      CopyToDevice(*scratch, host.data(), rn * k * sizeof(float));
      PackRowsKernel<<<static_cast<unsigned>(rn), 256, 0, stream_>>>(
          static_cast<float*>(*scratch), k, storage, static_cast<char*>(*data) + r * k * DTypeSize(storage),
          storage == DType::kI8 ? *scales + r : nullptr);
      Launched("PackRows");
      Synchronize();
    }
    Free(*scratch);
    return error_;
  }

  const int device_;
  cudaStream_t stream_;
  cublasHandle_t blas_;
  const cudaDeviceProp prop_;
  absl::Status error_;
  void* x16_ = nullptr;
  size_t x16_bytes_ = 0;
  void* w16_ = nullptr;
  size_t w16_bytes_ = 0;
  void* partial_ = nullptr;
  size_t partial_bytes_ = 0;
  void* meta_host_ = nullptr;
  void* meta_dev_ = nullptr;
  size_t meta_bytes_ = 0;
  size_t meta_at_ = 0;
};

}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;  // Left untouched when there is no driver.
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return CudaError("cudaGetDeviceCount", e);
  if (count == 0) return absl::UnavailableError("cudaGetDeviceCount: no CUDA device");
  return count;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const CudaBackendOptions& options) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  if (options.device < 0 || options.device >= *count) {
    return absl::InvalidArgumentError(absl::StrCat("GPU ", options.device, " of ", *count));
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) return CudaError("cudaSetDevice", e);
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, options.device); e != cudaSuccess) {
    return CudaError("cudaGetDeviceProperties", e);
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaError("cudaStreamCreate", e);
  }
  cublasHandle_t blas = nullptr;
  if (cublasStatus_t s = cublasCreate(&blas); s != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(stream);
    return CublasError("cublasCreate", s);
  }
  cublasSetStream(blas, stream);
  return std::unique_ptr<CudaBackend>(new CudaBackendImpl(options.device, stream, blas, prop));
}

}  // namespace pdserve::kernels::cuda

// The entry point cuda_loader.cc looks up: a backend, or null and why.
extern "C" __attribute__((visibility("default"))) pdserve::kernels::cuda::CudaBackend* pdserve_cuda_create_backend(
    int device, absl::Status* status) {
  absl::StatusOr<std::unique_ptr<pdserve::kernels::cuda::CudaBackend>> b =
      pdserve::kernels::cuda::CudaBackend::Create({.device = device});
  if (!b.ok()) {
    *status = b.status();
    return nullptr;
  }
  return b->release();
}
