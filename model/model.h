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
// The weights and the forward are one rank's (model/model_shard.h); with
// tensor parallelism the model holds rank 0 and the other ranks
// (model/tensor_parallel_ranks.h), and Forward runs them all.
//
// Thread safety: Forward is single-caller (it reuses scratch buffers); the
// backend parallelises inside.
#ifndef PDSERVE_MODEL_MODEL_H_
#define PDSERVE_MODEL_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/kv_cache.h"
#include "kv/kv_manager.h"
#include "model/model_shard.h"
#include "kernels/backend.h"
#include "kernels/cpu/thread_collective.h"

namespace pdserve {

class TensorParallelRanks;

class Model {
 public:
  // Loads DIR/config.json (+ generation_config.json) and the safetensors
  // weights, packing them for `backend` (which must outlive the model);
  // with options.tp > 1, rank 0 here and the others on their backends.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& model_dir, const ModelOptions& options,
                                                     kernels::Backend* backend);
  // A model of `config`'s shape with random weights (ModelShard::CreateRandom):
  // benchmarks of shapes no checkpoint is shipped for (an 8B on a GPU is
  // made on the device). Unsharded.
  static absl::StatusOr<std::unique_ptr<Model>> CreateRandom(const ModelConfig& config, DType storage, uint64_t seed,
                                                             kernels::Backend* backend);
  ~Model();

  const ModelConfig& config() const { return rank0_->config(); }
  // The backend the model runs on (its Name() says which kernels).
  const kernels::Backend& backend() const { return rank0_->backend(); }
  DType weight_dtype() const { return rank0_->weight_dtype(); }
  // What rank 0 holds of the full model (everything when unsharded).
  const ShardRanges& shard() const { return rank0_->shard(); }
  int tp() const { return rank0_->tp(); }
  // The ranks' collective group (null when tp == 1): its stats, and a
  // failure to inject in tests.
  kernels::cpu::ThreadCollectiveGroup* tp_group();
  // Identifies these weights as held in memory (for prefix-cache hashes).
  const ModelIdentity& identity() const { return rank0_->identity(); }
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
                         TpKvLayout layout = TpKvLayout::kHeadSharded) const {
    return rank0_->MakeKvSpec(kv_dtype, block_size, num_blocks, layout);
  }

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
  absl::Status ValidateBatch(const KvCacheSpec& spec, absl::Span<const ForwardSequence> batch) const {
    return rank0_->ValidateBatch(spec, batch);
  }

 private:
  Model(std::unique_ptr<TensorParallelRanks> ranks, std::unique_ptr<ModelShard> rank0);

  std::unique_ptr<TensorParallelRanks> ranks_;  // tp > 1 only: ranks 1..N-1 and the group
  std::unique_ptr<ModelShard> rank0_;           // destroyed first: it meets the others in ranks_' group
};

// Grows every sequence of the batch through `kv` for its new tokens (all
// or nothing: RESOURCE_EXHAUSTED before any compute, nothing allocated),
// then runs the forward. The manager's lock is held for the allocation
// only, never across the forward.
absl::StatusOr<ForwardResult> ForwardGrowing(Model& model, KvManager& kv, absl::Span<const ForwardSequence> batch,
                                             const ForwardOptions& options = {});

}  // namespace pdserve

#endif  // PDSERVE_MODEL_MODEL_H_
