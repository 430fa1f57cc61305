#include "kv_transfer/grant.h"

#include <arpa/inet.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {

constexpr absl::string_view kMagic = "PDG2";

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutI64(std::string& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
void PutString(std::string& out, absl::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s.data(), s.size());
}

// Everything the MAC covers, in wire order.
std::string Signed(const Grant& g) {
  std::string out(kMagic);
  PutString(out, g.request_id);
  PutU32(out, g.attempt);
  PutString(out, g.sender);
  PutString(out, g.receiver);
  PutI64(out, g.expires_unix_ms);
  PutU32(out, static_cast<uint32_t>(g.positions));
  out.append(reinterpret_cast<const char*>(g.tokens_digest.data()), g.tokens_digest.size());
  return out;
}

std::array<uint8_t, 32> Mac(const GrantKey& key, absl::string_view data) {
  std::array<uint8_t, 32> mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.bytes().data(), static_cast<int>(key.bytes().size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac.data(), &len);
  return mac;
}

class Reader {
 public:
  explicit Reader(absl::string_view b) : b_(b) {}
  bool U32(uint32_t& v) {
    if (b_.size() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(b_[i])) << (8 * i);
    b_.remove_prefix(4);
    return true;
  }
  bool I64(int64_t& v) {
    if (b_.size() < 8) return false;
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u |= static_cast<uint64_t>(static_cast<uint8_t>(b_[i])) << (8 * i);
    b_.remove_prefix(8);
    v = static_cast<int64_t>(u);
    return true;
  }
  bool String(std::string& s) {
    uint32_t n = 0;
    if (!U32(n) || n > kGrantMaxField || n > b_.size()) return false;
    s.assign(b_.data(), n);
    b_.remove_prefix(n);
    return true;
  }
  bool Bytes(uint8_t* out, size_t n) {
    if (b_.size() < n) return false;
    std::memcpy(out, b_.data(), n);
    b_.remove_prefix(n);
    return true;
  }
  bool Done() const { return b_.empty(); }

 private:
  absl::string_view b_;
};

}  // namespace

absl::StatusOr<GrantKey> GrantKey::FromBytes(std::string bytes) {
  if (bytes.size() < kGrantMinKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("KV grant key: ", bytes.size(), " bytes, fewer than ",
                                                   kGrantMinKeyBytes, " (make one with `openssl rand -hex 32`)"));
  }
  return GrantKey(std::move(bytes));
}

absl::StatusOr<GrantKey> GrantKey::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string what = absl::StrCat("KV grant key file '", path, "': ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(what) : absl::NotFoundError(what);
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string bytes = ss.str();
  while (!bytes.empty() && absl::ascii_isspace(static_cast<unsigned char>(bytes.back()))) bytes.pop_back();
  absl::StatusOr<GrantKey> key = FromBytes(std::move(bytes));
  if (!key.ok()) return absl::InvalidArgumentError(absl::StrCat("'", path, "': ", key.status().message()));
  return key;
}

TokensDigest DigestTokens(absl::Span<const int32_t> tokens, const CacheSalt& salt) {
  TokensDigest digest{};
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  unsigned char buf[4096];
  size_t n = 0;
  for (const uint64_t half : {salt.lo, salt.hi}) {
    for (int i = 0; i < 8; ++i) buf[n++] = static_cast<unsigned char>((half >> (8 * i)) & 0xff);
  }
  for (int32_t t : tokens) {
    const auto u = static_cast<uint32_t>(t);
    for (int i = 0; i < 4; ++i) buf[n++] = static_cast<unsigned char>((u >> (8 * i)) & 0xff);
    if (n == sizeof(buf)) {
      EVP_DigestUpdate(ctx, buf, n);
      n = 0;
    }
  }
  EVP_DigestUpdate(ctx, buf, n);
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, digest.data(), &len);
  EVP_MD_CTX_free(ctx);
  return digest;
}

absl::StatusOr<Grant> MintGrant(const GrantKey& key, GrantFields fields) {
  for (const std::string* f : {&fields.request_id, &fields.sender, &fields.receiver}) {
    if (f->size() > kGrantMaxField) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV grant: a field of ", f->size(), " bytes (at most ", kGrantMaxField, ")"));
    }
  }
  if (fields.positions < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV grant: ", fields.positions, " positions"));
  }
  Grant g;
  g.request_id = std::move(fields.request_id);
  g.attempt = fields.attempt;
  g.sender = std::move(fields.sender);
  g.receiver = std::move(fields.receiver);
  g.expires_unix_ms = absl::ToUnixMillis(fields.expires);
  g.positions = fields.positions;
  g.tokens_digest = fields.tokens_digest;
  g.mac = Mac(key, Signed(g));
  return g;
}

std::string EncodeGrant(const Grant& g) {
  std::string out = Signed(g);
  out.append(reinterpret_cast<const char*>(g.mac.data()), g.mac.size());
  return out;
}

absl::StatusOr<Grant> DecodeGrant(absl::string_view bytes) {
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic) {
    return absl::InvalidArgumentError("KV grant: not a grant (bad magic)");
  }
  Reader r(bytes.substr(kMagic.size()));
  Grant g;
  uint32_t positions = 0;
  if (!r.String(g.request_id) || !r.U32(g.attempt) || !r.String(g.sender) || !r.String(g.receiver) ||
      !r.I64(g.expires_unix_ms) || !r.U32(positions) || !r.Bytes(g.tokens_digest.data(), g.tokens_digest.size()) ||
      !r.Bytes(g.mac.data(), g.mac.size()) || !r.Done()) {
    return absl::InvalidArgumentError("KV grant: truncated or malformed");
  }
  if (positions < 1 || positions > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("KV grant: ", positions, " positions"));
  }
  g.positions = static_cast<int32_t>(positions);
  return g;
}

const char* GrantRefusalName(GrantRefusal r) {
  switch (r) {
    case GrantRefusal::kNone:
      return "none";
    case GrantRefusal::kMissing:
      return "missing";
    case GrantRefusal::kMalformed:
      return "malformed";
    case GrantRefusal::kBadMac:
      return "bad_mac";
    case GrantRefusal::kExpired:
      return "expired";
    case GrantRefusal::kWrongReceiver:
      return "wrong_receiver";
    case GrantRefusal::kWrongSender:
      return "wrong_sender";
    case GrantRefusal::kReused:
      return "reused";
    case GrantRefusal::kCommitOtherConnection:
      return "commit_other_connection";
    case GrantRefusal::kCommitOtherRequest:
      return "commit_other_request";
    case GrantRefusal::kPutOutsideReservation:
      return "put_outside_reservation";
    case GrantRefusal::kTooManyPositions:
      return "too_many_positions";
    case GrantRefusal::kTokensMismatch:
      return "tokens_mismatch";
    case GrantRefusal::kLeaseOtherConnection:
      return "lease_other_connection";
  }
  return "unknown";
}

absl::Status VerifyGrant(const GrantKey& key, const Grant& g, absl::string_view receiver, absl::Time now,
                         GrantRefusal* why) {
  *why = GrantRefusal::kNone;
  const std::array<uint8_t, 32> want = Mac(key, Signed(g));
  if (CRYPTO_memcmp(want.data(), g.mac.data(), want.size()) != 0) {
    *why = GrantRefusal::kBadMac;
    return absl::PermissionDeniedError("KV grant refused: its MAC does not verify (not minted with this cluster's key)");
  }
  if (g.receiver != receiver) {
    *why = GrantRefusal::kWrongReceiver;
    return absl::PermissionDeniedError(
        absl::StrCat("KV grant refused: it is for decode worker ", g.receiver, ", not ", receiver));
  }
  if (absl::ToUnixMillis(now) >= g.expires_unix_ms) {
    *why = GrantRefusal::kExpired;
    return absl::PermissionDeniedError(absl::StrCat("KV grant refused: expired ",
                                                    absl::ToUnixMillis(now) - g.expires_unix_ms, " ms ago"));
  }
  return absl::OkStatus();
}

bool SenderMatches(absl::string_view grant_sender, absl::string_view peer_host) {
  if (peer_host.empty() || grant_sender == peer_host) return true;
  const std::string s(grant_sender);
  unsigned char buf[16];
  const bool literal = inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
  return !literal;
}

}  // namespace pdserve::kv
