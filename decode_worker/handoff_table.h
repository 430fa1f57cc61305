// The decode worker's record of each disaggregated request's handoff: the
// prefill worker's committed KV and the router's Decode call meet here,
// whichever arrives first, and every request id is in exactly one state.
//
//   (none) ─commit─▶ awaiting-call ─call─────────────▶ claimed
//     │                   │ └─deadline (KV freed)─▶ abandoned
//     └─call─▶ awaiting-KV ─commit────────────────▶ claimed
//                  │  ▲ └─deadline, call ended──▶ abandoned ─call─▶ awaiting-KV
//                  └──┘ a newer call displaces the older
//
// and any state but released goes to released when the router says it is
// done with the id (Release). The end states (claimed, released,
// abandoned) are remembered for a while, so that what still arrives for the
// id is settled at once:
//   - a commit for a claimed id is a retried prefill's duplicate: freed;
//   - a commit for a released or abandoned id has no taker: freed;
//   - a call for a released id is refused, and a call for a claimed id is
//     refused (its KV went to an earlier call);
//   - a call for an abandoned id waits for a new commit.
// Then they are forgotten.
//
// Each entry carries its own deadline on a Timer (no sweep): awaiting-call
// and awaiting-KV expire after `wait`, the end states after `remember`.
// Transition() is the one place a state changes and refuses what the
// diagram does not draw.
//
// Waiters are told outside the table's lock, so they may call back in.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_DECODE_WORKER_HANDOFF_TABLE_H_
#define PDSERVE_DECODE_WORKER_HANDOFF_TABLE_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"
#include "engine/request.h"
#include "kv/kv_manager.h"
#include "engine/generation.h"

namespace pdserve::decode {

// A sequence whose KV arrived by handoff (see kv_transfer), waiting for (or
// claimed by) its Decode call.
struct HandedOff {
  SequenceKv kv;
  TokenEvent first;  // Sampled by the prefill worker.
  // The response format's hash and its state after `first` on the sender
  // (kv::Commit); 0 without one.
  uint64_t grammar_hash = 0;
  uint64_t grammar_digest = 0;
  absl::Time arrived;
  engine::KvCheck check;  // What the KV must hash to (empty: not checked).
};

enum class HandoffState : uint8_t {
  kAwaitingCall,  // KV committed; its Decode call has not come.
  kAwaitingKv,    // Its Decode call waits; the KV has not been committed.
  kClaimed,       // A call took the KV.
  kReleased,      // The router is done with the id.
  kAbandoned,     // Nobody took it in time, or its call ended first.
};
const char* HandoffStateName(HandoffState s);
// Whether an id may go from `from` (nullopt: not in the table) to `to`.
// The table of the diagram.
bool IsLegalHandoffTransition(std::optional<HandoffState> from, HandoffState to);

// Why a waiting call will not get its KV.
enum class NoHandoff : uint8_t {
  kTimedOut,   // Not committed within `wait`.
  kReleased,   // The router released the id.
  kDisplaced,  // A newer Decode call for the id took its place.
};

// A Decode call waiting for its KV.
class HandoffWaiter {
 public:
  virtual ~HandoffWaiter() = default;
  virtual void OnHandoff(HandedOff seq) = 0;
  virtual void OnNoHandoff(NoHandoff why) = 0;
};

struct HandoffTableOptions {
  // How long a committed handoff waits for its call, and a call for its
  // handoff.
  absl::Duration wait = absl::Seconds(30);
  // How long the end states are remembered.
  absl::Duration remember = absl::Minutes(5);
};

class HandoffTable {
 public:
  // REQUIRES: `timer` outlives the table, or is stopped before it goes.
  HandoffTable(Timer* timer, HandoffTableOptions options);
  ~HandoffTable();
  HandoffTable(const HandoffTable&) = delete;
  HandoffTable& operator=(const HandoffTable&) = delete;

  enum class CommitOutcome : uint8_t {
    kParked,     // Awaits its call.
    kDelivered,  // Its call was waiting and has it now.
    kDuplicate,  // Freed: an earlier commit for the id is held or claimed.
    kNoTaker,    // Freed: the id is released or abandoned.
  };
  // The KV receiver committed `seq` for `id`.
  CommitOutcome Commit(const engine::RequestId& id, HandedOff seq);

  enum class CallOutcome : uint8_t {
    kParked,     // Awaits its KV; `waiter` hears how that ends.
    kDelivered,  // The KV was here: `waiter->OnHandoff` ran.
    kReleased,   // Refused: the router released the id.
    kTaken,      // Refused: an earlier call took the id's KV.
  };
  // A Decode call for `id` arrived. A call already waiting for the id is
  // displaced (told kDisplaced).
  CallOutcome Call(const engine::RequestId& id, std::shared_ptr<HandoffWaiter> waiter);

  // `waiter`'s call ended while it waited (cancelled): a commit that still
  // comes is freed on arrival. Nothing happens unless `waiter` is the one
  // waiting for `id`.
  void CallEnded(const engine::RequestId& id, const HandoffWaiter* waiter);

  // The router is done with `id`. Returns whether committed KV was freed;
  // a waiting call is told kReleased.
  bool Release(const engine::RequestId& id);

  std::optional<HandoffState> state(const engine::RequestId& id);
  // Committed handoffs that no call has taken.
  int64_t parked_kv();
  int64_t size();

 private:
  struct Entry {
    HandoffState state = HandoffState::kAbandoned;
    std::optional<HandedOff> kv;              // awaiting-call
    std::shared_ptr<HandoffWaiter> waiter;    // awaiting-KV
    uint64_t generation = 0;                  // Bumped by every transition.
    Timer::Id deadline = 0;
  };
  // The one place a state changes: checks the diagram, moves the entry's
  // deadline to the new state's, and clears what the old state held
  // (returned through `kv` and `waiter` so that they go outside the lock).
  // An illegal transition changes nothing.
  absl::Status Transition(const engine::RequestId& id, Entry& e, std::optional<HandoffState> from,
                          HandoffState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Entry& Enter(const engine::RequestId& id, HandoffState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Expire(const engine::RequestId& id, uint64_t generation);

  Timer* const timer_;
  const HandoffTableOptions options_;
  absl::Mutex mu_;
  absl::flat_hash_map<engine::RequestId, Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t parked_kv_ ABSL_GUARDED_BY(mu_) = 0;
};

const char* CommitOutcomeName(HandoffTable::CommitOutcome o);

}  // namespace pdserve::decode

#endif  // PDSERVE_DECODE_WORKER_HANDOFF_TABLE_H_
