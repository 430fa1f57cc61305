#include "router/relay_observer.h"

#include <string_view>

#include "absl/strings/str_cat.h"

namespace pdserve::router {

RelayMetrics::RelayMetrics(MetricsRegistry& m) {
  for (const char* o : {"stop", "length", "cancelled", "error", "invalid", "unavailable", "rejected", "unauthenticated",
                        "key_limited", "queue_full", "queue_wait"}) {
    outcomes[o] = m.AddCounter("pdserve_requests_total", "Requests by how they ended.",
                               absl::StrCat("outcome=\"", o, "\""));
  }
  ttft = m.AddHistogram("pdserve_time_to_first_token_seconds", "Router receipt to first token sent.", LatencyBuckets());
  itl = m.AddHistogram("pdserve_inter_token_latency_seconds", "Gap between streamed messages.", LatencyBuckets());
  e2e = m.AddHistogram("pdserve_request_duration_seconds", "Router receipt to final message.", LatencyBuckets());
  queue = m.AddHistogram("pdserve_queue_seconds", "Waiting in the router's queue for decode KV room.",
                         LatencyBuckets());
  prefill_queue =
      m.AddHistogram("pdserve_prefill_queue_seconds", "Waiting in the prefill worker's own queue.", LatencyBuckets());
  prefill_time = m.AddHistogram("pdserve_prefill_seconds", "Prefill compute.", LatencyBuckets());
  handoff = m.AddHistogram("pdserve_handoff_seconds", "First token to KV committed on the decode worker.",
                           LatencyBuckets());
  retries = m.AddCounter("pdserve_prefill_retries_total", "Prefills run again after a worker failed.");
  migrations = m.AddCounter("pdserve_migrations_total", "Sequences moved off a failed decode worker.");
  const char* names[] = {"prefill_pool", "decode_local", "colocated"};
  for (int i = 0; i < 3; ++i) {
    placements[i] = m.AddCounter(
        "pdserve_prefill_placements_total",
        "Prefills by where they ran: a prefill worker (handoff), the decode worker itself (conditional "
        "disaggregation: short uncached part), or colocated mode.",
        absl::StrCat("placement=\"", names[i], "\""));
  }
  prompt_tokens = m.AddCounter("pdserve_prefill_context_tokens_total", "Context positions prefilled (cached or computed).");
  cached_tokens = m.AddCounter("pdserve_prefix_cached_tokens_total", "Of them, positions taken from a worker's prefix cache.");
  tier2_tokens = m.AddCounter("pdserve_prefix_tier2_tokens_total",
                              "Of the cached positions, those a prefill worker read back from its second tier.");
  for (const char* reason : {"drain", "rebalance"}) {
    for (const char* outcome : {"moved", "resumed", "replayed"}) {
      moves[absl::StrCat(reason, "/", outcome)] = m.AddCounter(
          "pdserve_decode_moves_total",
          "Running sequences a decode worker paused to move elsewhere, by why (drain, rebalance) and outcome: moved "
          "with their KV, resumed on their worker, or replayed (recomputed) elsewhere.",
          absl::StrCat("reason=\"", reason, "\",outcome=\"", outcome, "\""));
    }
  }
  move_bytes = m.AddCounter("pdserve_decode_move_bytes_total", "KV bytes of the sequences moved between decode workers.");
  move_seconds = m.AddCounter("pdserve_decode_move_seconds_total",
                              "Seconds the moves' KV handoffs took (reservation to commit), summed.");
}

void RelayMetrics::CountMove(const std::string& reason, const char* outcome) const {
  auto it = moves.find(absl::StrCat(reason == "drain" ? "drain" : "rebalance", "/", outcome));
  if (it != moves.end()) it->second->Add();
}

void RelayMetrics::CountOutcome(const char* outcome) const { outcomes.at(outcome)->Add(); }

void MetricsObserver::Arrived() { measured_->RecordArrival(); }

void MetricsObserver::Queued(absl::Duration waited) { metrics_->queue->Observe(absl::ToDoubleSeconds(waited)); }

void MetricsObserver::Placed(PrefillPlacement where) { metrics_->placements[static_cast<int>(where)]->Add(); }

void MetricsObserver::Migrated() { metrics_->migrations->Add(); }

void MetricsObserver::PrefillRetried() { metrics_->retries->Add(); }

void MetricsObserver::Prefilled(const std::string& worker, int64_t context_tokens, int64_t cached_tokens,
                                double seconds) {
  if (!worker.empty()) measured_->RecordPrefill(worker, context_tokens, context_tokens - cached_tokens, seconds);
  metrics_->prompt_tokens->Add(static_cast<double>(context_tokens));
  metrics_->cached_tokens->Add(static_cast<double>(cached_tokens));
}

void MetricsObserver::PrefixTiers(int64_t pool_tokens, int64_t tier2_tokens) {
  measured_->RecordPrefixTiers(pool_tokens, tier2_tokens);
  metrics_->tier2_tokens->Add(static_cast<double>(tier2_tokens));
}

void MetricsObserver::HandedOff(const std::string& prefill, const std::string& decode, double bytes, double seconds) {
  measured_->RecordHandoff(prefill, decode, bytes, seconds);
}

void MetricsObserver::Moved(const std::string& reason, const char* outcome, const std::string& from,
                            const std::string& to, double bytes, double seconds) {
  metrics_->CountMove(reason, outcome);
  if (bytes > 0) metrics_->move_bytes->Add(bytes);
  if (seconds > 0) metrics_->move_seconds->Add(seconds);
  // The decode-to-decode link's bandwidth (the rebalance's cost model).
  measured_->RecordLink(from, to, bytes, seconds);
}

void MetricsObserver::TokenGap(double seconds) { metrics_->itl->Observe(seconds); }

void MetricsObserver::EndedEarly(const char* outcome) { metrics_->CountOutcome(outcome); }

void MetricsObserver::Finished(const char* outcome, const v1::Timings& timings, int32_t completion_tokens,
                               bool handed_off) {
  if (completion_tokens > 0) metrics_->ttft->Observe(timings.ttft());
  if (handed_off) {
    metrics_->prefill_queue->Observe(timings.queue());
    metrics_->handoff->Observe(timings.handoff());
  }
  metrics_->prefill_time->Observe(timings.prefill());
  // Only a request that ran to its stop or length tells the capacity model
  // how long outputs are.
  const std::string_view o(outcome);
  if (o == "stop" || o == "length") measured_->RecordFinished(completion_tokens);
  metrics_->CountOutcome(outcome);
  metrics_->e2e->Observe(timings.total());
}

}  // namespace pdserve::router
