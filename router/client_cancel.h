// Where a client's going away meets the relay serving it. The front that
// owns the client's call (the gRPC service's reactor, the HTTP server's
// Call) learns of it on its own thread, and may do so before the relay
// exists, while it runs, or after it ended: Cancel records it and cancels
// the attached relay, and Attach cancels a relay at once if it came first.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_CLIENT_CANCEL_H_
#define PDSERVE_ROUTER_CLIENT_CANCEL_H_

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "router/relay.h"

namespace pdserve::router {

class ClientCancel {
 public:
  // `relay` runs from now until Detach.
  void Attach(Relay* relay);
  void Detach();
  // The client is gone: the relay attached now, or the next one, is
  // cancelled.
  void Cancel();
  // Whether Cancel was called (lock-free: asked for every message).
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  absl::Mutex mu_;
  Relay* relay_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::atomic<bool> cancelled_{false};  // set under mu_
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_CLIENT_CANCEL_H_
