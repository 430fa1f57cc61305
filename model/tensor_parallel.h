// How a model is cut across the ranks of a tensor-parallel worker (DESIGN.md
// fact 12): query heads and the MLP's intermediate dimension split into
// contiguous ranges (column-parallel q/k/v, gate and up; row-parallel o and
// down), KV heads split with their query groups, or replicated when ranks
// outnumber KV heads, and the vocabulary (embedding and LM head) split into
// equal chunks (the last one shorter).
//
// Rules (INVALID_ARGUMENT otherwise, naming the model and the rank count):
// num_heads % N == 0, and N % num_kv_heads == 0 or num_kv_heads % N == 0,
// and N <= intermediate_size, and every rank gets part of the vocabulary.
//
// Per-rank KV bytes per position: c_kv * kv_heads_per_rank / num_kv_heads
// = c_kv / min(N, num_kv_heads), what `pdctl plan` computes for the shape.
#ifndef PDSERVE_MODEL_TENSOR_PARALLEL_H_
#define PDSERVE_MODEL_TENSOR_PARALLEL_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "model/model_config.h"

namespace pdserve {

// A half-open range [begin, end).
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  friend bool operator==(IndexRange a, IndexRange b) { return a.begin == b.begin && a.end == b.end; }
};

// Where a tensor-parallel model keeps the KV (DESIGN.md fact 12): each
// rank the heads it computes (head-sharded), or each rank whole requests,
// every head, attending for them alone (request-sharded, for decode: the
// ranks exchange the new rows' q/k/v and the attention outputs).
enum class TpKvLayout { kHeadSharded, kRequestSharded };

struct TpShard {
  int rank = 0;
  int size = 1;
};

struct ShardRanges {
  TpShard shard;
  IndexRange q_heads;
  IndexRange kv_heads;     // One head when ranks outnumber KV heads.
  int64_t kv_copies = 1;   // Ranks holding each KV head.
  IndexRange ffn;          // Of intermediate_size.
  IndexRange vocab;        // Of vocab_size.
  int64_t vocab_chunk = 0; // ceil(vocab / N): every rank's gathered slot.
};

absl::StatusOr<ShardRanges> ComputeShardRanges(const ModelConfig& config, TpShard shard);

}  // namespace pdserve

#endif  // PDSERVE_MODEL_TENSOR_PARALLEL_H_
