// The compatibility descriptor both sides of a KV handoff compare before any
// byte moves: protocol version, model identity, layers, KV heads, head dim,
// KV dtype, block size, layout, and the tensor-parallel layout (ranks and
// KV heads per rank: each rank's heads follow from them, KvCacheSpec).
//
// Everything must match except the block size and the tensor-parallel
// layout: when those differ, the receiver describes its layout (in the
// reserve answer) and the sender writes in that layout
// (kv_transfer/layout_copy.h): each receiver rank gets its heads from a
// rank of the sender that holds them, several sender ranks feeding one
// receiver rank or one feeding several. A mismatch that cannot be
// converted is refused with FAILED_PRECONDITION naming the field and both
// layouts.
//
// Thread safety: plain values and pure functions.
#ifndef PDSERVE_KV_TRANSFER_DESCRIPTOR_H_
#define PDSERVE_KV_TRANSFER_DESCRIPTOR_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kv/block_hash.h"
#include "base/dtype.h"
#include "kv/kv_cache.h"

namespace pdserve::kv {

// 2: frequency_penalty in the sampling state; 3: the tensor-parallel layout;
// 4: the router's grant in a reservation (grant.h); 5: the prefix cache
// salt in a commit; 6: RoomFreed (wire.h); 7: verification asked in a
// reservation's answer, per-layer checksums in a commit; 8: the response
// format's hash and state digest in a commit.
inline constexpr uint32_t kKvProtocolVersion = 8;

// The in-block arrangement of kv/kv_cache.h: K [head][dim][slot], V
// [head][slot][dim], then for int8 F32 scales [K|V][head][slot], per rank
// pool (head-sharded tensor parallelism). A request-sharded layout will get
// a new value.
enum class KvLayout : uint8_t { kPagedKTransposedV1 = 1 };

struct KvLayoutDescriptor {
  uint32_t protocol_version = kKvProtocolVersion;
  ModelIdentity model;
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;  // The model's.
  int32_t head_dim = 0;
  DType dtype = DType::kF32;
  int32_t block_size = 0;
  KvLayout layout = KvLayout::kPagedKTransposedV1;
  int32_t tp = 1;                 // Rank pools (KvCacheSpec::num_ranks).
  int32_t kv_heads_per_rank = 0;  // 0: num_kv_heads (one rank).

  static KvLayoutDescriptor FromSpec(const KvCacheSpec& spec, const ModelIdentity& model);
  // The spec of a pool in this layout (num_blocks left to the caller).
  KvCacheSpec ToSpec(int32_t num_blocks) const;
  std::string DebugString() const;
};

// OK when a sender with `sender` can write into a receiver with `receiver`:
// all fields equal except possibly the block size and the tensor-parallel
// layout (each side's a valid one).
absl::Status CheckCompatible(const KvLayoutDescriptor& sender, const KvLayoutDescriptor& receiver);

// True when blocks can be copied as they are (same block size and
// tensor-parallel layout); otherwise the sender packs the receiver's layout.
bool SameBlockLayout(const KvLayoutDescriptor& a, const KvLayoutDescriptor& b);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_DESCRIPTOR_H_
