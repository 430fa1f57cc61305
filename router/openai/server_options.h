// What the HTTP API (server.h) is configured with, and what it asks of the
// router. Its own header so that the server's parts (front.h, the
// generations) take it without the server.
//
// Thread safety: plain values.
#ifndef PDSERVE_ROUTER_OPENAI_SERVER_OPTIONS_H_
#define PDSERVE_ROUTER_OPENAI_SERVER_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/metrics.h"
#include "base/tls.h"
#include "kv/block_hash.h"
#include "router/api_keys.h"
#include "router/openai/request.h"
#include "router/relay.h"
#include "router/resolve.h"

namespace pdserve::router::openai {

struct HttpServerOptions {
  // HOST:PORT, [IPV6]:PORT; port 0: any free port.
  std::string address = "127.0.0.1:8000";
  // Larger bodies get a 413, unread (Content-Length says their size).
  int64_t max_body_bytes = 8 << 20;
  // A connection with nothing read or written for this long is closed
  // (between requests on a kept-alive connection, this is what applies).
  absl::Duration idle_timeout = absl::Seconds(600);
  // Open connections at most: one accepted beyond is closed at once,
  // unanswered (pdserve_http_connections_refused_total). Each costs a file
  // descriptor, so the process's limit must be above this.
  int max_connections = 4096;
  // A request's header block must be complete within header_timeout of
  // its first byte (of the connection's opening, for the first request),
  // and its body within request_timeout of the same moment; otherwise the
  // connection is closed (pdserve_http_deadline_closes_total): slow
  // clients cannot hold connections and buffers indefinitely.
  absl::Duration header_timeout = absl::Seconds(10);
  absl::Duration request_timeout = absl::Seconds(60);
  // Request bytes held at once across all connections: header blocks
  // being read, and the bodies of admitted requests until their generation
  // takes them. A body that does not fit is refused (503, Retry-After)
  // before it is read. Header blocks may hold an eighth of it (past that
  // the connection that grew it is closed): what clients without a key can
  // make the server keep.
  int64_t body_budget_bytes = 64 << 20;
  // Generations running at once, keys or none.
  int max_inflight = 4096;
  // A stream whose unsent bytes (the socket's buffer full, the rest waiting
  // in the server) pass this is a client that stopped reading: it is
  // cancelled (its KV freed) and its connection closed 5 s later.
  int64_t max_buffered_bytes = 4 << 20;
  // SO_SNDBUF of each connection (0: the kernel's, autotuned): how much a
  // client that stops reading can leave in the kernel before the server's
  // own buffer (above) starts to fill.
  int socket_send_buffer = 0;
  // completions' max_tokens when the body gives none (OpenAI's default).
  int32_t default_completion_tokens = 16;
  // A non-streamed request whose worst-case reply (request.h's
  // WholeReplyEntries) passes this is refused with 400 naming max_tokens.
  int64_t max_reply_entries = kDefaultMaxReplyEntries;
  // HTTPS with this certificate and key (base/tls.h; the CA is not used:
  // clients present no certificate). Both files are looked at every
  // second; a changed pair is loaded for new connections (ones already
  // open keep theirs), and a pair that does not load is logged and the
  // last good one kept. Not enabled: plain HTTP.
  TlsFiles tls;
};

// What the server asks of the router; everything must outlive it.
struct HttpBackend {
  const RequestResolver* resolver = nullptr;
  const RelayContext* relay = nullptr;
  // The key id for an Authorization header ("Bearer KEY"), or
  // UNAUTHENTICATED. Empty: no keys (every client is served).
  std::function<absl::StatusOr<std::string>(absl::string_view authorization, absl::string_view peer)> authenticate;
  // For a generation: the key checked and its limits taken (the lease is
  // held until the generation ends); RESOURCE_EXHAUSTED over a limit.
  // Empty: no keys.
  std::function<absl::StatusOr<KeyLease>(absl::string_view authorization, absl::string_view peer)> admit;
  // OK when a request can be placed now; otherwise why not.
  std::function<absl::Status()> ready;
  // The prefix-cache salt of a generation admitted under a key id
  // (--prefix_cache_scope=per_key). Empty: every request shares one cache.
  std::function<CacheSalt(const std::string& key_id)> cache_salt;
  // Where the server's own metrics go (none: not recorded): replies by status
  // code, and how long a streamed event waits between the relay queueing
  // it and the loop handing it to the socket.
  MetricsRegistry* metrics = nullptr;
};

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_SERVER_OPTIONS_H_
