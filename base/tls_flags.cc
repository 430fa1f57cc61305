#include "base/tls_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "base/server_util.h"

ABSL_FLAG(std::string, tls_cert, "", "this service's TLS certificate chain (PEM), read again when it changes");
ABSL_FLAG(std::string, tls_key, "", "the private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_ca, "", "the cluster CA (PEM): peers' certificates must come from it");
ABSL_FLAG(bool, insecure, false,
          "plaintext gRPC and HTTP, no peer checks: for local debugging only (a server with neither --tls_* nor "
          "--insecure does not start)");
ABSL_FLAG(std::string, health_listen, "",
          "a plaintext port serving only gRPC health (kubelet probes cannot present certificates); empty: none");

namespace pdserve {

absl::StatusOr<TlsFiles> TlsFilesFromFlags(const std::string& role) {
  TlsFiles f;
  f.cert = absl::GetFlag(FLAGS_tls_cert);
  f.key = absl::GetFlag(FLAGS_tls_key);
  f.ca = absl::GetFlag(FLAGS_tls_ca);
  const bool any = !f.cert.empty() || !f.key.empty() || !f.ca.empty();
  if (absl::GetFlag(FLAGS_insecure)) {
    if (any) return absl::InvalidArgumentError("--insecure: give it or the --tls_* files, not both");
    LogEvent("warning", "insecure",
             {{"role", role},
              {"warning", "--insecure: plaintext, unauthenticated peers; anyone who can reach these ports can read "
                          "prompts and tokens and impersonate a pdserve service. For local debugging only."}});
    return TlsFiles();
  }
  if (!any) {
    return absl::InvalidArgumentError(
        "no TLS: give --tls_cert, --tls_key and --tls_ca (deploy/make_certs.sh makes a development set), or "
        "--insecure for plaintext");
  }
  if (absl::Status st = CheckTlsFiles(f, role); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_*: ", st.message()));
  }
  return f;
}

}  // namespace pdserve
