// One rank's share of a loaded Llama-family model and its forward pass over
// the paged KV cache: all of the model when it is not sharded. Callers hold
// a Model (model/model.h), which runs one shard, or rank 0 and the other
// ranks' shards (model/tensor_parallel_ranks.h).
//
// Forward runs a batch of sequences; sequence b brings S0_b = kv->num_positions()
// cached positions and m_b >= 1 new tokens. The new rows' queries attend to
// all S0_b cached positions plus the new positions at or before their own
// (DESIGN.md fact 1): full prefill (S0 = 0), chunked prefill, prefix hits and
// decode (m = 1) are this one code path. New K/V are appended to the cache.
//
// Semantics match Hugging Face: RMSNorm in F32 then times the weight; RoPE
// with rotate_half pairing and absolute positions; SwiGLU down(silu(gate) * up);
// Qwen2 q/k/v biases; GQA with query head h reading KV head h / g.
//
// Thread safety: Forward is single-caller (it reuses scratch buffers); the
// backend parallelises inside.
#ifndef PDSERVE_MODEL_MODEL_SHARD_H_
#define PDSERVE_MODEL_MODEL_SHARD_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/kv_cache.h"
#include "kv/kv_manager.h"
#include "model/model_config.h"
#include "model/rope.h"
#include "model/tensor_parallel.h"
#include "kernels/backend.h"
#include "kernels/collective.h"
#include "kernels/device_array.h"

namespace pdserve {

struct ModelOptions {
  // In-memory weight format: kF32, kBF16, or kI8 (weight-only int8 with one
  // scale per output channel, made at load time). Unset: BF16 for BF16
  // checkpoints, F32 otherwise.
  std::optional<DType> weight_dtype;
  // Tensor parallelism over `tp` ranks (model/tensor_parallel.h): rank 0
  // runs on Load's backend, rank r >= 1 on rank_backends[r - 1] (each
  // outliving the model, driven only by the model), each on its own thread
  // (model/tensor_parallel_ranks.h). The model then needs a KV pool of
  // MakeKvSpec's ranks.
  int tp = 1;
  std::vector<kernels::Backend*> rank_backends;
};

enum class LogitsMode { kNone, kLast, kAll };

struct ForwardSequence {
  // Its block table must already cover num_positions() + tokens.size()
  // positions (KvManager::Grow); the forward writes the new positions' KV
  // and advances num_positions().
  SequenceKv* kv = nullptr;
  absl::Span<const int32_t> tokens;      // m >= 1 new token ids.
  LogitsMode logits = LogitsMode::kLast;
};

struct ForwardOptions {
  // Decode batches read blocks shared by several sequences once for all of
  // them (cascade attention); off only to measure what it saves.
  bool group_shared_kv = true;
  // Called after layer l's new K/V are in the cache (and before its
  // attention), so a KV handoff can stream the layer while later layers
  // still compute. Runs on the calling thread.
  std::function<void(int32_t layer)> on_layer_kv_written;
  // Off for the ranks of a tensor-parallel forward: their sequences are
  // shared, and the driver advances them once all ranks are done.
  bool advance_positions = true;
};

struct ForwardResult {
  int64_t vocab_size = 0;
  int64_t kv_bytes_read = 0;        // By the attention kernels, all layers.
  double attention_seconds = 0;     // Wall time inside the attention kernels.
  std::vector<float> logits;        // [rows, vocab]
  std::vector<int32_t> first_row;   // Per sequence: its first row in logits.
  std::vector<int32_t> num_rows;    // Per sequence: rows it asked for.

  absl::Span<const float> Row(int64_t row) const {
    return absl::MakeConstSpan(logits.data() + row * vocab_size, vocab_size);
  }
  // The logits of sequence s's last requested row.
  absl::Span<const float> Last(size_t s) const { return Row(first_row[s] + num_rows[s] - 1); }
};

class ModelShard {
 public:
  // Rank `shard.rank` of `shard.size` from DIR/config.json (+
  // generation_config.json) and the safetensors weights, packing only its
  // slices (model/tensor_parallel.h) for `backend` (which must outlive the
  // shard), meeting the other ranks in `collective` (null when unsharded).
  static absl::StatusOr<std::unique_ptr<ModelShard>> Load(const std::string& model_dir, const ModelOptions& options,
                                                          kernels::Backend* backend, TpShard shard,
                                                          kernels::Collective* collective);
  // A model of `config`'s shape with random weights made by the backend
  // (uniform, scaled by 1 / sqrt(fan-in); norms of ones, biases of zeros),
  // held as `storage`. Unsharded. Its identity hashes the config, the
  // format and the seed.
  static absl::StatusOr<std::unique_ptr<ModelShard>> CreateRandom(const ModelConfig& config, DType storage,
                                                                  uint64_t seed, kernels::Backend* backend);
  ~ModelShard();

  const ModelConfig& config() const { return config_; }
  const kernels::Backend& backend() const { return *backend_; }
  DType weight_dtype() const { return weight_dtype_; }
  // What this rank holds of the full model.
  const ShardRanges& shard() const { return ranges_; }
  int tp() const { return ranges_.shard.size; }
  // XXH3-128 over config.json, the in-memory weight format, and every
  // tensor's name, dtype, shape and XXH3-64 of its first and last 4 KiB.
  const ModelIdentity& identity() const { return identity_; }
  // Bytes of this rank's weights as held in memory, and what one decode
  // step reads of them (every matrix once, one embedding row).
  size_t WeightBytes() const;
  size_t WeightBytesPerStep() const;

  // See Model::MakeKvSpec.
  KvCacheSpec MakeKvSpec(DType kv_dtype, int32_t block_size, int32_t num_blocks,
                         TpKvLayout layout = TpKvLayout::kHeadSharded) const;
  // See Model::ValidateBatch.
  absl::Status ValidateBatch(const KvCacheSpec& spec, absl::Span<const ForwardSequence> batch) const;

  // This rank's forward over its own pool (KvStorage::Rank) of a batch
  // Model::Forward has checked. With `sync_layer_kv` every rank meets
  // after writing a layer's KV, so that rank 0's on_layer_kv_written sees
  // every rank's.
  absl::StatusOr<ForwardResult> Forward(const KvStorage& kv, absl::Span<const ForwardSequence> batch,
                                        const ForwardOptions& options, bool sync_layer_kv = false);

 private:
  struct Layer;
  ModelShard(ModelConfig config, kernels::Backend* backend);
  // Forward's steps. A step's rows (model_shard.cc): each token's position,
  // KV block and slot, its embedding row, the rows that give logits and
  // the sequences this rank attends for.
  struct StepRows;
  // The RoPE tables and the activation buffers sized for the step, its
  // rows laid out, and the embeddings of its tokens in x_.
  absl::Status BeginStep(const KvStorage& kv, absl::Span<const ForwardSequence> batch, StepRows& rows,
                         ForwardResult& result);
  // Layer `l`'s attention half: norm, QKV, RoPE, the KV written to the
  // pool, attention, and the output projection added to x_.
  absl::Status AttentionHalf(int64_t l, const KvStorage& kv, const StepRows& rows, const ForwardOptions& options,
                             bool sync_layer_kv, ForwardResult& result);
  // Layer `l`'s MLP half, added to x_.
  absl::Status MlpHalf(int64_t l, int64_t rows);
  // The final norm and the LM head over the rows that give logits.
  absl::Status EndStep(const StepRows& rows, ForwardResult& result);
  absl::Status LoadWeights(class Checkpoint& ckpt, DType storage);
  // y += partial: the row-parallel projection's sum over ranks, added to
  // the residual. Unsharded, the projection accumulates into y directly.
  absl::Status RowParallel(const kernels::LinearWeight& w, const float* x, int64_t m, float* y);
  // logits[rows, vocab] from every rank's slice of the LM head over xn_.
  absl::Status GatherLogits(int64_t rows, float* logits);
  // Request-sharded KV (see Model::MakeKvSpec): every head of every row's q/k/v
  // from each rank's q_, k_, v_ into all_q_, all_k_, all_v_; then, after
  // the attention, every row's output from all_attn_, this rank's heads
  // of it into attn_.
  absl::Status GatherAllHeads(int64_t rows);
  absl::Status TakeOwnHeads(int64_t rows);

  ModelConfig config_;
  kernels::Backend* backend_;
  ShardRanges ranges_;
  kernels::Collective* collective_ = nullptr;
  DType weight_dtype_ = DType::kF32;
  ModelIdentity identity_;
  std::vector<Layer> layers_;
  // Rows of this rank's vocabulary slice (all of it unsharded).
  std::unique_ptr<kernels::EmbeddingTable> embed_;  // [vocab slice, hidden]
  kernels::DeviceArray<float> final_norm_;
  std::unique_ptr<kernels::LinearWeight> lm_head_;
  RopeTable rope_;
  // The backend's copies of rope_'s tables, of rope_uploaded_ positions.
  kernels::DeviceArray<float> rope_cos_, rope_sin_;
  int32_t rope_uploaded_ = 0;
  // Scratch in the backend's memory, reused across calls.
  kernels::DeviceArray<float> x_, xn_, qkv_, q_, k_, v_, attn_, gate_up_, act_, partial_, vocab_slices_, logits_;
  // Request-sharded: every head of every row.
  kernels::DeviceArray<float> all_qkv_, all_q_, all_k_, all_v_, all_attn_;
};

}  // namespace pdserve

#endif  // PDSERVE_MODEL_MODEL_SHARD_H_
