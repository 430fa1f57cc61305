// libFuzzer target: the KV handoff grant decoder and check (kv_transfer/
// grant.h), which read bytes any host that reaches a decode worker's KV port
// can send.
//
// Promises: DecodeGrant never crashes; whatever it accepts encodes back to
// the same bytes, and VerifyGrant refuses it (the fuzzer cannot know the key
// the seeds were minted with, here 32 'k' bytes, unless it copies a seed's
// MAC unchanged) unless it is byte for byte a grant minted with that key.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "kv_transfer/grant.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<pdserve::kv::Grant> g = pdserve::kv::DecodeGrant(bytes);
  if (!g.ok()) return 0;
  const std::string again = pdserve::kv::EncodeGrant(*g);
  if (again != bytes) {
    std::fprintf(stderr, "grant_fuzz: an accepted grant encodes to other bytes\n");
    std::abort();
  }
  static const pdserve::kv::GrantKey key = *pdserve::kv::GrantKey::FromBytes(std::string(32, 'k'));
  pdserve::kv::GrantRefusal why;
  const absl::Status s = pdserve::kv::VerifyGrant(key, *g, g->receiver, absl::FromUnixSeconds(0), &why);
  if (s.ok()) {
    // Only a real grant verifies: re-minting its fields must give its MAC.
    absl::StatusOr<pdserve::kv::Grant> real =
        pdserve::kv::MintGrant(key, {.request_id = g->request_id,
                                     .attempt = g->attempt,
                                     .sender = g->sender,
                                     .receiver = g->receiver,
                                     .expires = absl::FromUnixMillis(g->expires_unix_ms),
                                     .positions = g->positions,
                                     .tokens_digest = g->tokens_digest});
    if (!real.ok() || real->mac != g->mac) {
      std::fprintf(stderr, "grant_fuzz: a grant verified that was not minted with the key\n");
      std::abort();
    }
  }
  return 0;
}
