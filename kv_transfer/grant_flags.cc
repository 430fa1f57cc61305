#include "kv_transfer/grant_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "base/server_util.h"
#include "base/tls_flags.h"

ABSL_FLAG(std::string, kv_grant_key, "",
          "router and decode workers: the cluster's KV handoff grant key (a file of at least 32 bytes; "
          "deploy/make_certs.sh writes kv_grant.key). Required with TLS; --insecure runs without grants");

namespace pdserve {

absl::StatusOr<std::shared_ptr<const kv::GrantKey>> GrantKeyFromFlags(const std::string& role) {
  const std::string path = absl::GetFlag(FLAGS_kv_grant_key);
  if (path.empty()) {
    if (absl::GetFlag(FLAGS_insecure)) {
      LogEvent("warning", "no_kv_grants",
               {{"role", role},
                {"warning", "--insecure without --kv_grant_key: any host that reaches a decode worker's KV port "
                            "can reserve its blocks and write KV into them"}});
      return std::shared_ptr<const kv::GrantKey>();
    }
    return absl::InvalidArgumentError(
        "no KV handoff grants: give --kv_grant_key (deploy/make_certs.sh writes kv_grant.key beside the "
        "certificates), or --insecure");
  }
  absl::StatusOr<kv::GrantKey> key = kv::GrantKey::FromFile(path);
  if (!key.ok()) return absl::InvalidArgumentError(absl::StrCat("--kv_grant_key: ", key.status().message()));
  return std::make_shared<const kv::GrantKey>(*std::move(key));
}

}  // namespace pdserve
