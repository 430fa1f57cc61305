// pdctl's cluster client commands: generate through a router, and status.
#ifndef PDSERVE_TOOLS_PDCTL_CLUSTER_COMMANDS_H_
#define PDSERVE_TOOLS_PDCTL_CLUSTER_COMMANDS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::pdctl {

// A channel to the router: TLS checked against --tls_ca when it is given
// (the router's certificate must name the address's host), else plaintext.
std::shared_ptr<grpc::Channel> RouterChannel(const std::string& router);
// Adds --api_key (or $PDSERVE_API_KEY) as "authorization: Bearer KEY".
void AddApiKey(grpc::ClientContext& ctx);

// Streams the generation's text to stdout as it arrives (ids too when
// `print_ids`), then the finish reason, usage, seed and timings on stderr.
absl::Status RemoteGenerate(const std::string& router, const v1::GenerateRequest& request, bool print_ids,
                            double timeout_seconds);

// Pools, workers and their load, from the router's ClusterStatus.
absl::Status RemoteStatus(const std::string& router, bool json);

// One gRPC health check of a server's plaintext health port (what a
// Kubernetes gRPC probe asks): OK and "SERVING" printed when it serves,
// else an error saying what it answered or why the call failed.
// `service`: "" for the whole server (readiness), "liveness" for liveness.
absl::Status Probe(const std::string& address, const std::string& service, double timeout_seconds);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_CLUSTER_COMMANDS_H_
