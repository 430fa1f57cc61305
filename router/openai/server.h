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
#include "router/openai/server_options.h"

namespace pdserve::router::openai {

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
