// A request's identity and its life inside one worker, as one state
// machine.
//
//   waiting ──▶ prefilling ──▶ decoding ──▶ finished(stop | length)
//      │            │  ▲           │
//      │            │  └─preempted◀┘          (KV freed; recomputed later)
//      │            └──▶ handing-off ──▶ finished(handed-off)
//      └──▶ waiting-for-KV ──▶ decoding       (the KV comes by handoff)
//
// and every state but finished can also end as finished(cancelled | error).
// A prefill worker's request goes waiting → prefilling → handing-off →
// finished(handed-off), or ends at its first token (stop | length); a
// decode worker's goes waiting → waiting-for-KV → decoding (disaggregated)
// or waiting → prefilling → decoding (colocated), and is preempted back to
// prefilling when the KV pool runs out.
//
// Transition() is the only place a state changes; an illegal transition is
// refused and leaves the state as it was.
//
// Thread safety: RequestLifecycle is thread-safe (the state is one atomic).
#ifndef PDSERVE_ENGINE_REQUEST_H_
#define PDSERVE_ENGINE_REQUEST_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampling.h"

namespace pdserve::engine {

// The router's id for a request: the same on the prefill and the decode
// worker, in the KV handoff's commit and in every log line. A worker that
// is called without one (a client talking to it directly) makes one up.
class RequestId {
 public:
  RequestId() = default;
  explicit RequestId(std::string value) : value_(std::move(value)) {}
  const std::string& str() const { return value_; }
  bool empty() const { return value_.empty(); }
  friend bool operator==(const RequestId& a, const RequestId& b) { return a.value_ == b.value_; }
  friend bool operator!=(const RequestId& a, const RequestId& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const RequestId& id) {
    return H::combine(std::move(h), id.value_);
  }

 private:
  std::string value_;
};

// What a handed-off KV must hash to (kv/kv_checksum.h's LayerChecksum):
// one checksum per layer of the sequence's blocks [first_block, end_block).
// Empty: not checked.
struct KvCheck {
  std::vector<uint64_t> layer_checksums;
  int32_t first_block = 0;
  int32_t end_block = 0;
  std::string producer;  // Where the KV came from, for the log.
};

enum class RequestState : uint8_t {
  kWaiting,       // Accepted; not computing yet (queued, reserving KV).
  kWaitingForKv,  // Decode side: its KV comes by handoff and has not arrived.
  kPrefilling,    // Its context is being prefilled (in chunks).
  kHandingOff,    // Prefill side: first token sampled, KV being committed.
  kDecoding,      // In the running batch, one token per step.
  kPreempted,     // KV freed for others; its context is prefilled again.
  kFinished,
};
inline constexpr int kNumRequestStates = 7;

// Why a finished request ended (kNone until it has).
enum class EndReason : uint8_t {
  kNone,
  kStop,       // A stop token or string.
  kLength,     // max_tokens, or the context's end.
  kCancelled,  // By its caller (or the caller went away).
  kError,      // The worker could not finish it (see the status it ended with).
  kHandedOff,  // Another worker has it now (a prefill's handoff, a decode worker's move).
};
inline constexpr int kNumEndReasons = 6;

const char* RequestStateName(RequestState s);
const char* EndReasonName(EndReason r);
// A generation's finish as an end reason (kNone -> kNone).
EndReason EndReasonFor(FinishReason f);

// Whether `from` may go to `to` (with `reason`, which is kNone unless `to`
// is kFinished, and then anything but kNone). The table of the diagram.
bool IsLegalTransition(RequestState from, RequestState to, EndReason reason);

class RequestLifecycle {
 public:
  RequestLifecycle() = default;
  RequestLifecycle(const RequestLifecycle&) = delete;
  RequestLifecycle& operator=(const RequestLifecycle&) = delete;

  RequestState state() const { return Unpack(word_.load(std::memory_order_acquire)).first; }
  EndReason end_reason() const { return Unpack(word_.load(std::memory_order_acquire)).second; }
  bool finished() const { return state() == RequestState::kFinished; }

  // The one function that changes the state. An illegal transition (see
  // IsLegalTransition) returns FAILED_PRECONDITION naming both states and
  // changes nothing; so does a second finish, which is how two threads
  // racing to end a request learn which of them did.
  absl::Status Transition(RequestState to, EndReason reason = EndReason::kNone);

 private:
  static uint16_t Pack(RequestState s, EndReason r) {
    return static_cast<uint16_t>(static_cast<uint16_t>(s) << 8 | static_cast<uint16_t>(r));
  }
  static std::pair<RequestState, EndReason> Unpack(uint16_t w) {
    return {static_cast<RequestState>(w >> 8), static_cast<EndReason>(w & 0xff)};
  }
  std::atomic<uint16_t> word_{Pack(RequestState::kWaiting, EndReason::kNone)};
};

}  // namespace pdserve::engine

#endif  // PDSERVE_ENGINE_REQUEST_H_
