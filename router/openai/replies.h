// The HTTP API's replies made whole on the event loop, each counted by
// status (pdserve_http_replies_total), and what the server reads of a
// request: its headers, its client-given id, its peer.
//
// Thread safety: the event loop's thread.
#ifndef PDSERVE_ROUTER_OPENAI_REPLIES_H_
#define PDSERVE_ROUTER_OPENAI_REPLIES_H_

#include <event2/http.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "base/metrics.h"

namespace pdserve::router::openai {

// The reason phrase of an HTTP status the server sends.
const char* ReasonPhrase(int status);

class Replies {
 public:
  // `metrics` null: nothing counted.
  explicit Replies(MetricsRegistry* metrics);

  // A JSON reply, whole.
  void Send(evhttp_request* req, int status, const std::string& body,
            const std::vector<std::pair<std::string, std::string>>& headers = {});
  // response.h's error reply for `st`.
  void SendError(evhttp_request* req, const absl::Status& st);
  // A reply the server sends otherwise (a stream's start, a 499).
  void Count(int status);

 private:
  absl::flat_hash_map<int, Counter*> by_status_;  // 0: any other
};

// A request header's value ("" when absent).
std::string HeaderOf(evhttp_request* req, const char* name);
// The client's X-Request-Id when it is a plausible id (at most 128
// printable ASCII characters: it goes into logs); else "" (the response id
// is used).
std::string RequestIdOf(evhttp_request* req);
// "HOST:PORT" of the connection's client.
std::string PeerOf(evhttp_connection* conn);

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_REPLIES_H_
