#include "router/discovery.h"

#include <arpa/inet.h>
#include <arpa/nameser.h>
#include <netdb.h>
#include <netinet/in.h>
#include <resolv.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pdserve::router {
namespace {

constexpr absl::string_view kDnsScheme = "dns://";
constexpr int kDnsPort = 53;

struct HostPort {
  std::string host;
  int port = 0;
  bool bracketed = false;  // Written as [v6].
};

absl::Status Invalid(absl::string_view spec, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("worker target '", spec, "': ", what));
}

bool IsIpv4(const std::string& s) {
  in_addr a;
  return inet_pton(AF_INET, s.c_str(), &a) == 1;
}

bool IsIpv6(const std::string& s) {
  in6_addr a;
  return inet_pton(AF_INET6, s.c_str(), &a) == 1;
}

bool IsHostName(absl::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return absl::ascii_isalnum(c) || c == '-' || c == '.' || c == '_'; });
}

std::string FormatAddress(absl::string_view host, int port) {
  return absl::StrContains(host, ':') ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

// Parses "host:port" or "[v6]:port" out of `text`, a part of `spec`.
// `role` names the part in errors; with `default_port` > 0 the port may be
// left out.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view spec, absl::string_view text, absl::string_view role,
                                       int default_port) {
  HostPort out;
  absl::string_view port_text;
  bool has_port = false;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos) return Invalid(spec, absl::StrCat("unclosed '[' in ", role));
    out.host = std::string(text.substr(1, close - 1));
    out.bracketed = true;
    if (!IsIpv6(out.host)) return Invalid(spec, absl::StrCat(role, " '[", out.host, "]' is not an IPv6 address"));
    const absl::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') return Invalid(spec, absl::StrCat("expected ':' after ']' in ", role));
      port_text = rest.substr(1);
      has_port = true;
    }
  } else {
    const size_t colon = text.rfind(':');
    out.host = std::string(text.substr(0, colon));
    if (colon != absl::string_view::npos) {
      port_text = text.substr(colon + 1);
      has_port = true;
    }
    if (out.host.empty()) return Invalid(spec, absl::StrCat("empty ", role));
    if (absl::StrContains(out.host, ':')) {
      return Invalid(spec, absl::StrCat("an IPv6 ", role, " needs brackets, as [addr]:port"));
    }
    if (!IsHostName(out.host)) return Invalid(spec, absl::StrCat("bad ", role, " '", out.host, "'"));
  }
  if (!has_port) {
    if (default_port <= 0) return Invalid(spec, absl::StrCat("missing port after ", role));
    out.port = default_port;
    return out;
  }
  if (port_text.empty()) return Invalid(spec, absl::StrCat("missing port after ", role));
  if (!std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit)) {
    return Invalid(spec, absl::StrCat("port '", port_text, "' is not a number"));
  }
  int port = 0;
  if (port_text.size() > 5 || !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return Invalid(spec, absl::StrCat("port ", port_text, " out of range 1..65535"));
  }
  out.port = port;
  return out;
}

// A DNS server given as a literal: "IPv4[:port]" or "[IPv6][:port]".
absl::StatusOr<HostPort> ParseNameServer(absl::string_view spec, absl::string_view text) {
  absl::StatusOr<HostPort> server = ParseHostPort(spec, text, "name server", kDnsPort);
  if (!server.ok()) return server;
  if (!server->bracketed && !IsIpv4(server->host)) {
    return Invalid(spec, absl::StrCat("name server '", server->host, "' must be an IPv4 or [IPv6] literal"));
  }
  return server;
}

// One resolver context of its own (res_ninit) aimed at a single server;
// closed (res_nclose) with the object.
class ServerResolver {
 public:
  ServerResolver(const WorkerTarget& target, std::string server) : target_(target), server_(std::move(server)) {}
  ~ServerResolver() {
    if (open_) res_nclose(&state_);
  }
  ServerResolver(const ServerResolver&) = delete;
  ServerResolver& operator=(const ServerResolver&) = delete;

  absl::Status Open(const HostPort& server, absl::Duration timeout);
  // Appends the addresses in `name`'s records of `type` (ns_t_a or
  // ns_t_aaaa). NOT_FOUND: NXDOMAIN. No records of the type is not an error.
  absl::Status Query(int type, std::vector<std::string>* out);

 private:
  absl::Status Error(absl::StatusCode code, absl::string_view what) const {
    return absl::Status(code, absl::StrCat("worker target '", target_.spec, "': ", what));
  }

  const WorkerTarget& target_;
  const std::string server_;
  struct __res_state state_ {};
  bool open_ = false;
};

absl::Status ServerResolver::Open(const HostPort& server, absl::Duration timeout) {
  if (res_ninit(&state_) != 0) return Error(absl::StatusCode::kInternal, "res_ninit failed");
  open_ = true;
  // Drop the resolv.conf servers; glibc keeps IPv6 ones in malloc'd _ext
  // slots that res_nclose frees only below nscount.
  for (int i = 0; i < state_.nscount; ++i) {
    free(state_._u._ext.nsaddrs[i]);
    state_._u._ext.nsaddrs[i] = nullptr;
  }
  if (server.bracketed) {
    // An IPv6 server does not fit nsaddr_list; glibc reads it from the _ext
    // slot when the nsaddr_list entry's family is 0, and frees it on close.
    auto* sin6 = static_cast<sockaddr_in6*>(calloc(1, sizeof(sockaddr_in6)));
    if (sin6 == nullptr) return Error(absl::StatusCode::kResourceExhausted, "out of memory");
    sin6->sin6_family = AF_INET6;
    sin6->sin6_port = htons(static_cast<uint16_t>(server.port));
    inet_pton(AF_INET6, server.host.c_str(), &sin6->sin6_addr);
    std::memset(&state_.nsaddr_list[0], 0, sizeof(state_.nsaddr_list[0]));
    state_._u._ext.nsaddrs[0] = sin6;
  } else {
    sockaddr_in& sin = state_.nsaddr_list[0];
    std::memset(&sin, 0, sizeof(sin));
    sin.sin_family = AF_INET;
    sin.sin_port = htons(static_cast<uint16_t>(server.port));
    inet_pton(AF_INET, server.host.c_str(), &sin.sin_addr);
  }
  state_.nscount = 1;
  // One try of `retrans` seconds: the resolver's clock has whole seconds.
  state_.retrans = std::max(1, static_cast<int>(std::ceil(absl::ToDoubleSeconds(timeout))));
  state_.retry = 1;
  return absl::OkStatus();
}

absl::Status ServerResolver::Query(int type, std::vector<std::string>* out) {
  std::vector<unsigned char> answer(65536);
  errno = 0;
  const int len =
      res_nquery(&state_, target_.host.c_str(), ns_c_in, type, answer.data(), static_cast<int>(answer.size()));
  if (len < 0) {
    const int err = errno;
    switch (state_.res_h_errno) {
      case HOST_NOT_FOUND:
        return Error(absl::StatusCode::kNotFound,
                     absl::StrCat("no such name '", target_.host, "' (NXDOMAIN from ", server_, ")"));
      case NO_DATA:
        return absl::OkStatus();
      case TRY_AGAIN:
        return Error(absl::StatusCode::kUnavailable,
                     absl::StrCat("name server ", server_, " did not answer for '", target_.host, "'",
                                  err == 0 ? "" : absl::StrCat(" (", std::strerror(err), ")")));
      default:
        return Error(absl::StatusCode::kUnavailable,
                     absl::StrCat("name server ", server_, " failed the query for '", target_.host, "'"));
    }
  }
  ns_msg msg;
  if (ns_initparse(answer.data(), std::min(len, static_cast<int>(answer.size())), &msg) != 0) {
    return Error(absl::StatusCode::kUnavailable, absl::StrCat("malformed answer from name server ", server_));
  }
  for (int i = 0; i < ns_msg_count(msg, ns_s_an); ++i) {
    ns_rr rr;
    if (ns_parserr(&msg, ns_s_an, i, &rr) != 0) {
      return Error(absl::StatusCode::kUnavailable, absl::StrCat("malformed answer from name server ", server_));
    }
    if (ns_rr_class(rr) != ns_c_in || ns_rr_type(rr) != type) continue;  // E.g. the CNAME chain.
    const int family = type == ns_t_a ? AF_INET : AF_INET6;
    if (ns_rr_rdlen(rr) != (family == AF_INET ? 4 : 16)) continue;
    char text[INET6_ADDRSTRLEN];
    if (inet_ntop(family, ns_rr_rdata(rr), text, sizeof(text)) != nullptr) {
      out->push_back(FormatAddress(text, target_.port));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ResolveWithServer(const WorkerTarget& target, absl::Duration timeout) {
  absl::StatusOr<HostPort> server = ParseNameServer(target.spec, target.name_server);
  if (!server.ok()) return server.status();
  ServerResolver resolver(target, FormatAddress(server->host, server->port));
  if (absl::Status s = resolver.Open(*server, timeout); !s.ok()) return s;
  std::vector<std::string> out;
  // A first: a dead server or an unknown name ends it without a second wait.
  if (absl::Status s = resolver.Query(ns_t_a, &out); !s.ok()) return s;
  if (absl::Status s = resolver.Query(ns_t_aaaa, &out); !s.ok() && !absl::IsNotFound(s)) return s;
  return out;
}

absl::StatusOr<std::vector<std::string>> ResolveWithSystem(const WorkerTarget& target) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const int rc = getaddrinfo(target.host.c_str(), std::to_string(target.port).c_str(), &hints, &list);
  if (rc != 0) {
    const std::string what = absl::StrCat("worker target '", target.spec, "': resolving '", target.host,
                                          "': ", rc == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(rc));
    switch (rc) {
      case EAI_NONAME:
      case EAI_NODATA:
      case EAI_ADDRFAMILY:
        return absl::NotFoundError(what);
      case EAI_AGAIN:
      case EAI_FAIL:
      case EAI_SYSTEM:
        return absl::UnavailableError(what);
      default:
        return absl::InternalError(what);
    }
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(list, &freeaddrinfo);
  std::vector<std::string> out;
  for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN];
    const void* addr = nullptr;
    if (ai->ai_family == AF_INET) {
      addr = &reinterpret_cast<const sockaddr_in*>(ai->ai_addr)->sin_addr;
    } else if (ai->ai_family == AF_INET6) {
      addr = &reinterpret_cast<const sockaddr_in6*>(ai->ai_addr)->sin6_addr;
    } else {
      continue;
    }
    if (inet_ntop(ai->ai_family, addr, text, sizeof(text)) != nullptr) {
      out.push_back(FormatAddress(text, target.port));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<WorkerTarget> ParseWorkerTarget(absl::string_view spec) {
  WorkerTarget target;
  target.spec = std::string(spec);
  if (spec.empty()) return Invalid(spec, "empty");
  absl::string_view address = spec;
  if (absl::StartsWith(spec, kDnsScheme)) {
    target.dns = true;
    const absl::string_view rest = spec.substr(kDnsScheme.size());
    const size_t slash = rest.find('/');
    if (slash == absl::string_view::npos) return Invalid(spec, "expected '/' before the name (dns:///name:port)");
    if (slash > 0) {
      absl::StatusOr<HostPort> server = ParseNameServer(spec, rest.substr(0, slash));
      if (!server.ok()) return server.status();
      target.name_server = FormatAddress(server->host, server->port);
    }
    address = rest.substr(slash + 1);
    if (address.empty() || address[0] == ':') return Invalid(spec, "empty name");
    if (address[0] == '[') return Invalid(spec, "a dns target needs a host name, not an address literal");
  } else if (const size_t scheme = spec.find("://"); scheme != absl::string_view::npos) {
    return Invalid(spec, absl::StrCat("unsupported scheme '", spec.substr(0, scheme), "' (only dns://)"));
  }
  absl::StatusOr<HostPort> host = ParseHostPort(spec, address, target.dns ? "name" : "host", 0);
  if (!host.ok()) return host.status();
  target.host = std::move(host->host);
  target.port = host->port;
  return target;
}

absl::StatusOr<std::vector<std::string>> ResolveWorkerTarget(const WorkerTarget& target, absl::Duration timeout) {
  absl::StatusOr<std::vector<std::string>> addresses;
  if (!target.dns) {
    addresses = std::vector<std::string>{FormatAddress(target.host, target.port)};
  } else if (!target.name_server.empty()) {
    addresses = ResolveWithServer(target, timeout);
  } else {
    addresses = ResolveWithSystem(target);
  }
  if (!addresses.ok()) return addresses;
  if (addresses->empty()) {
    return absl::NotFoundError(absl::StrCat("worker target '", target.spec, "': '", target.host, "' has no address"));
  }
  std::sort(addresses->begin(), addresses->end());
  addresses->erase(std::unique(addresses->begin(), addresses->end()), addresses->end());
  return addresses;
}

}  // namespace pdserve::router
