// What one decode attempt of a relay sends to workers: the WorkRequest (the
// client's request resolved, under the attempt's internal id, with every
// token already streamed to the client), the decode worker's request, and
// each prefill attempt's request with its handoff grant. A migration or a
// retried prefill builds new ones; nothing here calls a worker.
//
// Thread safety: none needed; a relay's thread owns its Attempt.
#ifndef PDSERVE_ROUTER_ATTEMPT_H_
#define PDSERVE_ROUTER_ATTEMPT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/generation.h"
#include "kv_transfer/grant.h"
#include "pdserve/v1/worker.pb.h"
#include "router/worker_pool.h"

namespace pdserve::router {

class Attempt {
 public:
  Attempt() = default;
  // `context`: the prompt followed by `streamed` (what this attempt
  // prefills).
  Attempt(const GenerationRequest& request, std::string request_id, absl::Span<const int32_t> streamed);

  const worker::v1::WorkRequest& work() const { return work_; }
  const std::vector<int32_t>& context() const { return context_; }

  // The Decode call's request; `prefill_here`: the decode worker prefills
  // the context itself.
  worker::v1::DecodeRequest DecodeRequest(bool prefill_here) const;

  // The Prefill call's request for `prefill`, handing the KV to `decode`.
  // With a grant key, it carries a grant minted for this prefill attempt
  // (each gets the next attempt number): only `prefill`'s host may reserve
  // on `decode`'s KV receiver for it, once, before `now + ttl`, for the
  // context's token ids and the room the request may take (prompt +
  // max_tokens) (kv_transfer/grant.h).
  worker::v1::PrefillRequest PrefillRequest(const Worker& prefill, const Worker& decode, const kv::GrantKey* key,
                                            absl::Time now, absl::Duration ttl);
  // The MoveSequence request asking decode worker `source` to send paused
  // sequence `source_request_id` to `target` under this attempt's request
  // id (the target's Decode call waits for it there). `generated`: the
  // tokens relayed so far (this attempt's context is the prompt and all
  // of them but the last). With a grant key, it carries a grant minted as
  // PrefillRequest's is, with `source`'s host as the sender.
  worker::v1::MoveSequenceRequest MoveRequest(const Worker& source, const std::string& source_request_id,
                                              int32_t generated, const Worker& target, const kv::GrantKey* key,
                                              absl::Time now, absl::Duration ttl);
  // The PushPrefix request asking prefill worker `from` to send the
  // context's first `positions` to prefill worker `to`'s pull receiver.
  // With a grant key, it carries a grant minted for this pull (its own
  // request id, "<id>/pull", and the next pull number as the attempt):
  // only `from`'s host may reserve on `to` for it, once, for exactly
  // those token ids.
  worker::v1::PushPrefixRequest PullRequest(const Worker& from, const Worker& to, int64_t positions,
                                            const kv::GrantKey* key, absl::Time now, absl::Duration ttl);

 private:
  // A handoff grant for this attempt's context, from `sender` (a worker's
  // gRPC address) to `receiver`'s KV receiver; empty when minting fails.
  std::string HandoffGrant(const std::string& sender, const Worker& receiver, const kv::GrantKey& key, absl::Time now,
                           absl::Duration ttl);

  worker::v1::WorkRequest work_;
  std::vector<int32_t> context_;
  int32_t positions_ = 0;
  CacheSalt salt_;
  uint32_t handoff_attempts_ = 0;
  uint32_t pulls_ = 0;
};

// "host" of "host:port" or "[v6]:port" (a grant names its sender's host).
std::string HostOfAddress(const std::string& address);

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_ATTEMPT_H_
