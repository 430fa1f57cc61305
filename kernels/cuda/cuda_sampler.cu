// The GPU sampler (cuda_backend.h, CudaSampler): engine/sampling.cc's
// pipeline step for step. Every F32 operation is written with an explicit
// rounding intrinsic, so nvcc cannot contract it into an FMA the CPU does
// not do.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cuda_backend.h"

namespace pdserve::kernels::cuda {
namespace {

// Per-row parameters as the kernels read them.
struct RowArgs {
  float temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, uniform;
  int32_t top_k;
  int32_t seen_at, seen_n, gen_at, gen_n;  // Into the concatenated penalty lists.
};

// A key whose ascending order is the logit's descending order (NaN-free
// logits); the stable sort keeps equal logits in id order.
__device__ __forceinline__ uint32_t DescendingKey(float v) {
  const uint32_t u = __float_as_uint(__fadd_rn(v, 0.0f));  // -0 ties +0, as on the CPU.
  const uint32_t asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~asc;
}

// Grid rows, one block each: the penalised, temperature-scaled row into l,
// the row's best (greedy: the token itself, the first maximum), and the
// sort's keys and ids (non-candidates keyed last).
__global__ void PrepareKernel(const float* logits, int64_t vocab, const RowArgs* args, const int32_t* lists,
                              float* l, uint32_t* keys, int32_t* ids, float* best_out, int32_t* greedy_out,
                              int32_t* num_candidates) {
  const int64_t r = blockIdx.x;
  const RowArgs a = args[r];
  const float* in = logits + r * vocab;
  float* row = l + r * vocab;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) row[i] = in[i];
  __syncthreads();
  // 1. Penalties: repetition over every seen token, then presence and
  // frequency over the generated ones (each token's own, so in parallel).
  if (a.repetition_penalty != 1.0f) {
    for (int32_t i = threadIdx.x; i < a.seen_n; i += blockDim.x) {
      const int32_t t = lists[a.seen_at + i];
      const float v = row[t];
      row[t] = v > 0 ? __fdiv_rn(v, a.repetition_penalty) : __fmul_rn(v, a.repetition_penalty);
    }
  }
  __syncthreads();
  if (a.presence_penalty != 0.0f || a.frequency_penalty != 0.0f) {
    for (int32_t i = threadIdx.x; i < a.gen_n; i += blockDim.x) {
      const int32_t t = lists[a.gen_at + i];
      const int32_t n = lists[a.gen_at + a.gen_n + i];
      row[t] = __fsub_rn(row[t], __fadd_rn(a.presence_penalty, __fmul_rn(a.frequency_penalty, static_cast<float>(n))));
    }
  }
  __syncthreads();
  // 2. Temperature (greedy: the first maximum of the penalised logits).
  const bool greedy = a.temperature == 0.0f;
  const float inv_t = greedy ? 1.0f : __fdiv_rn(1.0f, a.temperature);
  __shared__ float sv[1024];
  __shared__ int32_t si[1024];
  float bv = -INFINITY;
  int32_t bi = INT32_MAX;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    float v = row[i];
    if (!greedy) {
      v = __fmul_rn(v, inv_t);
      row[i] = v;
    }
    if (v > bv || (v == bv && i < bi)) {
      bv = v;
      bi = static_cast<int32_t>(i);
    }
  }
  sv[threadIdx.x] = bv;
  si[threadIdx.x] = bi;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      const float ov = sv[threadIdx.x + s];
      const int32_t oi = si[threadIdx.x + s];
      if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
        sv[threadIdx.x] = ov;
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  const float best = sv[0];
  if (threadIdx.x == 0) {
    best_out[r] = best;
    greedy_out[r] = si[0];
  }
  if (greedy) return;
  // 3. Candidates: within 88 of the best.
  const float floor = __fsub_rn(best, 88.0f);
  __shared__ int32_t count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  int32_t mine = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const bool cand = row[i] >= floor;
    keys[r * vocab + i] = cand ? DescendingKey(row[i]) : 0xffffffffu;
    ids[r * vocab + i] = static_cast<int32_t>(i);
    mine += cand;
  }
  atomicAdd(&count, mine);
  __syncthreads();
  if (threadIdx.x == 0) num_candidates[r] = count;
}

// Grid rows: prob[i] = exp(l[cand[i]] - best) for the row's candidates.
__global__ void ProbKernel(const float* l, int64_t vocab, const int32_t* sorted_ids, const float* best,
                           const int32_t* num_candidates, float* prob) {
  const int64_t r = blockIdx.x;
  const int32_t n = num_candidates[r];
  for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
    prob[r * vocab + i] = expf(__fsub_rn(l[r * vocab + sorted_ids[r * vocab + i]], best[r]));
  }
}

// One thread a row: top-k, top-p, min-p and the draw, sums taken in
// candidate order as the CPU takes them.
__global__ void DrawKernel(int64_t vocab, int64_t rows, const RowArgs* args, const int32_t* sorted_ids,
                           const int32_t* num_candidates, const float* prob_all, const int32_t* greedy,
                           int32_t* tokens) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const RowArgs a = args[r];
  if (a.temperature == 0.0f) {
    tokens[r] = greedy[r];
    return;
  }
  const int32_t* cand = sorted_ids + r * vocab;
  const float* prob = prob_all + r * vocab;
  int32_t n = num_candidates[r];
  if (a.top_k > 0 && a.top_k < n) n = a.top_k;
  float sum = 0;
  for (int32_t i = 0; i < n; ++i) sum = __fadd_rn(sum, prob[i]);
  int32_t keep = n;
  if (a.top_p < 1.0f) {
    const float target = __fmul_rn(a.top_p, sum);
    float cum = 0;
    for (int32_t i = 0; i < n; ++i) {
      cum = __fadd_rn(cum, prob[i]);
      if (cum >= target) {
        keep = i + 1;
        break;
      }
    }
  }
  if (a.min_p > 0.0f) {
    const float floor = __fmul_rn(a.min_p, prob[0]);
    int32_t k = 1;
    while (k < keep && prob[k] >= floor) ++k;
    keep = k;
  }
  float kept = 0;
  for (int32_t i = 0; i < keep; ++i) kept = __fadd_rn(kept, prob[i]);
  const float target = __fmul_rn(a.uniform, kept);
  float cum = 0;
  int32_t token = cand[keep - 1];
  for (int32_t i = 0; i < keep; ++i) {
    cum = __fadd_rn(cum, prob[i]);
    if (cum > target) {
      token = cand[i];
      break;
    }
  }
  tokens[r] = token;
}

class CudaSamplerImpl final : public CudaSampler {
 public:
  CudaSamplerImpl(CudaBackend* backend, int device, cudaStream_t stream)
      : backend_(backend), device_(device), stream_(stream) {}
  ~CudaSamplerImpl() override {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    for (void* p : buffers_) (void)cudaFree(p);
    (void)cudaStreamDestroy(stream_);
  }

  absl::Status Sample(const float* logits, int64_t vocab, absl::Span<const SampleRowParams> rows,
                      int32_t* tokens) override {
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) return absl::OkStatus();
    if (vocab < 1 || vocab > (int64_t{1} << 30)) return absl::InvalidArgumentError("sampler: bad vocabulary size");
    backend_->Synchronize();  // The logits are the backend stream's.
    if (absl::Status s = backend_->status(); !s.ok()) return s;
    (void)cudaSetDevice(device_);
    std::vector<RowArgs> args(n);
    std::vector<int32_t> lists;
    for (int64_t r = 0; r < n; ++r) {
      const SampleRowParams& p = rows[r];
      if (p.generated_ids.size() != p.generated_counts.size()) {
        return absl::InvalidArgumentError("sampler: generated ids and counts differ in length");
      }
      RowArgs& a = args[r];
      a = {p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
           p.uniform, p.top_k, 0, 0, 0, 0};
      a.seen_at = static_cast<int32_t>(lists.size());
      a.seen_n = static_cast<int32_t>(p.seen_ids.size());
      lists.insert(lists.end(), p.seen_ids.begin(), p.seen_ids.end());
      a.gen_at = static_cast<int32_t>(lists.size());
      a.gen_n = static_cast<int32_t>(p.generated_ids.size());
      lists.insert(lists.end(), p.generated_ids.begin(), p.generated_ids.end());
      lists.insert(lists.end(), p.generated_counts.begin(), p.generated_counts.end());
      for (int32_t t : p.seen_ids) {
        if (t < 0 || t >= vocab) return absl::InvalidArgumentError("sampler: a seen token is outside the vocabulary");
      }
      for (int32_t t : p.generated_ids) {
        if (t < 0 || t >= vocab) return absl::InvalidArgumentError("sampler: a token is outside the vocabulary");
      }
    }
    if (lists.empty()) lists.push_back(0);
    const int64_t cells = n * vocab;
    // The sort's temporary storage, asked of cub for one row.
    size_t sort_bytes = 0;
    cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr),
                                    static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                    static_cast<int32_t*>(nullptr), static_cast<int>(vocab), 0, 32, stream_);
    char* base = nullptr;
    const size_t need = Align(cells * 4) * 6 + Align(n * sizeof(RowArgs)) + Align(lists.size() * 4) +
                        Align(n * 4) * 4 + Align(sort_bytes);
    if (absl::Status s = Reserve(need, &base); !s.ok()) return s;
    char* at = base;
    auto take = [&](size_t bytes) {
      char* p = at;
      at += Align(bytes);
      return p;
    };
    float* l = reinterpret_cast<float*>(take(cells * 4));
    uint32_t* keys = reinterpret_cast<uint32_t*>(take(cells * 4));
    uint32_t* keys_out = reinterpret_cast<uint32_t*>(take(cells * 4));
    int32_t* ids = reinterpret_cast<int32_t*>(take(cells * 4));
    int32_t* ids_out = reinterpret_cast<int32_t*>(take(cells * 4));
    float* prob = reinterpret_cast<float*>(take(cells * 4));
    RowArgs* dargs = reinterpret_cast<RowArgs*>(take(n * sizeof(RowArgs)));
    int32_t* dlists = reinterpret_cast<int32_t*>(take(lists.size() * 4));
    float* best = reinterpret_cast<float*>(take(n * 4));
    int32_t* greedy = reinterpret_cast<int32_t*>(take(n * 4));
    int32_t* ncand = reinterpret_cast<int32_t*>(take(n * 4));
    int32_t* dtokens = reinterpret_cast<int32_t*>(take(n * 4));
    void* sort_tmp = take(sort_bytes);
    if (cudaError_t e = cudaMemcpyAsync(dargs, args.data(), n * sizeof(RowArgs), cudaMemcpyHostToDevice, stream_);
        e != cudaSuccess) {
      return CudaError("sampler: cudaMemcpyAsync", e);
    }
    if (cudaError_t e = cudaMemcpyAsync(dlists, lists.data(), lists.size() * 4, cudaMemcpyHostToDevice, stream_);
        e != cudaSuccess) {
      return CudaError("sampler: cudaMemcpyAsync", e);
    }
    PrepareKernel<<<static_cast<unsigned>(n), 1024, 0, stream_>>>(logits, vocab, dargs, dlists, l, keys, ids, best,
                                                                  greedy, ncand);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return CudaError("sampler: PrepareKernel", e);
    for (int64_t r = 0; r < n; ++r) {
      if (rows[r].temperature == 0.0f) continue;
      size_t bytes = sort_bytes;
      if (cudaError_t e = cub::DeviceRadixSort::SortPairs(sort_tmp, bytes, keys + r * vocab, keys_out + r * vocab,
                                                          ids + r * vocab, ids_out + r * vocab,
                                                          static_cast<int>(vocab), 0, 32, stream_);
          e != cudaSuccess) {
        return CudaError("sampler: cub::DeviceRadixSort::SortPairs", e);
      }
    }
    ProbKernel<<<static_cast<unsigned>(n), 256, 0, stream_>>>(l, vocab, ids_out, best, ncand, prob);
    DrawKernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream_>>>(vocab, n, dargs, ids_out, ncand, prob,
                                                                             greedy, dtokens);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return CudaError("sampler: DrawKernel", e);
    if (cudaError_t e = cudaMemcpyAsync(tokens, dtokens, n * 4, cudaMemcpyDeviceToHost, stream_); e != cudaSuccess) {
      return CudaError("sampler: cudaMemcpyAsync", e);
    }
    if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) return CudaError("sampler: cudaStreamSynchronize", e);
    return absl::OkStatus();
  }

 private:
  static size_t Align(size_t b) { return (b + 255) / 256 * 256; }
  absl::Status Reserve(size_t bytes, char** base) {
    if (bytes > have_) {
      (void)cudaStreamSynchronize(stream_);
      for (void* p : buffers_) (void)cudaFree(p);
      buffers_.clear();
      have_ = 0;
      void* p = nullptr;
      if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat("sampler: cudaMalloc of ", bytes, " bytes failed"));
      }
      buffers_.push_back(p);
      have_ = bytes;
    }
    *base = static_cast<char*>(buffers_.front());
    return absl::OkStatus();
  }

  CudaBackend* backend_;
  int device_;
  cudaStream_t stream_;
  std::vector<void*> buffers_;
  size_t have_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaSampler>> CudaSampler::Create(CudaBackend* backend) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return CudaError("sampler: cudaGetDevice", e);
  backend->Synchronize();  // Makes the backend's device current on this thread.
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return CudaError("sampler: cudaGetDevice", e);
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaError("sampler: cudaStreamCreate", e);
  }
  return std::unique_ptr<CudaSampler>(new CudaSamplerImpl(backend, device, stream));
}

}  // namespace pdserve::kernels::cuda
