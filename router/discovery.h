// Worker-address discovery: one entry of the router's --prefill/--decode
// lists, parsed into a WorkerTarget and resolved to the addresses it names
// now. A fixed target is one address used as is; a dns target names a host
// whose A and AAAA records are the workers, asked of the system resolver or
// of one given DNS server.
//
// Target forms:
//   host:port                      fixed (host: a name or an IPv4 literal)
//   [v6]:port                      fixed IPv6 literal
//   dns:///name:port               system resolver (getaddrinfo)
//   dns://SERVER[:PORT]/name:port  that server only; SERVER is an IPv4 or
//                                  [IPv6] literal, PORT defaults to 53
//
// Thread safety: thread-safe. Resolving keeps its resolver state local and
// never touches glibc's global `_res`.
#ifndef PDSERVE_ROUTER_DISCOVERY_H_
#define PDSERVE_ROUTER_DISCOVERY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace pdserve::router {

struct WorkerTarget {
  std::string spec;         // As given.
  bool dns = false;         // false: one fixed address, used as is.
  std::string name_server;  // dns only: "" = the system resolver; else "IP:PORT" or "[IP6]:PORT".
  std::string host;         // Host name or literal address (IPv6 without brackets).
  int port = 0;             // 1..65535.
};

// Errors: INVALID_ARGUMENT naming the target and what is wrong with it
// (missing port, port out of 1..65535, empty name, bad name server...).
absl::StatusOr<WorkerTarget> ParseWorkerTarget(absl::string_view spec);

// Every address `target` names now, as "ip:port" or "[ip6]:port", sorted,
// without duplicates. A fixed target gives its one address without any
// lookup. A dns target with a name server asks that server directly for A
// and AAAA records; one resolve of a silent server gives up after about
// `timeout` (rounded up to whole seconds, the resolver's granularity). A dns
// target without one uses getaddrinfo, whose time limits are the system's
// (resolv.conf); `timeout` does not apply there.
//
// Errors, each naming the target: NOT_FOUND when the name has no address
// (NXDOMAIN or no records); UNAVAILABLE when the server does not answer or
// fails; INVALID_ARGUMENT for a hand-built target with a bad name server.
// Blocks for the lookup; call it off latency-sensitive threads.
absl::StatusOr<std::vector<std::string>> ResolveWorkerTarget(const WorkerTarget& target, absl::Duration timeout);

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_DISCOVERY_H_
