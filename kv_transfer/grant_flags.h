// --kv_grant_key, the flag the router and decode workers share for KV
// handoff grants (grant.h), and the key it names. Beside the grants
// themselves, so that base/ (TLS and the other server flags) knows
// nothing of the KV plane.
#ifndef PDSERVE_KV_TRANSFER_GRANT_FLAGS_H_
#define PDSERVE_KV_TRANSFER_GRANT_FLAGS_H_

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "kv_transfer/grant.h"

ABSL_DECLARE_FLAG(std::string, kv_grant_key);

namespace pdserve {

// The KV handoff grant key of --kv_grant_key (router and decode workers).
// Without one: none (null) with --insecure (logged as a warning), else
// INVALID_ARGUMENT: a TLS cluster does not run without grants. Errors name
// the flag.
absl::StatusOr<std::shared_ptr<const kv::GrantKey>> GrantKeyFromFlags(const std::string& role);

}  // namespace pdserve

#endif  // PDSERVE_KV_TRANSFER_GRANT_FLAGS_H_
