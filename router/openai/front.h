// The HTTP server's front: what decides a request from its header block
// alone, before libevent's parser sees it and before any of its body is
// read.
//
// libevent has no hook between a request's headers and its body, so the
// front sits in each connection's input buffer: a callback on it takes
// each new run of bytes, holds a request's header block until it is
// complete, decides, and puts back either that block and its body or a
// stand-in request with the body dropped. The server's handler then takes
// the front's verdict for each request libevent hands it, in order: serve
// it, or answer with the refusal decided here. Deciding here is what lets a
// refused body go unread, so a client without a key, or one sending more
// than the limits allow, costs the server no more than its header block.
//
// A header block that does not parse is refused (400), as is one over
// 32 KiB (431), a method the server does not serve (405), a body without
// Content-Length (411) and a body on any request but a generation's (413).
// A generation request (a POST to a generation path) is refused without a
// valid key (401), with a body over max_body_bytes (413), while the server
// drains (503), or when its body would overrun body_budget_bytes (503,
// Retry-After). A refused body of announced size up to twice
// max_body_bytes is read and dropped, never held (a client still sending
// it reads the reply instead of a reset); a larger one is never read: the
// connection closes after the reply. The front also closes a connection
// accepted over max_connections at once, one whose request misses the
// header or request deadline, and one whose header block grows the header
// bytes held across all connections past an eighth of the body budget.
//
// Thread safety: the event loop's thread only, except the metrics'
// gauges, which any thread may read. The front outlives the connections
// it is given: ReleaseAll lets go of those libevent freed without closing.
#ifndef PDSERVE_ROUTER_OPENAI_FRONT_H_
#define PDSERVE_ROUTER_OPENAI_FRONT_H_

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "base/metrics.h"
#include "router/openai/response.h"
#include "router/openai/server_options.h"

namespace pdserve::router::openai {

// The paths the server answers; the front needs them to tell a generation
// request (the only kind with a body) from the rest.
enum class Route { kCompletions, kChat, kModels, kHealth, kMetrics, kUnknown };
Route RouteOf(absl::string_view path);

// The body of a refusal the server makes itself, in the shape of
// response.h's errors.
std::string ErrorBody(absl::string_view message, absl::string_view type, absl::string_view param = "");

class Front {
 public:
  // What the front asks of the server; called on the loop thread.
  struct Hooks {
    // The key check of a generation request on `conn`: OK to go on, else
    // the status to refuse it with (response.h's ErrorFor).
    std::function<absl::Status(const std::string& authorization, evhttp_connection* conn)> authenticate;
    // True once new generations are refused.
    std::function<bool()> draining;
    // A connection closes; the front has let go of it already.
    std::function<void(evhttp_connection* conn)> closed;
  };

  // What the front decided for one request before libevent parsed it.
  struct Verdict {
    int status = 0;  // 0: serve the request; else the reply to give instead
    std::string body;
    std::vector<std::pair<std::string, std::string>> headers;
    int64_t reserved = 0;  // body bytes held against the budget until the handler takes the body
  };

  // `options` must outlive the front.
  Front(const HttpServerOptions& options, Hooks hooks);
  ~Front();
  Front(const Front&) = delete;
  Front& operator=(const Front&) = delete;

  // Registers the front's gauges and counters (open connections, refused
  // connections, deadline closes, the budget's use and refusals).
  // REQUIRES: at most once, before the first Add.
  void AddMetrics(MetricsRegistry* m);

  // libevent's own header limit, which must let through what the front
  // passes on (a header block at the front's limit, or a stand-in).
  static size_t MaxHeadersForParser();

  // A new connection's bufferevent, before libevent reads from it: the
  // front holds a reference to it until the connection closes.
  void Add(event_base* base, bufferevent* bev);

  // The next verdict for a request on `conn`, in libevent's order (a
  // request the front never saw: serve it).
  Verdict TakeVerdict(evhttp_connection* conn);

  // A verdict's reserved bytes leave the budget (the body was taken, or
  // dropped with its request).
  void ReturnToBudget(int64_t bytes);

  // Lets go of every connection still held.
  // REQUIRES: libevent's connections are freed; the event base is not yet.
  void ReleaseAll();

 private:
  struct Connection;

  void Release(Connection& c);
  static evhttp_connection* ConnectionOf(const Connection& c);
  bool Attach(Connection& c);
  static void OnAttach(evutil_socket_t, short, void* arg);
  static void OnClose(evhttp_connection* conn, void* arg);
  void Closed(evhttp_connection* conn);
  void ArmTimer(Connection& c);
  static void OnTimer(evutil_socket_t, short, void* arg);
  static void OnInput(evbuffer* buf, const evbuffer_cb_info* info, void* arg);
  void Input(Connection& c, evbuffer* buf, size_t n);
  void Decide(Connection& c, std::string* out);
  void Admit(Connection& c, std::string* out, const std::string& block, int64_t body_bytes);
  void Refuse(Connection& c, std::string* out, const HttpError& e);
  void Refuse(Connection& c, std::string* out, int status, std::string body,
              std::vector<std::pair<std::string, std::string>> headers = {});
  void EndRequest(Connection& c);

  const HttpServerOptions& options_;
  const Hooks hooks_;
  Counter* refused_connections_ = nullptr;
  Counter* header_timeouts_ = nullptr;
  Counter* request_timeouts_ = nullptr;
  Counter* budget_refusals_ = nullptr;

  // Each open connection's state, by its bufferevent.
  absl::flat_hash_map<bufferevent*, std::unique_ptr<Connection>> connections_;
  // The gauges' (shared: a scrape may come after the server is gone): open
  // connections, and bytes held against the body budget.
  std::shared_ptr<std::atomic<int64_t>> open_connections_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> budget_used_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_FRONT_H_
