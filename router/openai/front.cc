#include "router/openai/front.h"

#include <algorithm>
#include <deque>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace pdserve::router::openai {
namespace {

// The most header bytes one request may send, and the share of the body
// budget that headers being read may hold across all connections: what
// clients that never authenticate can make the server keep.
constexpr size_t kMaxHeaderBytes = 32 << 10;
constexpr int64_t kHeaderShareOfBudget = 8;

// Every refused request reaches libevent as one of these, without its
// body. A body of known size up to twice max_body_bytes is then read and
// dropped (never held), so that a client still sending it reads the reply
// rather than a reset; any other, the connection is closed after the reply
// and the rest never read.
constexpr char kRefusedRequest[] = "GET / HTTP/1.1\r\n\r\n";
constexpr char kRefusedRequestClose[] = "GET / HTTP/1.1\r\nConnection: close\r\n\r\n";

// The end of a header block (just past its empty line) in `head`,
// looking from `from`; npos if not there yet. libevent takes "\n" as a
// line end as well as "\r\n".
size_t HeadEnd(const std::string& head, size_t from) {
  for (size_t i = head.find('\n', from); i != std::string::npos; i = head.find('\n', i + 1)) {
    if (i + 1 < head.size() && head[i + 1] == '\n') return i + 2;
    if (i + 2 < head.size() && head[i + 1] == '\r' && head[i + 2] == '\n') return i + 3;
  }
  return std::string::npos;
}

// Removes and returns the last `n` bytes of `buf`.
std::string TakeTail(evbuffer* buf, size_t n) {
  const size_t len = evbuffer_get_length(buf);
  std::string out(n, '\0');
  evbuffer_ptr at;
  evbuffer_ptr_set(buf, &at, len - n, EVBUFFER_PTR_SET);
  evbuffer_copyout_from(buf, &at, out.data(), n);
  if (len == n) {
    evbuffer_drain(buf, n);
  } else {
    evbuffer* keep = evbuffer_new();
    evbuffer_remove_buffer(buf, keep, len - n);
    evbuffer_drain(buf, n);
    evbuffer_add_buffer(buf, keep);
    evbuffer_free(keep);
  }
  return out;
}

// A header block as the front needs it.
struct RequestHead {
  std::string method, target, authorization;
  int64_t content_length = 0;
  bool transfer_encoding = false;
};

// Errors: INVALID_ARGUMENT naming what is wrong.
absl::StatusOr<RequestHead> ParseHead(absl::string_view block) {
  RequestHead h;
  bool first = true, have_length = false, have_authorization = false;
  for (absl::string_view line : absl::StrSplit(block, '\n')) {
    absl::ConsumeSuffix(&line, "\r");
    if (first) {
      std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
      if (parts.size() != 3 || parts[0].empty() || parts[1].empty() || !absl::StartsWith(parts[2], "HTTP/")) {
        return absl::InvalidArgumentError("malformed request line");
      }
      h.method = std::string(parts[0]);
      h.target = std::string(parts[1]);
      first = false;
      continue;
    }
    if (line.empty()) break;
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || colon == 0) return absl::InvalidArgumentError("malformed header line");
    const absl::string_view name = line.substr(0, colon);
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (absl::EqualsIgnoreCase(name, "Content-Length")) {
      int64_t n = -1;
      if (!std::all_of(value.begin(), value.end(), absl::ascii_isdigit) || !absl::SimpleAtoi(value, &n) ||
          (have_length && n != h.content_length)) {
        return absl::InvalidArgumentError("bad Content-Length");
      }
      h.content_length = n;
      have_length = true;
    } else if (absl::EqualsIgnoreCase(name, "Transfer-Encoding")) {
      h.transfer_encoding = true;
    } else if (absl::EqualsIgnoreCase(name, "Authorization") && !have_authorization) {
      h.authorization = std::string(value);  // the first, as libevent's lookup takes it
      have_authorization = true;
    }
  }
  if (first) return absl::InvalidArgumentError("no request line");
  return h;
}

}  // namespace

Route RouteOf(absl::string_view path) {
  if (path == "/v1/completions") return Route::kCompletions;
  if (path == "/v1/chat/completions") return Route::kChat;
  if (path == "/v1/models") return Route::kModels;
  if (path == "/health") return Route::kHealth;
  if (path == "/metrics") return Route::kMetrics;
  return Route::kUnknown;
}

std::string ErrorBody(absl::string_view message, absl::string_view type, absl::string_view param) {
  nlohmann::json e = {{"message", std::string(message)}, {"type", std::string(type)}, {"param", nullptr},
                      {"code", nullptr}};
  if (!param.empty()) e["param"] = std::string(param);
  return nlohmann::json({{"error", e}}).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// One connection's state, ahead of libevent's parser.
struct Front::Connection {
  Front* front = nullptr;
  // kDrop: a refused request's body, read and dropped.
  enum class Phase { kHeaders, kBody, kDrop };
  bufferevent* bev = nullptr;  // one reference is the front's own
  evbuffer_cb_entry* input_cb = nullptr;
  event* timer = nullptr;   // the header or request deadline, or an immediate close
  event* attach = nullptr;  // run once, in the turn that accepted the connection
  bool attached = false;    // the close callback is set on the connection
  bool over_cap = false;    // accepted beyond max_connections
  bool close_now = false;   // over the cap or the header budget: closed on the next turn
  bool discarding = false;  // refused: nothing more reaches libevent
  bool putting_back = false;
  // A request on it passed authentication: between requests it may idle
  // (up to the idle timeout). One that never did has the header deadline
  // from its last reply on, so clients without a key cannot fill the
  // connection cap with idle connections.
  bool authenticated = false;
  Phase phase = Phase::kHeaders;
  std::string head;        // the header block so far (charged to the budget)
  int64_t body_left = 0;   // kBody, kDrop: bytes still to come
  int64_t declared_body = -1;  // the request being decided: its Content-Length (-1: unknown)
  absl::Time started = absl::InfiniteFuture();  // the request's first byte (accept, for the first)
  std::deque<Verdict> verdicts;  // one per request put back, in libevent's order
};

Front::Front(const HttpServerOptions& options, Hooks hooks) : options_(options), hooks_(std::move(hooks)) {}

Front::~Front() = default;

void Front::AddMetrics(MetricsRegistry* m) {
  m->AddGauge("pdserve_http_connections_open", "Open HTTP connections (at most --http_max_connections).",
              [n = open_connections_] { return static_cast<double>(n->load()); });
  refused_connections_ = m->AddCounter("pdserve_http_connections_refused_total",
                                       "HTTP connections closed on accept: max_connections were open.");
  header_timeouts_ = m->AddCounter("pdserve_http_deadline_closes_total",
                                   "HTTP connections closed because a request missed its deadline.",
                                   "phase=\"headers\"");
  request_timeouts_ = m->AddCounter("pdserve_http_deadline_closes_total",
                                    "HTTP connections closed because a request missed its deadline.",
                                    "phase=\"body\"");
  m->AddGauge("pdserve_http_budget_bytes_used",
              "Request bytes held against the HTTP body budget: header blocks being read, and bodies admitted "
              "and not yet taken by a generation.",
              [n = budget_used_] { return static_cast<double>(n->load()); });
  budget_refusals_ = m->AddCounter("pdserve_http_budget_refusals_total",
                                   "HTTP requests refused (503) or connections closed because the body budget "
                                   "was spent.");
}

size_t Front::MaxHeadersForParser() { return kMaxHeaderBytes + sizeof(kRefusedRequestClose); }

void Front::ReturnToBudget(int64_t bytes) { budget_used_->fetch_sub(bytes); }

void Front::ReleaseAll() {
  while (!connections_.empty()) Release(*connections_.begin()->second);
}

void Front::OnClose(evhttp_connection* conn, void* arg) { static_cast<Front*>(arg)->Closed(conn); }

void Front::Closed(evhttp_connection* conn) {
  if (auto it = connections_.find(evhttp_connection_get_bufferevent(conn)); it != connections_.end()) {
    Release(*it->second);
  }
  hooks_.closed(conn);
}

void Front::Add(event_base* base, bufferevent* bev) {
  auto owned = std::make_unique<Connection>();
  Connection& f = *owned;
  // Held until the connection's close callback: libevent frees the
  // bufferevent with the connection.
  bufferevent_incref(bev);
  f.bev = bev;
  f.started = absl::Now();
  f.timer = evtimer_new(base, &Front::OnTimer, &f);
  // libevent makes the connection around this bufferevent before the
  // accepting callback returns, and reads from it only in a later turn:
  // an event made active now sets the close callback in between, so a
  // client that closes before sending a byte is let go by that callback.
  f.attach = event_new(base, -1, 0, &Front::OnAttach, &f);
  event_active(f.attach, EV_TIMEOUT, 0);
  f.input_cb = evbuffer_add_cb(bufferevent_get_input(bev), &Front::OnInput, &f);
  f.front = this;
  if (static_cast<int64_t>(connections_.size()) >= options_.max_connections) {
    f.over_cap = true;
    f.close_now = true;
    f.discarding = true;
  }
  connections_[bev] = std::move(owned);
  open_connections_->store(static_cast<int64_t>(connections_.size()));
  ArmTimer(f);
}

void Front::Release(Connection& f) {
  int64_t held = static_cast<int64_t>(f.head.size());
  for (const Verdict& v : f.verdicts) held += v.reserved;
  budget_used_->fetch_sub(held);
  if (f.timer != nullptr) event_free(f.timer);
  if (f.attach != nullptr) event_free(f.attach);
  evbuffer_remove_cb_entry(bufferevent_get_input(f.bev), f.input_cb);
  bufferevent* bev = f.bev;
  connections_.erase(bev);  // destroys f
  open_connections_->store(static_cast<int64_t>(connections_.size()));
  bufferevent_decref(bev);
}

// The libevent connection of `f` (nullptr once libevent has freed it; the
// front's reference keeps the bufferevent readable, and libevent
// clears its callbacks as it frees it).
evhttp_connection* Front::ConnectionOf(const Connection& f) {
  bufferevent_data_cb read_cb, write_cb;
  bufferevent_event_cb event_cb;
  void* arg = nullptr;
  bufferevent_getcb(f.bev, &read_cb, &write_cb, &event_cb, &arg);
  return static_cast<evhttp_connection*>(arg);
}

// Sets the close callback (it releases `f`) once libevent has made the
// connection; false (`f` released) if it is gone already.
bool Front::Attach(Connection& f) {
  if (f.attached) return true;
  evhttp_connection* conn = ConnectionOf(f);
  if (conn == nullptr) {
    Release(f);
    return false;
  }
  evhttp_connection_set_closecb(conn, &Front::OnClose, this);
  f.attached = true;
  return true;
}

void Front::OnAttach(evutil_socket_t, short, void* arg) {
  auto& f = *static_cast<Connection*>(arg);
  f.front->Attach(f);
}

Front::Verdict Front::TakeVerdict(evhttp_connection* conn) {
  auto it = connections_.find(evhttp_connection_get_bufferevent(conn));
  if (it == connections_.end() || it->second->verdicts.empty()) return {};
  Verdict v = std::move(it->second->verdicts.front());
  it->second->verdicts.pop_front();
  return v;
}

void Front::ArmTimer(Connection& f) {
  absl::Time deadline = absl::InfiniteFuture();
  if (f.close_now) {
    deadline = absl::InfinitePast();
  } else if (f.phase == Connection::Phase::kHeaders && f.started != absl::InfiniteFuture()) {
    deadline = f.started + options_.header_timeout;
  } else {
    deadline = f.started + options_.request_timeout;
  }
  if (deadline == absl::InfiniteFuture()) {
    evtimer_del(f.timer);
    return;
  }
  const timeval tv = absl::ToTimeval(std::max(absl::ZeroDuration(), deadline - absl::Now()));
  evtimer_add(f.timer, &tv);
}

// A deadline passed (or the connection is over the cap): the
// connection is closed as libevent closes one whose client went away,
// so a generation it carries is cancelled and its request let go.
void Front::OnTimer(evutil_socket_t, short, void* arg) {
  auto& f = *static_cast<Connection*>(arg);
  Front* self = f.front;
  if (!self->Attach(f)) return;
  if (f.over_cap) {
    if (self->refused_connections_ != nullptr) self->refused_connections_->Add();
  } else if (f.close_now) {
    // Counted where it was decided.
  } else if (f.phase == Connection::Phase::kHeaders) {
    if (self->header_timeouts_ != nullptr) self->header_timeouts_->Add();
  } else if (self->request_timeouts_ != nullptr) {
    self->request_timeouts_->Add();
  }
  f.discarding = true;
  // Releases `f` (the close callback) before it returns.
  bufferevent_trigger_event(f.bev, BEV_EVENT_EOF | BEV_EVENT_READING, 0);
}

void Front::OnInput(evbuffer* buf, const evbuffer_cb_info* info, void* arg) {
  auto& f = *static_cast<Connection*>(arg);
  if (info->n_added == 0 || f.putting_back) return;
  f.front->Input(f, buf, info->n_added);
}

// `n` new bytes at the end of `buf`, before libevent's parser sees them.
void Front::Input(Connection& f, evbuffer* buf, size_t n) {
  if (!Attach(f)) return;  // not reached: libevent is reading from it
  // The common case, a body arriving: nothing to hold back.
  if (f.phase == Connection::Phase::kBody && !f.discarding && static_cast<int64_t>(n) < f.body_left) {
    f.body_left -= static_cast<int64_t>(n);
    return;
  }
  f.putting_back = true;
  const std::string data = TakeTail(buf, n);
  absl::string_view in(data);
  std::string out;  // what libevent gets
  const size_t head_before = f.head.size();
  while (!in.empty() && !f.discarding) {
    if (f.phase != Connection::Phase::kHeaders) {
      const size_t take = std::min<size_t>(in.size(), static_cast<size_t>(f.body_left));
      if (f.phase == Connection::Phase::kBody) out.append(in.data(), take);
      in.remove_prefix(take);
      f.body_left -= static_cast<int64_t>(take);
      if (f.body_left == 0) EndRequest(f);
      continue;
    }
    if (f.started == absl::InfiniteFuture()) {
      f.started = absl::Now();
      ArmTimer(f);
    }
    const size_t from = f.head.size() < 2 ? 0 : f.head.size() - 2;
    f.head.append(in.data(), in.size());
    const size_t end = HeadEnd(f.head, from);
    if (end == std::string::npos) {
      if (f.head.size() > kMaxHeaderBytes) {
        f.declared_body = -1;
        Refuse(f, &out, 431,
               ErrorBody(absl::StrCat("request headers over ", kMaxHeaderBytes, " bytes"), "invalid_request_error"));
      }
      break;
    }
    in = in.substr(in.size() - (f.head.size() - end));
    f.head.resize(end);
    Decide(f, &out);
  }
  // Header bytes held are charged to the budget; past their share of it
  // the connection is closed: clients that have not yet said who they
  // are may together hold no more.
  const int64_t grown = static_cast<int64_t>(f.head.size()) - static_cast<int64_t>(head_before);
  const int64_t used = budget_used_->fetch_add(grown) + grown;
  if (grown > 0 && used > options_.body_budget_bytes / kHeaderShareOfBudget) {
    if (budget_refusals_ != nullptr) budget_refusals_->Add();
    budget_used_->fetch_sub(static_cast<int64_t>(f.head.size()));
    f.head.clear();
    f.discarding = true;
    f.close_now = true;
    ArmTimer(f);
  }
  if (!out.empty()) evbuffer_add(buf, out.data(), out.size());
  f.putting_back = false;
}

// A request's header block is complete (and taken out of f.head).
void Front::Decide(Connection& f, std::string* out) {
  const std::string block = std::move(f.head);
  f.head.clear();
  f.declared_body = -1;
  absl::StatusOr<RequestHead> h = ParseHead(block);
  if (!h.ok()) return Refuse(f, out, 400, ErrorBody(h.status().message(), "invalid_request_error"));
  if (!h->transfer_encoding) f.declared_body = h->content_length;
  if (h->transfer_encoding) {
    return Refuse(f, out, 411,
                  ErrorBody("a request body must come with Content-Length (Transfer-Encoding is not accepted)",
                            "invalid_request_error"));
  }
  if (h->method != "GET" && h->method != "POST" && h->method != "HEAD" && h->method != "OPTIONS") {
    return Refuse(f, out, 405, ErrorBody(absl::StrCat("method ", h->method, " is not served"), "invalid_request_error"));
  }
  std::string path;
  if (evhttp_uri* uri = evhttp_uri_parse_with_flags(h->target.c_str(), EVHTTP_URI_NONCONFORMANT); uri != nullptr) {
    if (const char* p = evhttp_uri_get_path(uri); p != nullptr) path = p;
    evhttp_uri_free(uri);
  }
  const Route route = RouteOf(path);
  if ((route != Route::kCompletions && route != Route::kChat) || h->method != "POST") {
    if (h->content_length > 0) {
      return Refuse(f, out, 413,
                    ErrorBody(absl::StrCat(h->method, " ", path, " takes no body"), "invalid_request_error", "body"));
    }
    return Admit(f, out, block, 0);
  }
  if (const absl::Status st = hooks_.authenticate(h->authorization, ConnectionOf(f)); !st.ok()) {
    return Refuse(f, out, ErrorFor(st));
  }
  f.authenticated = true;
  if (h->content_length > options_.max_body_bytes) {
    return Refuse(f, out, 413,
                  ErrorBody(absl::StrCat("body: ", h->content_length, " bytes, more than the limit of ",
                                         options_.max_body_bytes),
                            "invalid_request_error", "body"));
  }
  if (hooks_.draining()) return Refuse(f, out, 503, ErrorBody("the router is shutting down", "server_error"));
  if (budget_used_->load() + h->content_length > options_.body_budget_bytes) {
    if (budget_refusals_ != nullptr) budget_refusals_->Add();
    return Refuse(f, out, 503, ErrorBody("request bodies being read are at the router's limit", "server_error"),
                  {{"Retry-After", "1"}});
  }
  budget_used_->fetch_add(h->content_length);
  Admit(f, out, block, h->content_length);
}

// The request goes to libevent as it came, its body after it.
void Front::Admit(Connection& f, std::string* out, const std::string& block, int64_t body_bytes) {
  out->append(block);
  Verdict v;
  v.reserved = body_bytes;
  f.verdicts.push_back(std::move(v));
  if (body_bytes == 0) return EndRequest(f);
  f.phase = Connection::Phase::kBody;
  f.body_left = body_bytes;
  ArmTimer(f);
}

void Front::Refuse(Connection& f, std::string* out, const HttpError& e) {
  Refuse(f, out, e.status, e.body, ErrorHeaders(e));
}

// libevent gets a stand-in request; the handler answers it with this.
void Front::Refuse(Connection& f, std::string* out, int status, std::string body,
                   std::vector<std::pair<std::string, std::string>> headers) {
  const bool drop = f.declared_body >= 0 && f.declared_body <= 2 * options_.max_body_bytes;
  out->append(drop ? kRefusedRequest : kRefusedRequestClose);
  Verdict v;
  v.status = status;
  v.body = std::move(body);
  v.headers = std::move(headers);
  f.verdicts.push_back(std::move(v));
  f.head.clear();
  if (drop && f.declared_body > 0) {
    f.phase = Connection::Phase::kDrop;
    f.body_left = f.declared_body;
    ArmTimer(f);
    return;
  }
  if (!drop) f.discarding = true;
  EndRequest(f);
}

void Front::EndRequest(Connection& f) {
  f.phase = Connection::Phase::kHeaders;
  f.body_left = 0;
  f.started = f.authenticated ? absl::InfiniteFuture() : absl::Now();
  ArmTimer(f);
}

}  // namespace pdserve::router::openai
