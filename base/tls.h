// TLS for pdserve's gRPC hops, and who is on the other end.
//
// Every service holds a certificate from the cluster CA that names its role
// as the DNS name ROLE.pdserve.internal (deploy/make_certs.sh makes a
// development set). Between services TLS is mutual:
//   - a worker's server requires a client certificate from the CA and
//     refuses any call whose peer is not a router;
//   - the router dials each worker with its own certificate and checks the
//     worker's certificate against the role it dials (the TLS host name is
//     ROLE.pdserve.internal whatever address it connects to), so an
//     impostor with another role's certificate, or one from another CA,
//     never gets a call.
// The router's client-facing port is server-side TLS only (clients check
// it against the CA; API keys authenticate them).
//
// Certificate, key and CA are read from files and read again when they
// change (gRPC's file watcher, every `refresh`): rotation needs no restart,
// and connections made before it keep going.
//
// Thread safety: thread-safe (pure functions and immutable credentials).
#ifndef PDSERVE_BASE_TLS_H_
#define PDSERVE_BASE_TLS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace pdserve {

struct TlsFiles {
  std::string cert;  // PEM: the service's certificate (chain)
  std::string key;   // PEM: its private key
  std::string ca;    // PEM: the cluster CA
  absl::Duration refresh = absl::Seconds(1);
  bool enabled() const { return !cert.empty(); }
};

// "router" -> "router.pdserve.internal": the name a role's certificate holds.
std::string RoleHostName(const std::string& role);

// Checks that the three files exist and parse, that the key is the
// certificate's, that the CA signed the certificate and that the
// certificate names `role`. Errors: INVALID_ARGUMENT saying which file and why.
absl::Status CheckTlsFiles(const TlsFiles& files, const std::string& role);

// Server credentials. `peer_role` empty: server-side TLS only (clients send
// no certificate). Otherwise mutual TLS: a client certificate from the CA
// is required and every call whose peer's certificate does not name
// `peer_role` ends with UNAUTHENTICATED saying whose it was.
std::shared_ptr<grpc::ServerCredentials> ServerTlsCredentials(const TlsFiles& files, const std::string& peer_role);

// Channel credentials presenting our certificate (when `files.cert` is
// set) and trusting the CA; `args` gets the host name the server's
// certificate must hold: `server_role`'s, or, when that is empty, the
// address's own host (clients of the router).
std::shared_ptr<grpc::ChannelCredentials> ChannelTlsCredentials(const TlsFiles& files, const std::string& server_role,
                                                                grpc::ChannelArguments* args);

}  // namespace pdserve

#endif  // PDSERVE_BASE_TLS_H_
