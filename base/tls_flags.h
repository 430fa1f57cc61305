// The TLS flags every pdserve server shares, and what they mean:
//
//   --tls_cert FILE --tls_key FILE --tls_ca FILE   this service's certificate
//       and key, and the cluster CA (deploy/make_certs.sh makes a set);
//   --insecure      plaintext everywhere, for local debugging (logged as a
//                   warning at start and in the "serving" line);
//   --health_listen HOST:PORT   a plaintext port serving gRPC health only
//                   (for kubelet probes, which cannot present certificates).
//
// A server started with neither certificates nor --insecure refuses to
// start: there is no silent plaintext.
#ifndef PDSERVE_BASE_TLS_FLAGS_H_
#define PDSERVE_BASE_TLS_FLAGS_H_

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "base/tls.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(bool, insecure);
ABSL_DECLARE_FLAG(std::string, health_listen);

namespace pdserve {

// The files, checked for `role` (CheckTlsFiles), or none with --insecure.
// Errors: INVALID_ARGUMENT naming the flag.
absl::StatusOr<TlsFiles> TlsFilesFromFlags(const std::string& role);

}  // namespace pdserve

#endif  // PDSERVE_BASE_TLS_FLAGS_H_
