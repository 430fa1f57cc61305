#include "router/openai/server.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/ssl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "base/server_util.h"
#include "nlohmann/json.hpp"
#include "router/openai/call.h"
#include "router/openai/front.h"
#include "router/openai/generation.h"
#include "router/openai/replies.h"
#include "router/openai/request.h"
#include "router/openai/response.h"
#include "router/openai/server_tls.h"

namespace pdserve::router::openai {
namespace {

// TCP_NODELAY (every event leaves at once) and, when set, SO_SNDBUF.
void SetSocketOptions(evhttp_connection* conn, int send_buffer) {
  bufferevent* bev = evhttp_connection_get_bufferevent(conn);
  const evutil_socket_t fd = bev == nullptr ? -1 : bufferevent_getfd(bev);
  if (fd < 0) return;
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (send_buffer > 0) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &send_buffer, sizeof(send_buffer));
}


}  // namespace

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(absl::string_view address) {
  std::string host;
  absl::string_view rest;
  if (absl::StartsWith(address, "[")) {
    const size_t end = address.find(']');
    if (end == absl::string_view::npos) return absl::InvalidArgumentError(absl::StrCat("'", address, "': no ']'"));
    host = std::string(address.substr(1, end - 1));
    rest = address.substr(end + 1);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("'", address, "': expected HOST:PORT"));
    }
    host = std::string(address.substr(0, colon));
    rest = address.substr(colon);
  }
  int port = -1;
  if (!absl::ConsumePrefix(&rest, ":") || !absl::SimpleAtoi(rest, &port) || port < 0 || port > 65535 ||
      host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "': expected HOST:PORT with a port in 0-65535"));
  }
  return std::pair<std::string, int>(std::move(host), port);
}

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpBackend backend)
      : options_(std::move(options)),
        backend_(std::move(backend)),
        front_(options_, {.authenticate =
                              [this](const std::string& authorization, evhttp_connection* conn) {
                                return Authenticate(authorization, conn);
                              },
                          .draining = [this] { return draining_.load(); },
                          .closed = [this](evhttp_connection* conn) { Closed(conn); }}) {
    if (MetricsRegistry* m = backend_.metrics; m != nullptr) {
      stalled_ = m->AddCounter("pdserve_http_stalled_streams_total",
                               "HTTP streams cancelled because their client stopped reading.");
      m->AddGauge("pdserve_http_requests_open",
                  "OpenAI HTTP requests whose reply has not ended: generations running, and streams whose last "
                  "bytes wait for the client.",
                  [open = open_] { return static_cast<double>(open->load()); });
      front_.AddMetrics(m);
      m->AddGauge("pdserve_http_generations_running", "HTTP generations running (at most --http_max_inflight).",
                  [n = generations_] { return static_cast<double>(n->load()); });
      inflight_refusals_ = m->AddCounter("pdserve_http_inflight_refusals_total",
                                         "HTTP generations refused (503) because max_inflight were running or "
                                         "no thread could be started.");
      write_delay_ = m->AddHistogram(
          "pdserve_http_event_write_delay_seconds",
          "A streamed event's wait from the relay queueing it to the event loop handing it to the socket.",
          {1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2, 1e-1});
    }
  }

  ~Impl() {
    if (loop_.joinable()) {
      stopping_.store(true);
      Signal();
      loop_.join();
    }
    // The loop is stopped: this thread owns its state now. Every
    // generation still running is cancelled, then awaited.
    for (auto& [conn, call] : conns_) call->Cancel();
    {
      absl::MutexLock lock(&threads_mu_);
      threads_mu_.Await(absl::Condition(
          +[](int* n) { return *n == 0; }, &running_));
    }
    conns_.clear();
    if (http_ != nullptr) evhttp_free(http_);  // frees the connections and their requests
    // Connections that never got as far as their close callback.
    front_.ReleaseAll();
    if (wake_event_ != nullptr) event_free(wake_event_);
    if (reload_event_ != nullptr) event_free(reload_event_);
    if (base_ != nullptr) event_base_free(base_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  absl::Status Start() {
    absl::StatusOr<std::pair<std::string, int>> hp = SplitHostPort(options_.address);
    if (!hp.ok()) return hp.status();
    if (options_.tls.enabled()) {
      absl::StatusOr<std::unique_ptr<ServerTls>> tls = ServerTls::Load(options_.tls);
      if (!tls.ok()) return tls.status();
      tls_ = *std::move(tls);
    }
    base_ = event_base_new();
    if (base_ == nullptr) return absl::InternalError("event_base_new failed");
    http_ = evhttp_new(base_);
    if (http_ == nullptr) return absl::InternalError("evhttp_new failed");
    // The front refuses larger ones first; libevent's limits stand
    // behind it.
    evhttp_set_max_body_size(http_, static_cast<ev_ssize_t>(options_.max_body_bytes));
    evhttp_set_max_headers_size(http_, static_cast<ev_ssize_t>(Front::MaxHeadersForParser()));
    evhttp_set_timeout(http_, static_cast<int>(absl::ToInt64Seconds(options_.idle_timeout)));
    evhttp_set_allowed_methods(http_, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD | EVHTTP_REQ_OPTIONS);
    evhttp_set_gencb(http_, &Impl::OnRequest, this);
    evhttp_set_bevcb(http_, &Impl::NewBufferevent, this);
    evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(http_, hp->first.c_str(), hp->second);
    if (bound == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.address, ": ", std::strerror(errno)));
    }
    // libevent listens with a backlog of 128: a burst of more connections
    // than that, arriving before the loop accepts them, had some reset at
    // their first write (measured: 316 of 3,200 at once). The queue holds
    // as many as may be open (the kernel caps it at net.core.somaxconn).
    if (listen(evhttp_bound_socket_get_fd(bound), options_.max_connections) != 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.address, ": ", std::strerror(errno)));
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    if (getsockname(evhttp_bound_socket_get_fd(bound), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return absl::InternalError("getsockname failed");
    }
    port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return absl::InternalError("eventfd failed");
    wake_event_ = event_new(base_, wake_fd_, EV_READ | EV_PERSIST, &Impl::OnWake, this);
    if (wake_event_ == nullptr || event_add(wake_event_, nullptr) != 0) return absl::InternalError("event_add failed");
    if (tls_ != nullptr) {
      reload_event_ = event_new(base_, -1, EV_PERSIST, &Impl::OnReload, this);
      const timeval period = {1, 0};
      if (reload_event_ == nullptr || event_add(reload_event_, &period) != 0) {
        return absl::InternalError("event_add failed");
      }
    }
    loop_ = std::thread([this] { event_base_dispatch(base_); });
    return absl::OkStatus();
  }

  int port() const { return port_; }

  void Drain(absl::Time deadline) {
    draining_.store(true);
    absl::MutexLock lock(&threads_mu_);
    threads_mu_.AwaitWithDeadline(absl::Condition(
                                      +[](int* n) { return *n == 0; }, &running_),
                                  deadline);
  }

 private:
  // --- Loop thread.

  static void OnRequest(evhttp_request* req, void* arg) { static_cast<Impl*>(arg)->Handle(req); }

  void Handle(evhttp_request* req) {
    evhttp_connection* conn = evhttp_request_get_connection(req);
    const Front::Verdict verdict = front_.TakeVerdict(conn);
    // The body leaves the budget once it is copied out (or dropped with
    // the request).
    struct ReleaseOnReturn {
      Front& front;
      int64_t n;
      ~ReleaseOnReturn() { front.ReturnToBudget(n); }
    } release{front_, verdict.reserved};
    if (verdict.status != 0) return replies_.Send(req, verdict.status, verdict.body, verdict.headers);
    const evhttp_uri* uri = evhttp_request_get_evhttp_uri(req);
    const char* path = uri == nullptr ? nullptr : evhttp_uri_get_path(uri);
    const Route route = RouteOf(path == nullptr ? "" : path);
    const evhttp_cmd_type method = evhttp_request_get_command(req);
    const bool post = route == Route::kCompletions || route == Route::kChat;
    if (route == Route::kUnknown) {
      return replies_.Send(req, 404,
                           ErrorBody(absl::StrCat("no such path: ", path == nullptr ? "" : path,
                                                  " (served: POST /v1/completions, POST /v1/chat/completions, GET "
                                                  "/v1/models, GET /health)"),
                                     "invalid_request_error"));
    }
    if (route == Route::kMetrics) {
      return replies_.Send(req, 404,
                           ErrorBody("metrics are served on the router's own port (--metrics_listen), not here",
                                     "invalid_request_error"));
    }
    if ((post && method != EVHTTP_REQ_POST) || (!post && method != EVHTTP_REQ_GET && method != EVHTTP_REQ_HEAD)) {
      return replies_.Send(req, 405,
                           ErrorBody(absl::StrCat(path, " takes ", post ? "POST" : "GET"), "invalid_request_error"),
                           {{"Allow", post ? "POST" : "GET, HEAD"}});
    }
    const std::string authorization = HeaderOf(req, "Authorization");
    if (route == Route::kHealth) return Health(req);
    if (route == Route::kModels) {
      if (absl::Status st = Authenticate(authorization, conn); !st.ok()) return replies_.SendError(req, st);
      return Models(req);
    }

    evbuffer* in = evhttp_request_get_input_buffer(req);
    const size_t size = evbuffer_get_length(in);
    if (static_cast<int64_t>(size) > options_.max_body_bytes) {
      return replies_.Send(req, 413,
                  ErrorBody(absl::StrCat("body: ", size, " bytes, more than the limit of ", options_.max_body_bytes),
                            "invalid_request_error", "body"));
    }
    if (draining_.load()) {
      return replies_.Send(req, 503, ErrorBody("the router is shutting down", "server_error"));
    }
    {
      absl::MutexLock lock(&threads_mu_);
      if (running_ >= options_.max_inflight) return RefuseGeneration(req, "generations in flight are at the limit");
      ++running_;
      generations_->fetch_add(1);
    }
    std::string body(size, '\0');
    if (size > 0) evbuffer_remove(in, body.data(), size);

    auto call = std::make_shared<Call>();
    call->req = req;
    call->conn = conn;
    call->request_id = RequestIdOf(req);
    conns_[conn] = call;
    open_->fetch_add(1);
    SetSocketOptions(conn, options_.socket_send_buffer);
    call->Watch(base_);
    try {
      std::thread([this, call, chat = route == Route::kChat, body = std::move(body), authorization,
                   peer = PeerOf(conn), client_id = call->request_id]() mutable {
        runner_.Run(call, chat ? Endpoint::kChatCompletions : Endpoint::kCompletions, body, authorization, peer,
                    client_id);
        generations_->fetch_sub(1);
        absl::MutexLock lock(&threads_mu_);
        --running_;
      }).detach();
    } catch (const std::system_error& e) {
      // Out of threads (or memory for one): this request is refused and
      // the server goes on.
      LogEvent("warning", "http_thread_start_failed", {{"error", e.what()}});
      call->Unwatch();
      conns_.erase(conn);
      open_->fetch_sub(1);
      {
        absl::MutexLock lock(&threads_mu_);
        --running_;
      }
      generations_->fetch_sub(1);
      RefuseGeneration(req, "no thread could be started for the request");
    }
  }

  void RefuseGeneration(evhttp_request* req, absl::string_view why) {
    if (inflight_refusals_ != nullptr) inflight_refusals_->Add();
    replies_.Send(req, 503, ErrorBody(absl::StrCat("the router is busy: ", why), "server_error"),
                  {{"Retry-After", "1"}});
  }

  absl::Status Authenticate(const std::string& authorization, evhttp_connection* conn) {
    if (!backend_.authenticate) return absl::OkStatus();
    return backend_.authenticate(authorization, PeerOf(conn)).status();
  }

  void Health(evhttp_request* req) {
    absl::Status st = draining_.load() ? absl::UnavailableError("the router is shutting down")
                      : backend_.ready  ? backend_.ready()
                                        : absl::OkStatus();
    if (st.ok()) return replies_.Send(req, 200, "{\"status\":\"ok\"}");
    replies_.Send(req, 503, ErrorBody(st.message(), "server_error"));
  }

  void Models(evhttp_request* req) {
    const RequestResolver& r = *backend_.resolver;
    const nlohmann::json model = {{"id", r.model_name()},
                                  {"object", "model"},
                                  {"created", started_},
                                  {"owned_by", "pdserve"},
                                  {"max_model_len", r.config().max_position_embeddings},
                                  {"pdserve", {{"vocab_size", r.config().vocab_size}}}};
    replies_.Send(req, 200, nlohmann::json({{"object", "list"}, {"data", {model}}}).dump());
  }

  // A connection closes (the front has let go of it).
  void Closed(evhttp_connection* conn) {
    if (stopping_.load()) return;
    auto it = conns_.find(conn);
    if (it == conns_.end()) return;
    CallPtr call = it->second;
    conns_.erase(it);
    call->Unwatch();
    if (call->ending) {
      // The stream's last bytes were not all written. libevent detached
      // the request from the closing connection and frees it on this end
      // (an attached one goes with the connection).
      if (evhttp_request_get_connection(call->req) == nullptr) evhttp_send_reply_end(call->req);
      open_->fetch_sub(1);
      return;
    }
    // libevent keeps the request (detached from the connection) until
    // the reply is ended: Pump does that once the generation is done.
    call->conn = nullptr;
    call->Cancel();
    orphans_.push_back(std::move(call));
  }

  // Every second: a certificate or key file that changed is loaded for new
  // connections.
  static void OnReload(evutil_socket_t, short, void* arg) { static_cast<Impl*>(arg)->tls_->ReloadIfChanged(); }

  // Each new connection: its bufferevent (TLS over the socket libevent
  // accepted, with the context loaded last) and its front.
  static bufferevent* NewBufferevent(event_base* base, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    bufferevent* bev;
    if (self->tls_ != nullptr) {
      SSL* ssl = SSL_new(self->tls_->context());
      if (ssl == nullptr) return nullptr;
      bev = bufferevent_openssl_socket_new(base, -1, ssl, BUFFEREVENT_SSL_ACCEPTING, BEV_OPT_CLOSE_ON_FREE);
    } else {
      bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    }
    if (bev != nullptr) self->front_.Add(base, bev);
    return bev;
  }

  static void OnWake(evutil_socket_t fd, short, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    uint64_t n;
    [[maybe_unused]] ssize_t r = read(fd, &n, sizeof(n));
    if (self->stopping_.load()) {
      event_base_loopbreak(self->base_);
      return;
    }
    std::vector<CallPtr> woken;
    {
      absl::MutexLock lock(&self->wake_mu_);
      woken.swap(self->woken_);
      for (const CallPtr& c : woken) c->queued = false;
    }
    for (const CallPtr& c : woken) self->Pump(*c);
  }

  // Hands the call's new bytes to libevent; ends the reply once done.
  void Pump(Call& call) {
    if (call.finished) return;
    std::string out, body;
    bool sse, done;
    int status;
    std::vector<std::pair<std::string, std::string>> headers;
    absl::Time since;
    {
      absl::MutexLock lock(&call.mu);
      out.swap(call.out);
      since = call.out_since;
      sse = call.sse;
      done = call.done;
      status = call.status;
      if (done) {
        body.swap(call.body);
        headers.swap(call.headers);
      }
    }
    if (call.conn == nullptr) {  // The client went away.
      if (!done) return;
      // The request, detached from its closed connection, is freed here.
      if (call.reply_started) {
        evhttp_send_reply_end(call.req);
      } else {
        evhttp_send_reply(call.req, 499, ReasonPhrase(499), nullptr);
        replies_.Count(499);
      }
      call.finished = true;
      open_->fetch_sub(1);
      std::erase_if(orphans_, [&call](const CallPtr& c) { return c.get() == &call; });
      return;
    }
    if (!call.request_id.empty()) headers.emplace_back("X-Request-Id", call.request_id);
    if (!sse) {
      if (!done) return;
      call.finished = true;
      call.Unwatch();
      conns_.erase(call.conn);
      open_->fetch_sub(1);
      replies_.Send(call.req, status, body, headers);
      return;
    }
    if (!call.reply_started) {
      evkeyvalq* h = evhttp_request_get_output_headers(call.req);
      evhttp_add_header(h, "Content-Type", "text/event-stream");
      evhttp_add_header(h, "Cache-Control", "no-cache");
      evhttp_add_header(h, "X-Accel-Buffering", "no");
      if (!call.request_id.empty()) evhttp_add_header(h, "X-Request-Id", call.request_id.c_str());
      evhttp_send_reply_start(call.req, 200, "OK");
      replies_.Count(200);
      call.reply_started = true;
    }
    if (!out.empty() && !call.gone.cancelled()) {
      // A client that stopped reading: its bytes pile up here.
      bufferevent* bev = evhttp_connection_get_bufferevent(call.conn);
      const size_t unsent = bev == nullptr ? 0 : evbuffer_get_length(bufferevent_get_output(bev));
      if (static_cast<int64_t>(unsent + out.size()) > options_.max_buffered_bytes) {
        LogEvent("warning", "http_client_not_reading", {{"unsent_bytes", std::to_string(unsent)}});
        if (stalled_ != nullptr) stalled_->Add();
        call.Cancel();
        evhttp_connection_set_timeout(call.conn, 5);
      }
    }
    // The reply is not ended here. Under TLS libevent defers a
    // connection's write callback to the loop's next turn, and that
    // callback does not look at the output again: one pending for bytes
    // written just before would take bytes queued now, and the reply's
    // end, for written, free the request and stop the connection's
    // writing with them still queued (the client waits for the stream's
    // end forever). The last bytes therefore go with a callback of
    // ours, and StreamWritten ends the reply once the output is empty.
    // (A stream's `done` comes with its last events, which end in
    // [DONE]: Stream sets both under one lock, so `out` is not empty here.)
    if (!out.empty()) {
      if (write_delay_ != nullptr) write_delay_->Observe(absl::ToDoubleSeconds(absl::Now() - since));
      evbuffer* buf = evbuffer_new();
      evbuffer_add(buf, out.data(), out.size());
      if (done) {
        call.finished = true;
        call.ending = true;
        call.Unwatch();
        evhttp_send_reply_chunk_with_cb(call.req, buf, &Impl::OnStreamWritten, this);
      } else {
        evhttp_send_reply_chunk(call.req, buf);
      }
      evbuffer_free(buf);
    }
  }

  // libevent's write callback for a connection whose stream has sent its
  // last bytes: it may be one for earlier bytes (see Pump), so the reply
  // ends only once the output is empty; the write that empties it calls
  // back again.
  static void OnStreamWritten(evhttp_connection* conn, void* arg) { static_cast<Impl*>(arg)->StreamWritten(conn); }

  void StreamWritten(evhttp_connection* conn) {
    auto it = conns_.find(conn);
    if (it == conns_.end() || !it->second->ending) return;
    bufferevent* bev = evhttp_connection_get_bufferevent(conn);
    if (bev != nullptr && evbuffer_get_length(bufferevent_get_output(bev)) > 0) return;
    CallPtr call = std::move(it->second);
    conns_.erase(it);
    open_->fetch_sub(1);
    evhttp_send_reply_end(call->req);
  }

  // --- Any thread.

  void Signal() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = write(wake_fd_, &one, sizeof(one));
  }

  void Wake(const CallPtr& call) {
    bool signal;
    {
      absl::MutexLock lock(&wake_mu_);
      if (call->queued) return;
      call->queued = true;
      signal = woken_.empty();  // otherwise a wake-up is on its way already
      woken_.push_back(call);
    }
    if (signal) Signal();
  }

  const HttpServerOptions options_;
  const HttpBackend backend_;
  // Decides each request from its header block before libevent reads its
  // body (loop thread).
  Front front_;
  // The generations' threads' side of each call.
  Generations runner_{options_, backend_, [this](const CallPtr& call) { Wake(call); }};
  Replies replies_{backend_.metrics};
  Histogram* write_delay_ = nullptr;
  Counter* stalled_ = nullptr;
  Counter* inflight_refusals_ = nullptr;
  const int64_t started_ = absl::ToUnixSeconds(absl::Now());

  event_base* base_ = nullptr;
  evhttp* http_ = nullptr;
  int port_ = 0;
  int wake_fd_ = -1;
  event* wake_event_ = nullptr;
  event* reload_event_ = nullptr;  // HTTPS: the certificate files are looked at every second
  std::thread loop_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};

  std::unique_ptr<ServerTls> tls_;  // HTTPS only (loop thread)

  // The loop thread's: each connection's call in progress, and the calls
  // whose connection closed before they finished.
  absl::flat_hash_map<evhttp_connection*, CallPtr> conns_;
  std::vector<CallPtr> orphans_;
  // Calls registered and not yet ended (the gauge's; shared: a scrape may
  // come after the server is gone).
  std::shared_ptr<std::atomic<int64_t>> open_ = std::make_shared<std::atomic<int64_t>>(0);
  // Generations running (the gauge's; shared as open_ is).
  std::shared_ptr<std::atomic<int64_t>> generations_ = std::make_shared<std::atomic<int64_t>>(0);

  absl::Mutex wake_mu_;
  std::vector<CallPtr> woken_ ABSL_GUARDED_BY(wake_mu_);

  absl::Mutex threads_mu_;
  int running_ ABSL_GUARDED_BY(threads_mu_) = 0;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() = default;

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options, HttpBackend backend) {
  if (backend.resolver == nullptr || backend.relay == nullptr) {
    return absl::InvalidArgumentError("HttpServer: resolver and relay context are required");
  }
  auto impl = std::make_unique<Impl>(std::move(options), std::move(backend));
  if (absl::Status st = impl->Start(); !st.ok()) return st;
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

int HttpServer::port() const { return impl_->port(); }
void HttpServer::Drain(absl::Time deadline) { impl_->Drain(deadline); }

}  // namespace pdserve::router::openai
