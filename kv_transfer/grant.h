// Handoff grants: the router's decision, carried by the prefill worker to
// the decode worker, that lets exactly one sender reserve KV blocks there
// for one attempt of one request.
//
// A grant names the request id, the attempt (every prefill retry and every
// migration is a new attempt), the sender (the host of the prefill worker
// the router chose), the receiver (the decode worker's KV address as the
// router knows it), an expiry, the most positions the reservation may
// cover (the context plus its room to decode) and a SHA-256 digest of the
// context's token ids, and carries an HMAC-SHA256 over all of them keyed
// by the cluster's grant key (a file shared by the router and the decode
// workers; prefill workers never hold it). A decode worker can therefore
// check a grant alone, whether or not the router's Decode call for the
// request has reached it yet.
//
// Why the digest: at commit the decode worker publishes the reserved
// blocks to its prefix cache under hashes of the token ids the sender
// names. Bound to the router's tokens, a sender can publish KV only under
// the prompt the router placed with it, never under another one (a popular
// system prompt, say) that every tenant's requests would then read.
//
// Why an HMAC and not a signature: the router mints one grant per attempt
// and a decode worker checks one per reservation; an HMAC costs about a
// microsecond each way, a signature's check tens to hundreds, and the
// parties that must trust each other (router and decode workers) already
// share the cluster's secrets (its TLS material is made and mounted the same
// way). What it does not give: a decode worker holding the key could mint
// grants; a decode worker is trusted with the KV it receives anyway.
//
// Encoding: "PDG2", then request id, attempt, sender, receiver, expiry,
// positions, the 32-byte token digest (strings as a u32 length and bytes,
// integers little-endian fixed width), then the 32-byte MAC over
// everything before it. Decoding checks every
// length against the buffer and the limits below and never trusts a count.
//
// Thread safety: plain values and pure functions; GrantKey is immutable.
#ifndef PDSERVE_KV_TRANSFER_GRANT_H_
#define PDSERVE_KV_TRANSFER_GRANT_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"

namespace pdserve::kv {

inline constexpr size_t kGrantMaxField = 512;   // Bytes of each string field.
inline constexpr size_t kGrantMinKeyBytes = 32;

// The cluster's grant key: the bytes of a file (trailing whitespace
// removed), at least kGrantMinKeyBytes of them (`openssl rand -hex 32`
// makes one; deploy/make_certs.sh writes kv_grant.key).
class GrantKey {
 public:
  // Errors: NOT_FOUND / PERMISSION_DENIED (unreadable), INVALID_ARGUMENT
  // (shorter than kGrantMinKeyBytes), each naming the file.
  static absl::StatusOr<GrantKey> FromFile(const std::string& path);
  // For tests and tools. Errors: INVALID_ARGUMENT when too short.
  static absl::StatusOr<GrantKey> FromBytes(std::string bytes);

  const std::string& bytes() const { return bytes_; }

 private:
  explicit GrantKey(std::string bytes) : bytes_(std::move(bytes)) {}
  std::string bytes_;
};

using TokensDigest = std::array<uint8_t, 32>;

// SHA-256 of the prefix-cache salt (its low then high 64 bits, little-
// endian) and the token ids, each as 4 bytes little-endian: what a grant
// binds a handoff's context to, so the blocks the receiver publishes are
// keyed by the prompt and the cache scope (kv/block_hash.h) the router
// placed, never by ones the sender picks.
TokensDigest DigestTokens(absl::Span<const int32_t> tokens, const CacheSalt& salt = {});

struct Grant {
  std::string request_id;
  uint32_t attempt = 0;
  std::string sender;    // Host (IP literal or name) of the prefill worker.
  std::string receiver;  // The decode worker's KV address (host:port).
  int64_t expires_unix_ms = 0;
  int32_t positions = 0;  // Most positions (context + margin) a reservation may cover.
  TokensDigest tokens_digest{};  // DigestTokens of the context the sender must hand off.
  std::array<uint8_t, 32> mac{};
};

// What the router grants, before it is MAC'd.
struct GrantFields {
  std::string request_id;
  uint32_t attempt = 0;
  std::string sender;
  std::string receiver;
  absl::Time expires;
  int32_t positions = 0;
  TokensDigest tokens_digest{};
};

// The grant for these fields, MAC'd with `key`. Fields longer than
// kGrantMaxField, or positions below 1, are an INVALID_ARGUMENT.
absl::StatusOr<Grant> MintGrant(const GrantKey& key, GrantFields fields);

std::string EncodeGrant(const Grant& g);
// INVALID_ARGUMENT for a truncated, oversized or otherwise malformed grant.
absl::StatusOr<Grant> DecodeGrant(absl::string_view bytes);

// Why a grant was refused (for the metric's label).
// The last two are a commit's: from another connection than the one that
// reserved, or naming another request than the grant's.
enum class GrantRefusal {
  kNone,
  kMissing,
  kMalformed,
  kBadMac,
  kExpired,
  kWrongReceiver,
  kWrongSender,
  kReused,
  kCommitOtherConnection,
  kCommitOtherRequest,
  kPutOutsideReservation,  // Over TCP: a write into blocks not reserved for its connection.
  kTooManyPositions,       // A reservation larger than its grant's positions.
  kTokensMismatch,         // A reservation's or commit's token ids are not the grant's context.
  kLeaseOtherConnection,   // A lease renewal from another connection than the one that reserved.
};
inline constexpr int kGrantRefusalKinds = 14;
const char* GrantRefusalName(GrantRefusal r);

// Checks the MAC (constant time), then that `receiver` is the grant's and
// `now` is before its expiry. PERMISSION_DENIED naming what failed, with
// *why set; OK leaves it kNone.
absl::Status VerifyGrant(const GrantKey& key, const Grant& g, absl::string_view receiver, absl::Time now,
                         GrantRefusal* why);

// Whether a connection from `peer_host` (the address the transport saw)
// may present a grant for `grant_sender`: equal, or `grant_sender` is not an
// IP literal (a name the receiver does not resolve: the MAC still binds the
// rest; documented in docs/security.md), or `peer_host` is empty
// (a transport that cannot tell).
bool SenderMatches(absl::string_view grant_sender, absl::string_view peer_host);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_GRANT_H_
