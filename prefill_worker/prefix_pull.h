// Prefixes fetched from the prefill worker that holds them, both ends.
//
// The router, about to send a prefill to worker B whose prefix cache lacks
// a prefix that worker A holds, asks A (PushPrefix) to send it; A's
// PrefixPusher pins the cached blocks, reserves on B's pull receiver,
// streams every layer of them and commits: an ordinary KV handoff of the
// prefix alone, under a grant the router minted for the pull, for which
// B's receiver always asks per-layer checksums. B's AcceptPulledPrefix
// checks them and publishes the blocks in its own prefix cache (where the
// prefill that follows finds them), or, on a mismatch, discards them,
// counts and logs it (the prefix is then computed, as without the pull).
//
// Only cached whole blocks travel: a pull never waits for a forward on
// either side, and A's engine goes on meanwhile (its pool's blocks are
// pinned, not copied). Where A's pool stops short of the prefix and its
// second tier holds the next blocks, they are read back (and checked)
// into blocks taken for this push alone and sent from there, unpublished
// on A. Device pools do not pull (their receivers cannot check
// the landed bytes on the host).
//
// Thread safety: PrefixPusher::Push is thread-safe (pushes run one at a
// time); AcceptPulledPrefix runs on the pull receiver's loop thread.
#ifndef PDSERVE_PREFILL_WORKER_PREFIX_PULL_H_
#define PDSERVE_PREFILL_WORKER_PREFIX_PULL_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kv/kv_manager.h"
#include "kv/tier2_store.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/sender.h"
#include "model/model.h"
#include "pdserve/v1/worker.pb.h"

namespace pdserve::prefill {

// The sending side's counters (metrics and status).
struct PushCounters {
  std::atomic<int64_t> pushed{0};       // Pushes committed.
  std::atomic<int64_t> failed{0};       // Pushes that ended without a commit.
  std::atomic<int64_t> empty{0};        // Asked for a prefix not cached here.
  std::atomic<int64_t> bytes{0};        // KV bytes sent.
  std::atomic<int64_t> positions{0};    // Positions sent.
  std::atomic<int64_t> tier2_blocks{0};  // Of them, blocks read back from the second tier to be sent.
};

class PrefixPusher {
 public:
  // REQUIRES: everything outlives the pusher; `sender` reads `kv`'s pool;
  // `tier2` (null: none) is the pool's second tier.
  PrefixPusher(const ModelIdentity& model, KvManager* kv, kv::KvSender* sender, Tier2Store* tier2 = nullptr)
      : model_(model), kv_(kv), sender_(sender), tier2_(tier2) {}

  // Sends the longest cached prefix of the request's tokens (whole blocks)
  // to its receiver and returns what was sent. A prefix not cached here
  // answers positions 0 (nothing to send is not an error). Errors:
  // INVALID_ARGUMENT (a bad address), and the handoff's (UNAVAILABLE: the
  // receiver is gone; PERMISSION_DENIED: the grant was refused;
  // RESOURCE_EXHAUSTED: no room there; DEADLINE_EXCEEDED).
  absl::StatusOr<worker::v1::PushPrefixResponse> Push(const worker::v1::PushPrefixRequest& req);
  const PushCounters& counters() const { return counters_; }

 private:
  const ModelIdentity model_;
  KvManager* const kv_;
  kv::KvSender* const sender_;
  Tier2Store* const tier2_;
  PushCounters counters_;
  absl::Mutex mu_;  // One push at a time; held across it.
  kv::ReceiverConnections connections_ ABSL_GUARDED_BY(mu_) = kv::ReceiverConnections(sender_);
};

// The receiving side's counters.
struct PullCounters {
  std::atomic<int64_t> received{0};          // Pulls checked and published.
  std::atomic<int64_t> positions{0};         // Their positions (held ones included).
  std::atomic<int64_t> checksum_failures{0};  // Pulls whose KV failed its check.
};

// The pull receiver's committed callback: checks `c`'s KV against its
// producer's per-layer checksums, then publishes its whole blocks in
// `kv`'s prefix cache (they stay there as any cached prefix does) or
// discards them, and gives the reservation back either way.
void AcceptPulledPrefix(KvManager* kv, const ModelIdentity& model, kv::CommittedSequence c, PullCounters* counters);

}  // namespace pdserve::prefill

#endif  // PDSERVE_PREFILL_WORKER_PREFIX_PULL_H_
