// The handoff's control messages and their byte encoding.
//
// Messages travel over the transport's ordered control channel
// (kv_transfer/transport.h). Encoding: a 1-byte type, then fields in
// declaration order, integers and floats little-endian fixed width, strings
// and vectors as a u32 count then the elements. Decoding checks every length
// against the buffer and returns INVALID_ARGUMENT for a truncated or
// malformed message; it never trusts a count.
//
// Thread safety: plain values and pure functions.
#ifndef PDSERVE_KV_TRANSFER_WIRE_H_
#define PDSERVE_KV_TRANSFER_WIRE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kv/block_hash.h"
#include "engine/sampling.h"
#include "kv_transfer/descriptor.h"

namespace pdserve::kv {

struct HandoffId {
  uint64_t value = 0;
  friend bool operator==(HandoffId a, HandoffId b) { return a.value == b.value; }
  template <typename H>
  friend H AbslHashValue(H h, HandoffId id) {
    return H::combine(std::move(h), id.value);
  }
};

// Sender -> receiver: reserve blocks for `num_positions` + `margin_positions`.
// `prompt_tokens` lets the receiver find the prefix it already holds (by its
// own block hashes, in its own block size).
struct ReserveRequest {
  uint64_t tag = 0;  // Sender's correlation id for the answer.
  KvLayoutDescriptor sender;
  int32_t num_positions = 0;
  int32_t margin_positions = 0;
  std::vector<int32_t> prompt_tokens;
  // The router's grant for this attempt (kv_transfer/grant.h, encoded);
  // empty without one. A receiver with a grant key honours no reservation
  // without a valid one.
  std::string grant;
  // The request's prefix-cache salt (kv/block_hash.h): the cached
  // prefix the receiver looks up, and what the commit must name.
  CacheSalt cache_salt;
};

// Receiver -> sender. On error only tag, code and message are meaningful.
struct ReserveReply {
  uint64_t tag = 0;
  int32_t code = 0;  // absl::StatusCode
  std::string message;
  HandoffId id;
  KvLayoutDescriptor receiver;
  int32_t held_positions = 0;  // Prefix already in the receiver's blocks: not sent.
  int32_t num_blocks = 0;       // Blocks in the receiver's pool (its region layout).
  std::vector<int32_t> blocks;  // Receiver block table covering all positions + margin.
  std::string region;           // Packed remote-access descriptor of the receiver's pool.
  int32_t lease_ms = 0;
  // 1: the receiver verifies this handoff's KV; the commit must carry
  // layer_checksums.
  uint8_t verify = 0;
};

// Sender -> receiver after a layer's puts were issued, or (layer -1) alone
// while the sender waits to compute: renews the lease.
struct LayerSent {
  HandoffId id;
  int32_t layer = 0;
};

// Sender -> receiver after the last put is flushed.
struct Commit {
  HandoffId id;
  std::string request_id;     // The serving system's id of the request.
  int32_t num_positions = 0;
  std::vector<int32_t> tokens;  // Prompt (and any generated) ids, one per position.
  int32_t first_token = -1;
  float first_logprob = 0;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  SamplingParams sampling;
  uint64_t seed = 0;          // The seed actually used (RNG keyed by seed, position).
  int32_t generated = 0;      // Tokens generated so far (1 after prefill).
  uint8_t finish_reason = 0;  // FinishReason of the first token.
  // The request's prefix cache salt (kv/block_hash.h): the receiver
  // publishes the blocks under hashes seeded with it.
  CacheSalt cache_salt;
  // When the reservation asked for verification: per layer, the
  // LayerChecksum (kv/kv_checksum.h) of the receiver blocks it wrote, from
  // the one holding position held_positions to the one holding the last
  // position, in the receiver's layout; empty otherwise.
  std::vector<uint64_t> layer_checksums;
  // The response format (grammar/constraint.h) the sampling state is
  // under, by its spec's hash, and its matcher's digest after the tokens
  // so far: the receiver replays the first token and must reach the same
  // state. Both 0 when the request has no response format.
  uint64_t grammar_hash = 0;
  uint64_t grammar_digest = 0;
};

struct CommitReply {
  HandoffId id;
  int32_t code = 0;
  std::string message;
};

// Either direction. From the receiver: the lease expired or the receiver
// gave up; the sender stops writing, flushes and answers AbortAck. From the
// sender (sent after flushing): the receiver frees the blocks and acks.
struct Abort {
  HandoffId id;
  int32_t code = 0;
  std::string message;
};

struct AbortAck {
  HandoffId id;
};

// Receiver -> sender, once after a reservation on this connection was
// refused for lack of room (RESOURCE_EXHAUSTED), when KV has been freed
// since: asking again may now succeed. A sender waiting for room waits for
// this, not for a timer.
struct RoomFreed {};

using Message =
    std::variant<ReserveRequest, ReserveReply, LayerSent, Commit, CommitReply, Abort, AbortAck, RoomFreed>;

std::string Encode(const Message& m);
absl::StatusOr<Message> Decode(absl::string_view bytes);

inline absl::Status StatusFromWire(int32_t code, const std::string& message) {
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_WIRE_H_
