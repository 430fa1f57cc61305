// Whether a worker can serve, judged from what it observes of itself. The
// gRPC health status and the Status RPC both report the verdict, so the
// router stops sending work to a worker that:
//   - drains (SIGTERM),
//   - leaks KV blocks: blocks stay in use while the worker holds no work at
//     all (no request, reservation or pending handoff) for `leak_grace`,
//   - has a wedged transport: its UCX event loop has not gone round for
//     `wedge_after` (it goes round at least every few hundred ms when idle),
//   - has a transport that cannot carry a KV handoff at all (its self-check,
//     kv_transfer/self_check.h, failed: the reason is the check's message).
// A model that is not loaded never serves: the workers start their gRPC
// server only after loading it.
//
// Thread safety: thread-compatible (one caller judges; others read the
// reason through their own synchronization).
#ifndef PDSERVE_BASE_HEALTH_H_
#define PDSERVE_BASE_HEALTH_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/time/time.h"

namespace pdserve {

struct HealthOptions {
  absl::Duration leak_grace = absl::Seconds(10);
  absl::Duration wedge_after = absl::Seconds(5);
};

struct HealthInputs {
  bool draining = false;
  bool idle = false;           // No request, reservation or pending handoff held.
  int32_t kv_blocks_used = 0;  // Blocks some owner references.
  absl::Time transport_beat;   // When the transport's loop last went round.
  std::string transport_error;  // Why the transport cannot carry a handoff ("" = it can).
};

class HealthJudge {
 public:
  explicit HealthJudge(HealthOptions options = {}) : options_(options) {}

  // "" when the worker can serve, else why not (for logs and Status).
  std::string Judge(const HealthInputs& in, absl::Time now);

 private:
  HealthOptions options_;
  // Since when blocks have stayed in use with the worker idle, if they have.
  std::optional<absl::Time> idle_with_blocks_since_;
};

}  // namespace pdserve

#endif  // PDSERVE_BASE_HEALTH_H_
