// A loaded Llama-family model and its forward pass over the paged KV cache.
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
#ifndef PDSERVE_MODEL_MODEL_H_
#define PDSERVE_MODEL_MODEL_H_

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
#include "kernels/cpu/thread_collective.h"

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

class Model {
 public:
  // Loads DIR/config.json (+ generation_config.json) and the safetensors
  // weights, packing them for `backend` (which must outlive the model).
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& model_dir,
                                                     const ModelOptions& options,
                                                     kernels::Backend* backend);
  // A model of `config`'s shape with random weights made by the backend
  // (uniform, scaled by 1 / sqrt(fan-in); norms of ones, biases of zeros),
  // held as `storage`: benchmarks of shapes no checkpoint is shipped for
  // (an 8B on a GPU is made on the device). Unsharded. Its identity hashes
  // the config, the format and the seed.
  static absl::StatusOr<std::unique_ptr<Model>> CreateRandom(const ModelConfig& config, DType storage,
                                                             uint64_t seed, kernels::Backend* backend);
  ~Model();

  const ModelConfig& config() const { return config_; }
  // The backend the model runs on (its Name() says which kernels).
  const kernels::Backend& backend() const { return *backend_; }
  DType weight_dtype() const { return weight_dtype_; }
  // What rank 0 holds of the full model (everything when unsharded).
  const ShardRanges& shard() const { return ranges_; }
  int tp() const { return ranges_.shard.size; }
  // The ranks' collective group (null when tp == 1): its stats, and a
  // failure to inject in tests.
  kernels::cpu::ThreadCollectiveGroup* tp_group();
  // Identifies these weights as held in memory (for prefix-cache hashes):
  // XXH3-128 over config.json, the in-memory weight format, and every
  // tensor's name, dtype, shape and XXH3-64 of its first and last 4 KiB.
  const ModelIdentity& identity() const { return identity_; }
  // Bytes of all weights as held in memory (all ranks).
  size_t WeightBytes() const;
  // Bytes one decode step reads for the weights (every matrix of every
  // rank once, one embedding row).
  size_t WeightBytesPerStep() const;

  // A KV cache spec matching this model: head-sharded, one pool per rank,
  // each with the rank's KV heads; request-sharded, one pool of every head
  // whose blocks split into one range per rank (num_blocks rounded up to a
  // multiple of the ranks). Sequences of a request-sharded pool are
  // attended by the rank of their range (KvManager::NewSequence(rank)).
  KvCacheSpec MakeKvSpec(DType kv_dtype, int32_t block_size, int32_t num_blocks,
                         TpKvLayout layout = TpKvLayout::kHeadSharded) const;

  // Runs the batch on the KV in `kv`. Never allocates or frees a block: the
  // caller holds every block the batch touches (see ForwardGrowing).
  // Errors: INVALID_ARGUMENT for empty token lists, ids outside the
  // vocabulary, positions past max_position_embeddings, a block table that
  // does not cover the new positions, a KV spec that does not match the
  // model.
  absl::StatusOr<ForwardResult> Forward(const KvStorage& kv, absl::Span<const ForwardSequence> batch,
                                        const ForwardOptions& options = {});
  // Forward's checks of the request itself (everything but the block
  // tables' coverage), so a caller can refuse it before allocating.
  absl::Status ValidateBatch(const KvCacheSpec& spec, absl::Span<const ForwardSequence> batch) const;

 private:
  struct Layer;
  friend class TensorParallelRanks;
  Model(ModelConfig config, kernels::Backend* backend);
  // One rank's model (all of it when shard.size == 1), meeting the other
  // ranks in `collective`.
  static absl::StatusOr<std::unique_ptr<Model>> LoadShard(const std::string& model_dir, const ModelOptions& options,
                                                          kernels::Backend* backend, TpShard shard,
                                                          kernels::Collective* collective);
  // This rank's forward over its own pool (KvStorage::Rank). With
  // `sync_layer_kv` every rank meets after writing a layer's KV, so that
  // rank 0's on_layer_kv_written sees every rank's.
  absl::StatusOr<ForwardResult> ForwardShard(const KvStorage& kv, absl::Span<const ForwardSequence> batch,
                                             const ForwardOptions& options, bool sync_layer_kv = false);
  // ForwardShard's steps. A step's rows (model.cc): each token's position,
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
  size_t ShardWeightBytes() const;
  size_t ShardWeightBytesPerStep() const;
  absl::Status LoadWeights(class Checkpoint& ckpt, DType storage);
  // y += partial: the row-parallel projection's sum over ranks, added to
  // the residual. Unsharded, the projection accumulates into y directly.
  absl::Status RowParallel(const kernels::LinearWeight& w, const float* x, int64_t m, float* y);
  // logits[rows, vocab] from every rank's slice of the LM head over xn_.
  absl::Status GatherLogits(int64_t rows, float* logits);
  // Request-sharded KV (see ForwardShard): every head of every row's q/k/v
  // from each rank's q_, k_, v_ into all_q_, all_k_, all_v_; then, after
  // the attention, every row's output from all_attn_, this rank's heads
  // of it into attn_.
  absl::Status GatherAllHeads(int64_t rows);
  absl::Status TakeOwnHeads(int64_t rows);

  ModelConfig config_;
  kernels::Backend* backend_;
  ShardRanges ranges_;
  kernels::Collective* collective_ = nullptr;
  std::unique_ptr<class TensorParallelRanks> tp_;  // Rank 0 of tp > 1 only.
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

// Grows every sequence of the batch through `kv` for its new tokens (all
// or nothing: RESOURCE_EXHAUSTED before any compute, nothing allocated),
// then runs the forward. The manager's lock is held for the allocation
// only, never across the forward.
absl::StatusOr<ForwardResult> ForwardGrowing(Model& model, KvManager& kv, absl::Span<const ForwardSequence> batch,
                                             const ForwardOptions& options = {});

}  // namespace pdserve

#endif  // PDSERVE_MODEL_MODEL_H_
