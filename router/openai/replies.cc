#include "router/openai/replies.h"

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "router/openai/response.h"

namespace pdserve::router::openai {

const char* ReasonPhrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 503: return "Service Unavailable";
    default: return "Internal Server Error";
  }
}

Replies::Replies(MetricsRegistry* metrics) {
  if (metrics == nullptr) return;
  for (const int code : {200, 400, 401, 404, 405, 411, 413, 429, 431, 499, 500, 503, 0}) {
    by_status_[code] = metrics->AddCounter("pdserve_http_replies_total", "OpenAI HTTP API replies by status code.",
                                           code == 0 ? "code=\"other\"" : absl::StrCat("code=\"", code, "\""));
  }
}

void Replies::Count(int status) {
  if (by_status_.empty()) return;
  auto it = by_status_.find(status);
  (it == by_status_.end() ? by_status_.at(0) : it->second)->Add();
}

void Replies::Send(evhttp_request* req, int status, const std::string& body,
                   const std::vector<std::pair<std::string, std::string>>& headers) {
  Count(status);
  evkeyvalq* out = evhttp_request_get_output_headers(req);
  evhttp_add_header(out, "Content-Type", "application/json");
  for (const auto& [k, v] : headers) evhttp_add_header(out, k.c_str(), v.c_str());
  evbuffer* buf = evbuffer_new();
  evbuffer_add(buf, body.data(), body.size());
  evhttp_send_reply(req, status, ReasonPhrase(status), buf);
  evbuffer_free(buf);
}

void Replies::SendError(evhttp_request* req, const absl::Status& st) {
  const HttpError e = ErrorFor(st);
  Send(req, e.status, e.body, ErrorHeaders(e));
}

std::string HeaderOf(evhttp_request* req, const char* name) {
  const char* v = evhttp_find_header(evhttp_request_get_input_headers(req), name);
  return v == nullptr ? "" : v;
}

std::string RequestIdOf(evhttp_request* req) {
  std::string id = HeaderOf(req, "X-Request-Id");
  if (id.size() > 128 || !std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; })) return "";
  return id;
}

std::string PeerOf(evhttp_connection* conn) {
  char* host = nullptr;
  ev_uint16_t port = 0;
  evhttp_connection_get_peer(conn, &host, &port);
  return absl::StrCat(host == nullptr ? "?" : host, ":", port);
}

}  // namespace pdserve::router::openai
