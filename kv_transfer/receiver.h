// The decode side of the KV handoff: answers reservations with blocks of its
// pool, lets the sender write them, and hands a committed sequence to its
// owner.
//
// Per handoff:  reserve ─▶ active ─(commit)─▶ handed to the owner
//                           │  ├─(sender abort, or sender dead)─▶ freed
//                           │  └─(lease expired / Abort())─▶ quarantined
//                           │        ─(sender AbortAck, or sender dead)─▶ freed
// A one-sided write cannot be refused, so blocks of a handoff the receiver
// gave up on are never handed to anyone else until the sender has
// acknowledged (after flushing its puts) or its connection has failed.
// The lease is renewed by every LayerSent message on the reserving
// connection, never past the grant's expiry. Handoff ids are drawn at
// random (64 bits from the system's CSPRNG), so a peer cannot name another
// connection's handoff by counting.
//
// Prefix: the receiver hashes the prompt with its own block size and
// BlockHasher (model identity, KV dtype) and attaches the longest cached
// full-block prefix; those positions are not sent. On commit the full
// blocks are published to the prefix cache.
//
// Errors returned to the sender: UNAVAILABLE while draining, FAILED_PRECONDITION for an incompatible
// layout (naming the field), RESOURCE_EXHAUSTED for a reservation larger
// than the free pool (the connection is then sent RoomFreed once KV frees,
// so a sender that waits for room is woken, not polling), NOT_FOUND for a commit of an unknown handoff id,
// FAILED_PRECONDITION for a commit of an expired or aborted one,
// INVALID_ARGUMENT for a commit that does not fit the reservation.
//
// Thread safety: protocol work runs on the transport's loop thread. KV
// blocks are reserved, published and given back through the KV manager,
// whose lock covers bookkeeping only: the loop thread never waits for a
// forward. stats()/metrics() may be read from any thread. The committed
// callback runs on the loop thread without locks, before the sender's
// commit is answered: a sender that sees its commit succeed knows the
// owner has the sequence.
// Lifetime: destroy the receiver before the transport; it must outlive
// every connection's traffic (Shutdown() stops accepting it).
#ifndef PDSERVE_KV_TRANSFER_RECEIVER_H_
#define PDSERVE_KV_TRANSFER_RECEIVER_H_

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kv/kv_manager.h"
#include "kernels/backend.h"
#include "kv_transfer/descriptor.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/metrics.h"
#include "kv_transfer/transport.h"
#include "kv_transfer/wire.h"

namespace pdserve::kv {

struct ReceiverOptions {
  ModelIdentity model;
  absl::Duration lease = absl::Seconds(5);
  // A quarantined handoff whose sender neither acknowledges the abort nor
  // disconnects within this (a cut link: TCP may take many minutes to
  // notice) has its connection failed, which frees every handoff on it.
  absl::Duration quarantine_timeout = absl::Seconds(30);
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  // Set when the pool is in this backend's memory (a GPU's), which the
  // transport cannot write: senders put into a landing pool of
  // `landing_blocks` blocks of registered host memory, and a commit copies
  // the request's new blocks through the backend's uploader into the pool
  // before the sequence is handed on (or its prefix published).
  kernels::Backend* pool_backend = nullptr;
  int32_t landing_blocks = 0;
  // Handoff grants (grant.h). With a key, a reservation is honoured only
  // with a grant minted with it, for this receiver (SetAddress), unexpired,
  // from the host it names (SenderMatches), and not used before for its
  // (request id, attempt); the commit must come on the reserving connection
  // and name the grant's request. Refusals are counted by reason.
  std::shared_ptr<const GrantKey> grant_key;
  // Lets writes that arrive as messages land anywhere in the pool (see
  // MayWrite): for bench-kv's raw-put probe only, never in a server.
  bool writes_outside_reservations = false;
  // The share of handoffs whose KV is verified (0: none, 1: every one; in
  // between, each reservation is chosen at random with this chance): the
  // reservation's answer asks the sender for per-layer checksums, and the
  // commit hands them on with the sequence (CommittedSequence::verify),
  // unpublished, for its consumer to check before the blocks are used. A
  // device pool's handoffs are never verified (the pool is not
  // host-readable).
  double verify_fraction = 0;
};

struct CommittedSequence {
  HandoffId id;
  SequenceKv kv;  // The reservation's blocks, owned from now on by whoever holds this.
  Commit state;   // Tokens, first token, sampling state, stop state.
  // Verification asked for (state.layer_checksums holds one checksum per
  // layer of blocks [first_block, end_block) of kv's table): the blocks are
  // not published to the prefix cache, and must not be used until they
  // are checked (kv/kv_checksum.h). `producer`: the sender's host.
  bool verify = false;
  int32_t first_block = 0;
  int32_t end_block = 0;
  std::string producer;
};

class KvReceiver final : public ConnectionHandler {
 public:
  using CommittedCallback = std::function<void(CommittedSequence)>;

  // REQUIRES: `kv`'s region was allocated from transport->region_allocator();
  // `kv` outlives the receiver.
  static absl::StatusOr<std::unique_ptr<KvReceiver>> Create(Transport* transport, KvManager* kv,
                                                            ReceiverOptions options,
                                                            CommittedCallback on_committed);
  ~KvReceiver() override;

  absl::StatusOr<int> Listen(const std::string& host, int port);

  // Draining: every later reservation is refused with UNAVAILABLE (the
  // sender's request goes to another decode worker); open handoffs finish.
  void StopAccepting() { accepting_.store(false); }

  // Gives up on an active handoff (quarantines it until the sender acks).
  void Abort(HandoffId id, absl::Status why);
  // Runs the lease check now (tests with a fake clock); it also runs on
  // the transport's loop when the earliest lease or quarantine deadline
  // passes (by `clock`'s reading when the deadline was set).
  void CheckLeases();

  struct Stats {
    int32_t active = 0;
    int32_t quarantined = 0;
    int32_t quarantined_blocks = 0;
    int32_t landing_blocks_used = 0;  // A device pool's landing blocks held by handoffs.
  };
  Stats stats() const;
  KvTransferStats metrics() const { return metrics_.Snapshot(); }
  // Refusals of reservations and commits by reason (GrantRefusalName).
  int64_t refusals(GrantRefusal why) const { return refusals_[static_cast<int>(why)].load(); }
  // This receiver's address as the router names it (grants must name it).
  void SetAddress(std::string address);
  const KvLayoutDescriptor& layout() const { return layout_; }

  void OnMessage(Connection& c, std::string message) override;
  void OnDisconnected(Connection& c, absl::Status why) override;
  // Writes that arrive as messages (UCX over TCP) land only in the blocks
  // an active reservation of the same connection is to receive (not its
  // held prefix); others are dropped and counted (put_outside_reservation).
  // A write must fall within one reservation's blocks; those blocks are
  // not freed while it lands (WriteLanded).
  bool MayWrite(Connection& c, const void* dst, size_t bytes) override;
  void WriteLanded(Connection& c, const void* dst, size_t bytes) override;

 private:
  // kReleasing: given up, but writes allowed into its blocks are still
  // landing (WriteLanded); its blocks are freed when the last one lands.
  enum class State { kActive, kQuarantined, kReleasing };
  struct Handoff {
    Connection* conn = nullptr;
    State state = State::kActive;
    SequenceKv kv;       // The reservation (blocks the sender writes, unless landing).
    SequenceKv landing;  // A device pool: where the sender writes them instead.
    int32_t held_positions = 0;
    int32_t reserved_positions = 0;
    absl::Time start;
    absl::Time deadline;  // Active: the lease; quarantined: when to give up on the sender.
    // With a grant key: the grant's request (the commit must name it), its
    // context's digest (the commit's tokens must match it) and its expiry
    // (no lease runs past it).
    std::string request_id;
    std::optional<TokensDigest> tokens_digest;
    absl::Time grant_expires = absl::InfiniteFuture();
    CacheSalt cache_salt;  // The reservation's: its commit publishes under it.
    bool verify = false;   // Its answer asked for checksums.
    int32_t writes_landing = 0;  // Allowed by MayWrite, not yet WriteLanded.
    // A commit that came while writes were landing (UCX's rendezvous can
    // tell the sender its write is done before it tells the receiver):
    // taken when the last one lands.
    std::optional<Commit> pending_commit;
  };

  KvReceiver(Transport* transport, KvManager* kv, ReceiverOptions options, CommittedCallback on_committed,
             std::string region);
  // A device pool: the landed blocks of positions [from, to) into the pool.
  absl::Status Land(const Handoff& h, int32_t from, int32_t to);

  void HandleReserve(Connection& c, const ReserveRequest& m);
  // Room: the pool's blocks, or a device pool's landing blocks.
  enum Room { kPoolRoom = 0, kLandingRoom = 1 };
  // `c` is refused for lack of `room`; `frees_before` is that room's
  // free count as read before the attempt to reserve: a free since then
  // is told of at once, a later one by the free listener.
  void WantRoom(Connection& c, Room room, uint64_t frees_before);
  // Sends RoomFreed to each connection waiting for `room` (loop thread).
  void NotifyRoom(Room room);
  // A free listener of the manager holding `room`'s blocks.
  void Freed(Room room);
  // With a grant key: the grant, checked against the reservation, or the
  // refusal.
  absl::StatusOr<Grant> CheckGrant(Connection& c, const ReserveRequest& m);
  void Refused(GrantRefusal why) { ++refusals_[static_cast<int>(why)]; }
  void HandleCommit(Connection& c, Commit& m);
  void HandleAbort(Connection& c, const kv::Abort& m);
  // Frees the handoff's blocks, or, while writes into them are landing,
  // marks it kReleasing (the last WriteLanded frees them).
  void Free(HandoffId id);
  void Quarantine(HandoffId id, absl::Status why);
  void ExpireLeases();
  // Loop thread: has the lease check run once `deadline` passes, unless
  // one is due before it. A renewal moves a deadline later only, so a
  // check that finds nothing expired arms the next one (ArmNextDeadline).
  void ArmDeadline(absl::Time deadline);
  void ArmNextDeadline();

  Transport* transport_;
  KvManager* kv_;
  ReceiverOptions options_;
  CommittedCallback on_committed_;
  KvLayoutDescriptor layout_;
  // A device pool's landing pool (registered host memory) and uploader;
  // declared before the handoffs that hold its blocks.
  std::unique_ptr<KvManager> landing_;
  std::unique_ptr<kernels::BackendUploader> uploader_;
  std::string region_;  // Packed once: the landing pool's, or the pool's.
  KvTransferMetrics metrics_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // For the ticker and posted work.
  // Per Room: frees seen, whether a connection waits (the free listener
  // posts NotifyRoom only then), and the listener's handle.
  std::array<std::atomic<uint64_t>, 2> frees_{};
  std::array<std::atomic<bool>, 2> room_wanted_{};
  std::array<int, 2> free_listeners_ = {-1, -1};
  absl::Time check_at_ = absl::InfiniteFuture();  // the armed lease check (loop thread)
  absl::BitGen bitgen_;  // Which handoffs are verified (loop thread).
  std::atomic<bool> accepting_{true};

  // Loop thread only, but read by stats().
  mutable absl::Mutex mu_;
  absl::flat_hash_map<HandoffId, Handoff> handoffs_ ABSL_GUARDED_BY(mu_);
  std::string address_ ABSL_GUARDED_BY(mu_);
  // Grants honoured, by (request id, attempt), until they expire (unix ms).
  absl::flat_hash_map<std::pair<std::string, uint32_t>, int64_t> used_grants_ ABSL_GUARDED_BY(mu_);
  int64_t next_grant_prune_ms_ ABSL_GUARDED_BY(mu_) = 0;
  std::array<std::atomic<int64_t>, kGrantRefusalKinds> refusals_{};
  // Block (of the pool senders write: the landing pool, or the pool) ->
  // the reservation it was last given to; MayWrite checks that one is
  // active and on the writing connection.
  absl::flat_hash_map<int32_t, HandoffId> writable_ ABSL_GUARDED_BY(mu_);
  // Writes landing, by (connection, destination): their handoff and how
  // many of them.
  absl::flat_hash_map<std::pair<const Connection*, uintptr_t>, std::pair<HandoffId, int32_t>> landing_writes_
      ABSL_GUARDED_BY(mu_);
  // The connections refused a reservation for lack of each Room since it
  // last freed.
  std::array<absl::flat_hash_set<Connection*>, 2> wants_room_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_RECEIVER_H_
