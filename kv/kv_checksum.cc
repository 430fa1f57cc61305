#include "kv/kv_checksum.h"

#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <memory>

#include "absl/base/internal/raw_logging.h"

namespace pdserve {

// The hashing runs libxxhash's dispatched variants: the widest vector
// instructions this CPU has (SSE2, AVX2 or AVX-512), chosen at run time.
// Every variant computes the same XXH3-64, so two machines of different
// CPUs agree on a checksum.

uint64_t LayerChecksum(const KvStorage& storage, int32_t layer, absl::Span<const int32_t> table, int32_t first_block,
                       int32_t end_block) {
  if (first_block < 0 || first_block > end_block || end_block > static_cast<int32_t>(table.size())) {
    ABSL_RAW_LOG(FATAL, "LayerChecksum of blocks [%d, %d) of a table of %zu", first_block, end_block, table.size());
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  const size_t bytes = static_cast<size_t>(storage.spec.LayerBlockBytes());
  for (int32_t r = 0; r < storage.spec.num_ranks; ++r) {
    for (int32_t j = first_block; j < end_block; ++j) {
      XXH3_64bits_update_dispatch(state.get(), storage.BlockData(layer, BlockId{table[j]}, r), bytes);
    }
  }
  return XXH3_64bits_digest(state.get());
}

uint64_t BytesChecksum(const void* data, int64_t bytes) {
  return XXH3_64bits_dispatch(data, static_cast<size_t>(bytes));
}

}  // namespace pdserve
