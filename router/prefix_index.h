// The router's picture of every worker's prefix cache, kept from the KV
// events the workers report (kv/kv_events.h), for prefix-aware routing.
//
// Per worker (keyed by address) it holds the set of block hashes stored
// there. A prompt's blocks are hashed the same way (kv/block_hash.h:
// each hash chains its predecessor), so the worker's cached prefix of a
// prompt is the longest run of the prompt's hashes, from the first, that
// the set holds; matching stops at the first miss, as the worker's own
// lookup does.
//
// Events arrive in id order. A gap (ids out of order, or a new process at
// the same address answering a request for the old one's ids) empties the
// worker's entry and asks for everything again (NextAfter() returns 0; the
// worker then replays its log or sends a snapshot).
//
// Between a routing decision and the worker's events for it (up to a probe
// period, and the prefill's own time), the router records the prompt's
// blocks as expected on the chosen worker until a deadline, so a burst of
// requests sharing a prefix follows the first one instead of spreading.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_PREFIX_INDEX_H_
#define PDSERVE_ROUTER_PREFIX_INDEX_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/kv_events.h"

namespace pdserve::router {

class PrefixIndex {
 public:
  // The event id to ask `worker` for events after (0: from the start).
  uint64_t NextAfter(const std::string& worker) const;

  // Applies a batch `worker` (process `instance`) sent in answer to a read
  // after NextAfter(worker). A snapshot replaces what was known.
  void Apply(const std::string& worker, uint64_t instance, absl::Span<const KvEvent> events, bool snapshot,
             uint64_t last_id);

  // Forgets `worker` (it died, was ejected or left the pool).
  void Drop(const std::string& worker);

  // How many leading blocks of `chain` (a prompt's block hashes, first
  // block first) `worker` holds or is expected to hold at `now`.
  int32_t MatchBlocks(const std::string& worker, absl::Span<const BlockHash> chain, absl::Time now) const;

  // `worker` was sent a prompt with these blocks at `now`: count them as
  // held for `ttl` unless its events say otherwise sooner.
  void Expect(const std::string& worker, absl::Span<const BlockHash> chain, absl::Time now, absl::Duration ttl);

  // Blocks known stored on `worker` (expected ones not counted).
  int64_t NumBlocks(const std::string& worker) const;

 private:
  struct Entry {
    uint64_t instance = 0;
    uint64_t last_id = 0;
    absl::flat_hash_set<BlockHash> blocks;
    absl::flat_hash_map<BlockHash, absl::Time> expected;
  };

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_PREFIX_INDEX_H_
