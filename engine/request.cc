#include "engine/request.h"

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

const char* RequestStateName(RequestState s) {
  switch (s) {
    case RequestState::kWaiting: return "waiting";
    case RequestState::kWaitingForKv: return "waiting-for-kv";
    case RequestState::kPrefilling: return "prefilling";
    case RequestState::kHandingOff: return "handing-off";
    case RequestState::kDecoding: return "decoding";
    case RequestState::kPreempted: return "preempted";
    case RequestState::kFinished: return "finished";
  }
  return "unknown";
}

const char* EndReasonName(EndReason r) {
  switch (r) {
    case EndReason::kNone: return "none";
    case EndReason::kStop: return "stop";
    case EndReason::kLength: return "length";
    case EndReason::kCancelled: return "cancelled";
    case EndReason::kError: return "error";
    case EndReason::kHandedOff: return "handed-off";
  }
  return "unknown";
}

EndReason EndReasonFor(FinishReason f) {
  switch (f) {
    case FinishReason::kNone: return EndReason::kNone;
    case FinishReason::kStop: return EndReason::kStop;
    case FinishReason::kLength: return EndReason::kLength;
  }
  return EndReason::kNone;
}

bool IsLegalTransition(RequestState from, RequestState to, EndReason reason) {
  using S = RequestState;
  using R = EndReason;
  if (from == S::kFinished) return false;
  if (to == S::kFinished) {
    switch (reason) {
      case R::kNone: return false;
      case R::kCancelled:
      case R::kError: return true;  // From any live state.
      case R::kStop:
      case R::kLength:
        // A sampled token ends it: the first (prefilling; or replayed from
        // the handoff, waiting-for-KV) or a later one (decoding).
        return from == S::kPrefilling || from == S::kWaitingForKv || from == S::kDecoding;
      case R::kHandedOff: return from == S::kHandingOff;
    }
    return false;
  }
  if (reason != R::kNone) return false;
  switch (from) {
    case S::kWaiting: return to == S::kPrefilling || to == S::kWaitingForKv;
    case S::kWaitingForKv: return to == S::kDecoding;
    case S::kPrefilling: return to == S::kDecoding || to == S::kHandingOff || to == S::kPreempted;
    case S::kDecoding: return to == S::kPreempted;
    case S::kPreempted: return to == S::kPrefilling;
    case S::kHandingOff:
    case S::kFinished: return false;
  }
  return false;
}

absl::Status RequestLifecycle::Transition(RequestState to, EndReason reason) {
  uint16_t word = word_.load(std::memory_order_acquire);
  for (;;) {
    const auto [from, from_reason] = Unpack(word);
    if (!IsLegalTransition(from, to, reason)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request state: ", RequestStateName(from),
          from == RequestState::kFinished ? absl::StrCat("(", EndReasonName(from_reason), ")") : "", " -> ",
          RequestStateName(to), to == RequestState::kFinished ? absl::StrCat("(", EndReasonName(reason), ")") : "",
          " is not a legal transition"));
    }
    if (word_.compare_exchange_weak(word, Pack(to, reason), std::memory_order_acq_rel)) return absl::OkStatus();
  }
}

}  // namespace pdserve::engine
