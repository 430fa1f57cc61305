// Staging a KV handoff through pinned host memory, for a pool in device
// memory that the transport cannot reach (UCX without a CUDA transport).
//
// Sending (prefill):
//   compute thread, as the forward finishes a layer:
//     ring->StageLayer(request, layer, {device ranges of the layer's blocks});
//   UCX sender thread:
//     StagedLayer s = ring->NextReady(timeout);   // copy finished, in stage order
//     Put(s.host, s.bytes, ...) ... when the put completed: ring->Release(s.slot);
// Receiving (decode):
//   network side:  s = ring->TakeSlot(request, layer);  the layer lands in s.host;
//                  ring->UnstageLayer(s.slot, {device ranges of the pool's blocks});
//   decode engine: s = ring->NextReady(timeout);  // the layer is in the pool now
//                  ring->Release(s.slot);
//
// A ring has `num_slots` (K) slots of `slot_bytes`, one layer of the
// largest request each (blocks_per_request * LayerBlockBytes() of one
// rank), carved from one region of the caller's allocator (the transport's
// registered memory; cudaHostAlloc'd on a GPU). A slot is, in turn: free
// -> copying (its copy enqueued on the DeviceCopier) -> held (by the
// consumer, or, receiving, by the network side before its copy) -> free.
//
// Guarantees:
//   - NextReady/PollReady hand out a layer only after its copy finished,
//     and strictly in the order the copies were enqueued (StageLayer /
//     UnstageLayer calls), so the layers of one request go out in the
//     order they were staged.
//   - Backpressure: with all K slots taken, StageLayer/TakeSlot wait for a
//     Release, at most `slot_timeout` (then DEADLINE_EXCEEDED naming the
//     request and what holds the slots), and stop waiting at once when the
//     request is abandoned, a copy failed, or the ring is closed.
//   - Release may come in any order (puts complete in any order); a
//     release of a slot the caller does not hold (twice, or a stale
//     handle) is refused with FAILED_PRECONDITION and changes nothing.
//   - Abandon(request): its layers not yet handed out are dropped (the
//     consumer never sees them), its slots already handed out stay their
//     holder's until Release, and later StageLayer/TakeSlot calls for it
//     are refused with ABORTED (until Forget). It
//     returns once no copy of the request is in flight, so the caller may
//     then free or reuse the request's device blocks.
//   - A failed copy fails its layer and, the copier being in order, every
//     later one: NextReady returns the error (naming request and layer)
//     for each queued layer, then for every call; StageLayer, TakeSlot
//     and UnstageLayer return it too. Nothing waits on a dead copier.
//
// Thread safety: every method may be called from any thread, except that
// NextReady and PollReady are called by one consumer thread at a time. The
// ring's lock is never held across a DeviceCopier::Wait that may block;
// Enqueue and Done are called under it.
// Lifetime: the copier and the allocator outlive the ring. Destroy the ring
// when no call is in progress and no held slot is still read or written
// (its UCX puts completed); the destructor waits for copies in flight.
#ifndef PDSERVE_KV_TRANSFER_KV_STAGING_H_
#define PDSERVE_KV_TRANSFER_KV_STAGING_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/engine/request.h"
#include "common/kv_cache.h"

namespace pdserve::kv {

enum class CopyDirection { kDeviceToHost, kHostToDevice };

// One contiguous copy; which side is device memory depends on the direction.
struct CopyRange {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;
};

struct CopyTicket {
  uint64_t value = 0;
};

// Asynchronous copies between device and host memory that complete in the
// order they were enqueued, like the copies on one CUDA stream. The CUDA
// implementation lives with the CUDA backend; tests use a fake.
//
// Errors are sticky: a failed copy fails its ticket and every ticket
// enqueued after it, which complete without copying.
// Thread safety: all methods from any thread, concurrently. Enqueue and
// Done must not block on the copies (the ring calls them under its lock).
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  // Enqueues the copies of `ranges` behind every earlier-enqueued copy.
  // The memory of the ranges stays valid and unchanged by others until
  // the ticket is Done. An enqueue that fails is reported by its ticket.
  virtual CopyTicket Enqueue(CopyDirection direction, absl::Span<const CopyRange> ranges) = 0;
  // Whether the ticket's copies finished (or failed). Does not block.
  virtual bool Done(CopyTicket ticket) = 0;
  // Blocks until Done(ticket); OK, or the error that failed it.
  virtual absl::Status Wait(CopyTicket ticket) = 0;
};

// Memory a layer is copied from or to: device memory (host memory for the
// CPU backend and the tests).
struct DeviceRange {
  void* address = nullptr;
  int64_t bytes = 0;
};

// Names a slot for one use: `use` changes every time the slot is taken,
// so a stale handle cannot release the slot's next user.
struct StagingSlot {
  int32_t index = -1;
  uint64_t use = 0;
};

// A slot handed out: to the consumer, with its layer's bytes in `host`; or,
// receiving, to the network side to fill (`bytes` is then the capacity).
struct StagedLayer {
  StagingSlot slot;
  engine::RequestId request;
  int32_t layer = -1;
  char* host = nullptr;  // [bytes], pinned (from the ring's allocator)
  int64_t bytes = 0;
};

struct KvStagingOptions {
  // kDeviceToHost: a sending ring (StageLayer). kHostToDevice: a receiving
  // ring (TakeSlot, UnstageLayer).
  CopyDirection direction = CopyDirection::kDeviceToHost;
  int32_t num_slots = 2;
  int64_t slot_bytes = 0;  // One layer of the largest request, one rank.
  // How long StageLayer/TakeSlot wait for a free slot before giving up.
  absl::Duration slot_timeout = absl::Seconds(10);
};

struct KvStagingStats {
  int64_t layers_staged = 0;     // Copies enqueued (either direction).
  int64_t bytes_staged = 0;      // Their bytes.
  int64_t layers_delivered = 0;  // Handed to the consumer, copy finished.
  int64_t layers_abandoned = 0;  // Dropped by Abandon before the consumer saw them.
  int64_t copy_failures = 0;     // Layers whose copy failed.
  int64_t slot_waits = 0;        // Slot requests that found every slot taken.
  int64_t slot_timeouts = 0;
  // Time callers (the compute thread, sending) were blocked for a free slot.
  absl::Duration slot_wait_time = absl::ZeroDuration();
  // Time the consumer was blocked on copies not yet finished: the copy
  // time the pipeline did not hide.
  absl::Duration copy_wait_time = absl::ZeroDuration();
  // Sum over delivered layers of enqueue -> completion seen by the ring (an
  // upper bound of the copy time: a consumer that polls late adds to it).
  absl::Duration copy_latency = absl::ZeroDuration();
  int32_t free_slots = 0;        // Now.
  int32_t waiting_for_slot = 0;  // Now: callers blocked for a free slot.

  std::string ToString() const;
};

class KvStagingRing {
 public:
  // Allocates num_slots * slot_bytes (each slot rounded up to 4 KiB) from
  // `allocator`. INVALID_ARGUMENT for a bad shape; the allocator's error.
  static absl::StatusOr<std::unique_ptr<KvStagingRing>> Create(const KvStagingOptions& options, DeviceCopier* copier,
                                                               KvRegionAllocator* allocator);
  ~KvStagingRing();
  KvStagingRing(const KvStagingRing&) = delete;
  KvStagingRing& operator=(const KvStagingRing&) = delete;

  // Sending. Takes a free slot (waiting as above) and enqueues the copies
  // of `sources`, packed in order from the slot's start; returns without
  // waiting for them. INVALID_ARGUMENT when they exceed slot_bytes;
  // DEADLINE_EXCEEDED, ABORTED (abandoned), the copy error, or the Close
  // status when no slot was taken. REQUIRES: a sending ring; `sources`
  // valid and unchanged until the layer is handed out, abandoned, or the
  // ring destroyed.
  absl::Status StageLayer(const engine::RequestId& request, int32_t layer, absl::Span<const DeviceRange> sources);

  // Receiving. Takes a free slot for the layer to land in (waiting and
  // failing as StageLayer). REQUIRES: a receiving ring.
  absl::StatusOr<StagedLayer> TakeSlot(const engine::RequestId& request, int32_t layer);
  // The layer has landed in `slot`: enqueues the copies of its first
  // sum(bytes) bytes, in order, to `destinations`. On any error but
  // FAILED_PRECONDITION (a slot the caller does not hold) the slot is
  // given back. REQUIRES: a receiving ring; `destinations` valid and not
  // touched by others until the layer is handed out, abandoned, or the
  // ring destroyed.
  absl::Status UnstageLayer(StagingSlot slot, absl::Span<const DeviceRange> destinations);

  // Consumer. The oldest enqueued layer once its copy finished: waits up
  // to `timeout` for one to be enqueued (then DEADLINE_EXCEEDED), then
  // for its copy. The slot is the caller's until Release.
  absl::StatusOr<StagedLayer> NextReady(absl::Duration timeout);
  // As NextReady without blocking: nullopt when the oldest layer's copy
  // has not finished (or nothing is staged).
  absl::StatusOr<std::optional<StagedLayer>> PollReady();

  // Gives back a slot from NextReady/PollReady (its put completed) or from
  // TakeSlot (not to be unstaged). Any order.
  absl::Status Release(StagingSlot slot);

  // The request's handoff failed; see the header comment. `why` is quoted
  // in the refusals. Blocks only for the request's copies in flight.
  void Abandon(const engine::RequestId& request, const absl::Status& why);
  // Forgets that `request` was abandoned (when its producer will stage
  // nothing more for it), so the ring keeps no entry per failed request
  // and the id may be staged afresh.
  void Forget(const engine::RequestId& request);

  // Shutdown: waiters wake and every later StageLayer, TakeSlot,
  // UnstageLayer, NextReady and PollReady returns `why` (CANCELLED if OK).
  // Held slots may still be released.
  void Close(absl::Status why);

  KvStagingStats stats() const;
  const KvStagingOptions& options() const { return options_; }

 private:
  // kFilling: taken by TakeSlot, not yet unstaged. kDraining: dropped by
  // Abandon while its copy was in flight.
  enum class SlotState { kFree, kFilling, kCopying, kHeld, kDraining };
  struct Slot {
    SlotState state = SlotState::kFree;
    uint64_t use = 0;
    engine::RequestId request;
    int32_t layer = -1;
    int64_t bytes = 0;
    CopyTicket ticket;
    absl::Time enqueued;
    bool abandoned = false;  // Filling when its request was abandoned.
  };

  KvStagingRing(const KvStagingOptions& options, DeviceCopier* copier, std::unique_ptr<KvRegion> region,
                int64_t slot_stride);

  char* SlotData(int32_t index) const { return base_ + index * slot_stride_; }
  // Whether `request` may not take a slot now, and why.
  bool RefusedLocked(const engine::RequestId& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RefusalLocked(const engine::RequestId& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int32_t> AcquireLocked(const engine::RequestId& request, int32_t layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EnqueueLocked(int32_t index, absl::Span<const CopyRange> copies) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands out the head of the queue, whose copy ended with `copy`.
  absl::StatusOr<StagedLayer> PopHeadLocked(const absl::Status& copy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a failed copy of (request, layer); returns its error.
  absl::Status CopyFailedLocked(const absl::Status& copy, const engine::RequestId& request, int32_t layer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(int32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `slot` names the current use of a slot in `state`.
  bool IsLocked(StagingSlot slot, SlotState state) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const KvStagingOptions options_;
  DeviceCopier* const copier_;
  const std::unique_ptr<KvRegion> region_;
  char* const base_;  // [num_slots][slot_stride_]
  const int64_t slot_stride_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);
  std::deque<int32_t> queue_ ABSL_GUARDED_BY(mu_);  // Copying slots, in enqueue order.
  absl::flat_hash_map<engine::RequestId, absl::Status> abandoned_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // The first copy failure.
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  int32_t waiting_for_slot_ ABSL_GUARDED_BY(mu_) = 0;
  KvStagingStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_KV_STAGING_H_
