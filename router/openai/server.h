// The OpenAI-compatible HTTP API on the router (libevent's evhttp; why
// libevent: tools/bench/http_sse/README.md):
//
//   POST /v1/completions, POST /v1/chat/completions   streamed (SSE) or not
//   GET  /v1/models                                   the served model
//   GET  /health                                      200 when a request can be placed, else 503
//
// One event-loop thread owns every connection. Ahead of libevent's parser
// a front (front.h) reads each request's header block itself and decides
// before any of the body is read: a generation request without a valid
// key (401), with a body over max_body_bytes (413), without Content-Length
// (411), or whose body would overrun the body budget (503, Retry-After) is
// answered before any of its body is read. A refused body of announced
// size up to twice max_body_bytes is then read and dropped, never held (a
// client still sending it reads the reply instead of a reset); a larger
// one is never read: the connection closes after the reply. The front also
// closes a connection accepted over max_connections at once, and one whose
// request misses the header or request deadline.
//
// A generation runs on a thread of its own, at most max_inflight at once
// (more: 503 with Retry-After, as when no thread can be started): the body
// is decoded (request.h), the key and its limits checked, the
// prompt resolved (router/resolve.h, the gRPC path's code) and a Relay run
// (router/relay.h), exactly as for a gRPC call. The relay thread formats
// each message (response.h) and hands the bytes to the loop through a list
// and an eventfd; the loop writes them at once, one chunk per wake-up (the
// sockets have TCP_NODELAY), so every token leaves as its own event unless
// the loop is already behind. A connection that closes cancels its relay,
// which cancels the worker calls and frees the request's KV on both sides.
//
// Errors before the first token get their own HTTP status (response.h's
// ErrorFor: 400 naming the field, 401, 404 unknown model, 413 body too
// large, 429 with Retry-After, 503); after it, an error event ends the
// stream. Request bodies need Content-Length; only the generation
// endpoints take one.
//
// Thread safety: Start and the destructor from one thread; the rest is
// internal.
#ifndef PDSERVE_ROUTER_OPENAI_SERVER_H_
#define PDSERVE_ROUTER_OPENAI_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kv/block_hash.h"
#include "base/metrics.h"
#include "base/tls.h"
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

class HttpServer {
 public:
  // Binds and starts serving. Errors: INVALID_ARGUMENT for a bad address
  // or certificate, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options, HttpBackend backend);
  // Stops serving: generations still running are cancelled (their KV
  // freed), then the connections are closed.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  // New generations get 503 from now on; waits until those running have
  // finished or `deadline` passes.
  void Drain(absl::Time deadline);

 private:
  class Impl;
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "HOST:PORT" / "[V6]:PORT" as its host and port. Errors: INVALID_ARGUMENT.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(absl::string_view address);

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_SERVER_H_
