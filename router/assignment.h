// A request's claim on one worker's load counters: one unit of in_flight,
// and (for a prefill) the prompt tokens it adds to the worker's queue until
// its first token comes back. Placement weighs these counters; an
// Assignment takes them when it is made and gives back what it still holds
// when it is released or destroyed, so no exit path of a relay (an error,
// a cancel, a migration) can leave a worker looking busier than it is.
//
// Thread safety: the counters are atomics shared by every relay; one
// Assignment is used by one thread.
#ifndef PDSERVE_ROUTER_ASSIGNMENT_H_
#define PDSERVE_ROUTER_ASSIGNMENT_H_

#include <cstdint>
#include <utility>

#include "router/worker_pool.h"

namespace pdserve::router {

class Assignment {
 public:
  Assignment() = default;
  // Takes one unit of `worker`'s in_flight and adds `queued_tokens` to its
  // queue.
  Assignment(WorkerPtr worker, int64_t queued_tokens) : worker_(std::move(worker)), queued_(queued_tokens) {
    worker_->in_flight.fetch_add(1);
    if (queued_ != 0) worker_->queued_tokens.fetch_add(queued_);
  }
  ~Assignment() { Release(); }
  Assignment(Assignment&& other) noexcept { *this = std::move(other); }
  Assignment& operator=(Assignment&& other) noexcept {
    if (this != &other) {
      Release();
      worker_ = std::move(other.worker_);
      queued_ = std::exchange(other.queued_, 0);
    }
    return *this;
  }
  Assignment(const Assignment&) = delete;
  Assignment& operator=(const Assignment&) = delete;

  bool held() const { return worker_ != nullptr; }
  const WorkerPtr& worker() const { return worker_; }
  int64_t queued_tokens() const { return queued_; }

  // The worker has taken the queued tokens off its queue (a prefill's first
  // token arrived); in_flight stays held.
  void DequeueTokens() {
    if (worker_ != nullptr && queued_ != 0) worker_->queued_tokens.fetch_sub(queued_);
    queued_ = 0;
  }
  // Gives back everything still held; then held() is false.
  void Release() {
    if (worker_ == nullptr) return;
    DequeueTokens();
    worker_->in_flight.fetch_sub(1);
    worker_ = nullptr;
  }

 private:
  WorkerPtr worker_;
  int64_t queued_ = 0;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_ASSIGNMENT_H_
