// The router's ledger of decode KV: how many positions it has placed on
// each decode worker and not yet seen end, and from that how much room a
// new request finds there.
//
// A request takes prompt + max_tokens positions (rounded up to the
// worker's blocks) from admission to the end of its decode stream. That is
// the reservation the decode worker itself makes when the handoff arrives
// (the prefill worker reserves the context plus max_tokens' margin), so a
// request the ledger admits never meets a full pool at its handoff, and a
// running stream never waits for KV: the growth is paid for up front. A
// watermark would admit more requests at once, but then a stream could
// stall mid-way, or be preempted and recomputed, when the pool runs out.
//
// The ledger moves on events: a lease is taken when a request is placed
// and returned the moment its decode stream ends (the worker's own final
// message). The worker's reports (its Status answers) only correct it:
// positions the worker says are in use beyond what the ledger had placed
// there at that report (another router's requests, sequences ending late)
// are held back until the next report says otherwise.
//
//   room(w) = capacity(w) - placed(w) - max(0, used_reported(w) - placed_at_report(w))
//
// Thread safety: thread-safe. A lease may be released on any thread.
#ifndef PDSERVE_ROUTER_DECODE_ROOM_H_
#define PDSERVE_ROUTER_DECODE_ROOM_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "router/worker_pool.h"

namespace pdserve::router {

class DecodeRoom;

// Positions held on one decode worker. Move-only; released on destruction
// or Release(), once.
class RoomLease {
 public:
  RoomLease() = default;
  RoomLease(RoomLease&& other) noexcept;
  RoomLease& operator=(RoomLease&& other) noexcept;
  RoomLease(const RoomLease&) = delete;
  RoomLease& operator=(const RoomLease&) = delete;
  ~RoomLease() { Release(); }

  void Release();
  bool held() const { return room_ != nullptr; }
  int64_t positions() const { return positions_; }
  const WorkerPtr& worker() const { return worker_; }

 private:
  friend class DecodeRoom;
  RoomLease(DecodeRoom* room, WorkerPtr worker, int64_t positions)
      : room_(room), worker_(std::move(worker)), positions_(positions) {}

  DecodeRoom* room_ = nullptr;  // null: nothing held
  WorkerPtr worker_;
  int64_t positions_ = 0;
};

class DecodeRoom {
 public:
  DecodeRoom() = default;
  DecodeRoom(const DecodeRoom&) = delete;
  DecodeRoom& operator=(const DecodeRoom&) = delete;

  // Positions a new request may take on `w` now; none while its pool size
  // is not known yet (no report with one).
  std::optional<int64_t> Free(const Worker& w) const;
  // `positions` rounded up to whole blocks of `w` (as its pool allocates).
  int64_t Rounded(const Worker& w, int64_t positions) const;
  // The largest pool among `workers` whose size is known; none if none is.
  std::optional<int64_t> LargestCapacity(const std::vector<WorkerPtr>& workers) const;

  // Takes `positions` (rounded) on `w`, whether or not there is room: the
  // caller checked Free, or is continuing a stream that must run somewhere.
  RoomLease Take(const WorkerPtr& w, int64_t positions);

  // Reads each worker's last report: its pool size and the positions it
  // says are in use, against what the ledger has placed there now. Drops
  // workers that are gone and hold no lease.
  void Refresh(const std::vector<WorkerPtr>& decode_workers);

  // Positions the ledger has placed on `w`.
  int64_t Placed(const Worker& w) const;

  // Called (outside the ledger's lock) whenever room may have grown: a
  // lease released, a report read. Set before any lease is taken.
  void set_on_room(std::function<void()> f) { on_room_ = std::move(f); }

 private:
  friend class RoomLease;
  struct Entry {
    int64_t placed = 0;
    int64_t capacity = -1;  // positions; -1: not known
    int64_t block_size = 0;
    int64_t excess = 0;  // in use on the worker beyond the ledger, at the last report
  };
  void Return(const Worker& w, int64_t positions);

  mutable absl::Mutex mu_;
  // Keyed by the worker itself: a lease holds its WorkerPtr, so a key is
  // never reused while its entry counts anything.
  absl::flat_hash_map<const Worker*, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_room_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_DECODE_ROOM_H_
