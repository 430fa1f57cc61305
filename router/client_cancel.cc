#include "router/client_cancel.h"

namespace pdserve::router {

void ClientCancel::Attach(Relay* relay) {
  absl::MutexLock lock(&mu_);
  relay_ = relay;
  if (cancelled_.load(std::memory_order_relaxed)) relay_->Cancel();
}

void ClientCancel::Detach() {
  absl::MutexLock lock(&mu_);
  relay_ = nullptr;
}

void ClientCancel::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_.store(true, std::memory_order_relaxed);
  if (relay_ != nullptr) relay_->Cancel();
}

}  // namespace pdserve::router
