#include "kv_transfer/metrics.h"

#include <bit>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {

void KvTransferMetrics::RecordTransfer(absl::Duration d) {
  const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(d));
  ++transfers_;
  micros_total_ += us;
  int64_t seen = micros_max_.load();
  while (us > seen && !micros_max_.compare_exchange_weak(seen, us)) {
  }
  ++log2_[std::min(31, 63 - std::countl_zero(static_cast<uint64_t>(us)))];
}

KvTransferStats KvTransferMetrics::Snapshot() const {
  KvTransferStats s;
  s.bytes = bytes_;
  s.transfers = transfers_;
  s.failures = failures_;
  s.leases_expired = leases_expired_;
  s.aborts = aborts_;
  s.quarantined_blocks = quarantined_blocks_;
  s.transfer_micros_total = micros_total_;
  s.transfer_micros_max = micros_max_;
  for (size_t i = 0; i < log2_.size(); ++i) s.transfer_micros_log2[i] = log2_[i];
  return s;
}

std::string KvTransferStats::ToString() const {
  return absl::StrCat("bytes=", bytes, " transfers=", transfers, " failures=", failures,
                      " leases_expired=", leases_expired, " aborts=", aborts,
                      " quarantined_blocks=", quarantined_blocks, " transfer_us_total=",
                      transfer_micros_total, " transfer_us_max=", transfer_micros_max);
}

}  // namespace pdserve::kv
