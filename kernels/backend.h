// The compute backend interface: the operators the model forward is written
// against, once, for every device. kernels/cpu/ implements it always; a CUDA
// backend implements it where nvcc is found.
//
// Buffers passed to a backend live in that backend's memory (Allocate; host
// memory for the CPU backend, GPU memory for the CUDA backend), except the
// small per-call metadata that says where things go: token ids, positions,
// KV block ids and slots, and the attention's block tables are host arrays
// (a device backend uploads them). Activations are F32. Weights are packed
// once into the backend's own layout by PackLinear and PackEmbedding.
//
// Thread safety: a Backend is driven by one thread at a time; it may use its
// own worker threads inside each call.
#ifndef PDSERVE_KERNELS_BACKEND_H_
#define PDSERVE_KERNELS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace pdserve::kernels {

// Rows of a weight matrix as they come from a checkpoint: `rows` x K
// elements of `dtype`, row-major, `stride` elements apart (0: K). A
// column slice of a wider matrix (a row-parallel shard) is its first
// element and the full row length as the stride.
struct MatrixPart {
  DType dtype;
  const void* data;
  int64_t rows;
  int64_t stride = 0;
};

// A linear layer's weight W[N, K] in the backend's layout.
class LinearWeight {
 public:
  virtual ~LinearWeight() = default;
  virtual int64_t n() const = 0;
  virtual int64_t k() const = 0;
  virtual DType dtype() const = 0;
  // Bytes held (what one pass over the weight reads).
  virtual size_t bytes() const = 0;
};

// The KV of one layer in the paged pool (see kv/kv_cache.h): block b's K
// for KV head h is stored transposed, [head_dim][block_size], element (d, s)
// at base + (b * block_stride + h * head_stride + d * block_size + s); its V
// is [block_size][head_dim], element (s, d) at the same place + v_offset +
// s * head_dim + d (all in elements). For kI8, each block also
// holds F32 scales [K|V][num_kv_heads][block_size] starting scale_offset
// bytes after the block's start: one scale per (position, KV head).
struct KvLayerView {
  void* base;
  DType dtype;  // kF32, kBF16 or kI8.
  int64_t block_stride;
  int64_t head_stride;
  int64_t v_offset;
  int32_t block_size;
  int64_t scale_offset = 0;
};

struct AttentionSequence {
  absl::Span<const int32_t> block_table;
  int32_t num_cached;  // S0: positions already in the cache before this call.
  int32_t num_new;     // m: new positions (their K/V are already written).
  int32_t row_offset;  // First row of this sequence in q / out.
};

// Queries of new positions attend, per sequence, to every cached position and
// to the new positions at or before their own (the rectangular causal mask).
struct AttentionBatch {
  const float* q;  // [rows, num_heads, head_dim], RoPE applied
  float* out;      // [rows, num_heads, head_dim]
  absl::Span<const AttentionSequence> sequences;
  KvLayerView kv;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  float scale;
  // Decode batches whose sequences share physical blocks (a common prefix)
  // read each shared block once for all of them (DESIGN.md fact 8).
  bool group_shared_blocks = true;
  // When set, the KV bytes the kernels read are added here.
  int64_t* kv_bytes_read = nullptr;
  // The same sequences (tables, lengths, rows) and KV geometry as the
  // previous Attention call (the next layer of one forward): the backend may
  // reuse how it cut that call into work.
  bool same_sequences_as_previous = false;
};

// An embedding table [rows, dim] in the backend's layout.
class EmbeddingTable {
 public:
  virtual ~EmbeddingTable() = default;
  virtual int64_t rows() const = 0;
  virtual int64_t dim() const = 0;
  virtual DType dtype() const = 0;
  virtual size_t bytes() const = 0;
};

// Copies host memory into a backend's memory from a thread other than the
// one driving the backend, concurrently with its calls (on a GPU: a
// stream of its own). One thread at a time per uploader.
class BackendUploader {
 public:
  virtual ~BackendUploader() = default;
  // Complete, and seen by every later call of the backend, when it returns.
  virtual absl::Status Upload(void* dst, const void* host_src, size_t bytes) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu/avx512", "cpu/scalar", "cuda/sm_90", ...
  virtual std::string Name() const = 0;

  // --- Memory. The defaults are host memory (the CPU backend's); a device
  // backend overrides all of them. Copies between host and backend memory
  // are complete when they return; the others are ordered with the
  // backend's kernels.

  // True when backend memory is host memory the caller may touch directly.
  virtual bool HostAddressable() const { return true; }
  // 64-byte aligned, uninitialised. RESOURCE_EXHAUSTED when it cannot be had.
  virtual absl::StatusOr<void*> Allocate(size_t bytes);
  virtual void Free(void* p);
  virtual void CopyToDevice(void* dst, const void* host_src, size_t bytes);
  virtual void CopyToHost(void* host_dst, const void* src, size_t bytes);
  // `rows` rows of `width` bytes from src (rows `src_pitch` bytes apart) to
  // dst (`dst_pitch` apart), both in backend memory.
  virtual void Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                      int64_t rows);
  virtual void Zero(void* dst, size_t bytes);
  // y[i] += x[i], in backend memory.
  virtual void Add(float* y, const float* x, int64_t n);
  // Waits until every call so far has finished (no-op on the host).
  virtual void Synchronize() {}
  // An uploader into this backend's memory (the default: memcpy).
  virtual absl::StatusOr<std::unique_ptr<BackendUploader>> NewUploader();
  // The first error a call hit (a device backend's kernels fail
  // asynchronously); OK for the CPU backend, whose calls cannot fail.
  virtual absl::Status status() const { return absl::OkStatus(); }

  // --- Embedding. `part` holds `rows` x `dim` elements (F32, F16 or
  // BF16); `storage` is kF32, kBF16 or kI8 (one scale max|row| / 127 per
  // row). Embed writes out[i, :] = row ids[i] (host array) dequantised to
  // F32, or zeros for an id outside [0, rows) (another rank's row).
  virtual absl::StatusOr<std::unique_ptr<EmbeddingTable>> PackEmbedding(const MatrixPart& part, int64_t dim,
                                                                        DType storage);
  virtual void Embed(const EmbeddingTable& table, const int32_t* ids, int64_t n, float* out);

  // --- Random weights, for benchmarks of shapes no checkpoint is shipped
  // for: uniform values in [-bound, bound] from `seed`, stored as
  // `storage`. The defaults draw on the host and pack; a device backend
  // draws on the device (nothing crosses the bus). The same seed gives the
  // same weights on one backend, not across backends.
  virtual absl::StatusOr<std::unique_ptr<LinearWeight>> RandomLinear(int64_t n, int64_t k, DType storage,
                                                                     float bound, uint64_t seed);
  virtual absl::StatusOr<std::unique_ptr<EmbeddingTable>> RandomEmbedding(int64_t rows, int64_t dim, DType storage,
                                                                          float bound, uint64_t seed);

  // Concatenates `parts` along the output dimension (N = sum of rows) into
  // one weight of `storage` type: kF32, kBF16, or kI8 (symmetric, one scale
  // max|row| / 127 per output row, made here).
  // REQUIRES: parts are F32, F16 or BF16.
  virtual absl::StatusOr<std::unique_ptr<LinearWeight>> PackLinear(
      absl::Span<const MatrixPart> parts, int64_t k, DType storage) = 0;

  // y[m, N] = x[m, K] W^T (+ bias[N]); with accumulate, y += instead.
  virtual void Linear(const LinearWeight& w, const float* x, int64_t m, const float* bias,
                      float* y, bool accumulate) = 0;

  // y[i, :] = x[i, :] / sqrt(mean(x[i, :]^2) + eps) * weight, in F32.
  virtual void RmsNorm(const float* x, const float* weight, int64_t m, int64_t d, float eps,
                       float* y) = 0;

  // Rotates each head of x[rows, heads, head_dim] by its row's absolute
  // position (HF rotate_half pairing: i with i + head_dim/2). cos/sin are
  // [max_positions, head_dim/2].
  virtual void Rope(float* x, int64_t rows, int32_t heads, int32_t head_dim,
                    const int32_t* positions, const float* cos, const float* sin) = 0;

  // out[i, :] = silu(gate_up[i, :f]) * gate_up[i, f:2f].
  virtual void SiluMul(const float* gate_up, int64_t m, int64_t f, float* out) = 0;

  // Writes rows of k/v ([rows, num_kv_heads, head_dim]) into the cache:
  // row r goes to physical block blocks[r], slot slots[r].
  virtual void WriteKv(const KvLayerView& kv, int32_t num_kv_heads, int32_t head_dim,
                       const float* k, const float* v, int64_t rows, const int32_t* blocks,
                       const int32_t* slots) = 0;

  virtual void Attention(const AttentionBatch& batch) = 0;

  // A hint: the next Attention call reads `sequences`' KV (their cached and
  // new positions) in `kv`. A backend may start bringing it closer to its
  // cores while the calls before that Attention run (the CPU backend
  // prefetches it from inside its batched-decode products, which leave
  // memory bandwidth free); ignoring it is correct. The hint ends at the
  // next Attention call.
  virtual void PrefetchKv(const KvLayerView& kv, absl::Span<const AttentionSequence> sequences) {}
};

}  // namespace pdserve::kernels

#endif  // PDSERVE_KERNELS_BACKEND_H_
