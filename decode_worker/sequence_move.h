// The sending half of a decode worker's sequence move: the KV of a
// sequence its engine paused (engine::Engine::Pause) goes to another
// decode worker's KV receiver as an ordinary handoff, reserve, every
// layer, commit, under the grant the router minted for the move. The
// context sent is the prompt and every generated token but the last; the
// last travels as the handoff's first token, which the target replays
// into its Generation (as it does a prefill worker's first token) and
// feeds at its first step. Sampling is keyed by (seed, position) and the
// target's Generation replays every earlier token (the router sends them
// as generated_ids), so its penalties, stop-string matcher and
// detokenizer stand where the source's stood, and the stream goes on with
// the same tokens and text.
//
// Thread safety: none; the caller holds the paused request, which no
// other thread touches while it is sent.
#ifndef PDSERVE_DECODE_WORKER_SEQUENCE_MOVE_H_
#define PDSERVE_DECODE_WORKER_SEQUENCE_MOVE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "kv/kv_cache.h"
#include "kv_transfer/sender.h"
#include "pdserve/v1/worker.pb.h"

namespace pdserve::decode {

struct SentSequence {
  int32_t positions = 0;       // Context positions the target holds now.
  int32_t sent_positions = 0;  // Of them, sent (the rest it held already).
  int64_t bytes = 0;
  double seconds = 0;
};

// Sends paused request `r` (its KV in a pool of `spec`) as `req` says.
// FAILED_PRECONDITION: req.generated is not what `r` generated (the
// router's view and this worker's differ); the handoff's errors
// (UNAVAILABLE, PERMISSION_DENIED, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED).
absl::StatusOr<SentSequence> SendSequence(kv::ReceiverConnections& connections, const KvCacheSpec& spec,
                                          const engine::Request& r, const worker::v1::MoveSequenceRequest& req);

}  // namespace pdserve::decode

#endif  // PDSERVE_DECODE_WORKER_SEQUENCE_MOVE_H_
