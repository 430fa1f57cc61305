// Counters of one side of the KV handoff: bytes, transfers, per-transfer
// time, failures, leases expired, quarantine.
//
// Thread safety: all members are atomics; Snapshot() is a consistent-enough
// copy for reporting (each counter read once).
#ifndef PDSERVE_KV_TRANSFER_METRICS_H_
#define PDSERVE_KV_TRANSFER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace pdserve::kv {

struct KvTransferStats {
  int64_t bytes = 0;            // KV bytes written (sender) or committed (receiver).
  int64_t transfers = 0;        // Committed handoffs.
  int64_t failures = 0;         // Handoffs that ended without a commit.
  int64_t leases_expired = 0;
  int64_t aborts = 0;           // Abort messages handled (either direction).
  int64_t quarantined_blocks = 0;  // Now (receiver).
  int64_t transfer_micros_total = 0;
  int64_t transfer_micros_max = 0;
  // Per-transfer time histogram: bucket i counts times in [2^i, 2^(i+1)) us.
  std::array<int64_t, 32> transfer_micros_log2{};

  std::string ToString() const;
};

class KvTransferMetrics {
 public:
  void AddBytes(int64_t n) { bytes_ += n; }
  void RecordTransfer(absl::Duration d);
  void RecordFailure() { ++failures_; }
  void RecordLeaseExpired() { ++leases_expired_; }
  void RecordAbort() { ++aborts_; }
  void AddQuarantined(int64_t blocks) { quarantined_blocks_ += blocks; }
  KvTransferStats Snapshot() const;

 private:
  std::atomic<int64_t> bytes_{0}, transfers_{0}, failures_{0}, leases_expired_{0}, aborts_{0},
      quarantined_blocks_{0}, micros_total_{0}, micros_max_{0};
  std::array<std::atomic<int64_t>, 32> log2_{};
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_METRICS_H_
