// What a relay reports while it runs, kept apart from the running: the
// router's request metrics and the measurements its capacity model learns
// from (router/measured.h). A relay calls its observer at each event; a
// test can put its own in RelayContext::observer and see exactly what a
// request reported.
//
// Thread safety: one observer serves every relay of a router, so its
// methods are called from many threads at once; MetricsObserver's are safe
// (metrics are atomic, MeasuredInputs locks).
#ifndef PDSERVE_ROUTER_RELAY_OBSERVER_H_
#define PDSERVE_ROUTER_RELAY_OBSERVER_H_

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "base/metrics.h"
#include "pdserve/v1/generation.pb.h"
#include "router/measured.h"

namespace pdserve::router {

// The router's request metrics, registered once and shared by every relay.
struct RelayMetrics {
  explicit RelayMetrics(MetricsRegistry& registry);
  // "stop", "length", "cancelled", "error", "invalid", "unavailable", "rejected",
  // "unauthenticated", "key_limited" (over an API key's rate or concurrency),
  // "queue_full", "queue_wait" (refused by the router's queue).
  void CountOutcome(const char* outcome) const;

  absl::flat_hash_map<std::string, Counter*> outcomes;
  Histogram* ttft;
  Histogram* itl;
  Histogram* e2e;
  Histogram* queue;          // the router's queue for decode KV room
  Histogram* prefill_queue;  // the prefill worker's own queue
  Histogram* prefill_time;
  Histogram* handoff;
  Counter* retries;
  Counter* migrations;
  Counter* placements[3];  // prefill_pool, decode_local, colocated
  Counter* prompt_tokens;
  Counter* cached_tokens;
  Counter* tier2_tokens;
  // By "reason/outcome": reason drain or rebalance; outcome moved,
  // resumed (stayed on its worker) or replayed (recomputed elsewhere).
  absl::flat_hash_map<std::string, Counter*> moves;
  Counter* move_bytes;
  Counter* move_seconds;
  void CountMove(const std::string& reason, const char* outcome) const;
};

// Where a request's prefill runs.
enum class PrefillPlacement { kPrefillPool = 0, kDecodeLocal = 1, kColocated = 2 };

class RelayObserver {
 public:
  virtual ~RelayObserver() = default;
  // The request reached its relay.
  virtual void Arrived() = 0;
  // It left the router's queue for decode KV room after `waited`.
  virtual void Queued(absl::Duration waited) = 0;
  // Its first decode attempt was placed.
  virtual void Placed(PrefillPlacement where) = 0;
  // A decode attempt after the first (a migration).
  virtual void Migrated() = 0;
  // A prefill attempt after a prefill worker failed.
  virtual void PrefillRetried() = 0;
  // A prefill's first token: `context_tokens` prefilled on `worker`, of
  // them `cached_tokens` from its prefix cache, in `seconds` of compute;
  // `worker` is empty for a prefill on the decode worker itself, which
  // reports no time apart from its decode.
  virtual void Prefilled(const std::string& worker, int64_t context_tokens, int64_t cached_tokens,
                         double seconds) = 0;
  // A prefill worker's first token: of its cached context positions,
  // `pool_tokens` came from its pool and `tier2_tokens` from its second tier.
  virtual void PrefixTiers(int64_t pool_tokens, int64_t tier2_tokens) {
    (void)pool_tokens;
    (void)tier2_tokens;
  }
  // A running sequence's move from decode worker `from` (to `to`, none when
  // no worker could take it), asked for `reason` (drain, rebalance):
  // `outcome` moved, resumed or replayed; a move's `bytes` took `seconds`.
  virtual void Moved(const std::string& reason, const char* outcome, const std::string& from, const std::string& to,
                     double bytes, double seconds) {
    (void)reason;
    (void)outcome;
    (void)from;
    (void)to;
    (void)bytes;
    (void)seconds;
  }
  // A handoff committed: `bytes` of KV from `prefill` to `decode` in `seconds`.
  virtual void HandedOff(const std::string& prefill, const std::string& decode, double bytes, double seconds) = 0;
  // The gap before a streamed message other than the first.
  virtual void TokenGap(double seconds) = 0;
  // The request ended without running to its final message (refused,
  // cancelled, unavailable): `outcome` as RelayMetrics counts it.
  virtual void EndedEarly(const char* outcome) = 0;
  // The request's final message went out: `outcome` as counted, its
  // `timings`, its completion tokens, and whether a prefill worker handed
  // it off (its prefill queue and handoff are timed).
  virtual void Finished(const char* outcome, const v1::Timings& timings, int32_t completion_tokens,
                        bool handed_off) = 0;
};

// The observer every router runs: RelayMetrics and MeasuredInputs.
class MetricsObserver final : public RelayObserver {
 public:
  MetricsObserver(const RelayMetrics* metrics, MeasuredInputs* measured) : metrics_(metrics), measured_(measured) {}

  void Arrived() override;
  void Queued(absl::Duration waited) override;
  void Placed(PrefillPlacement where) override;
  void Migrated() override;
  void PrefillRetried() override;
  void Prefilled(const std::string& worker, int64_t context_tokens, int64_t cached_tokens, double seconds) override;
  void PrefixTiers(int64_t pool_tokens, int64_t tier2_tokens) override;
  void HandedOff(const std::string& prefill, const std::string& decode, double bytes, double seconds) override;
  void Moved(const std::string& reason, const char* outcome, const std::string& from, const std::string& to,
             double bytes, double seconds) override;
  void TokenGap(double seconds) override;
  void EndedEarly(const char* outcome) override;
  void Finished(const char* outcome, const v1::Timings& timings, int32_t completion_tokens, bool handed_off) override;

 private:
  const RelayMetrics* metrics_;
  MeasuredInputs* measured_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_RELAY_OBSERVER_H_
