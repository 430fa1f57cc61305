// One HTTP exchange of the OpenAI API whose answer comes from another
// thread: the event loop (server.cc) owns the connection side, a
// generation's thread (generation.h) fills in the reply.
//
// Thread safety: the fields marked the loop's are the event loop's alone;
// the rest are under `mu` (or atomic).
#ifndef PDSERVE_ROUTER_OPENAI_CALL_H_
#define PDSERVE_ROUTER_OPENAI_CALL_H_

#include <event2/event.h>
#include <event2/http.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/client_cancel.h"

namespace pdserve::router::openai {

struct Call {
  // The loop thread's alone.
  evhttp_request* req = nullptr;
  evhttp_connection* conn = nullptr;  // null once the connection closed
  bool reply_started = false;
  bool finished = false;  // nothing more is taken from the generation
  // A stream's last bytes are with libevent: the reply ends once they are
  // written (StreamWritten), and the call stays in conns_ until then.
  bool ending = false;
  bool queued = false;  // on the wake list (guarded by the server's wake_mu_)
  event* watch = nullptr;  // on the client's socket while the generation runs
  std::string request_id;  // the client's X-Request-Id, echoed ("": none)

  // Between the generation's thread and the loop.
  absl::Mutex mu;
  std::string out ABSL_GUARDED_BY(mu);  // stream bytes not yet handed to libevent
  absl::Time out_since ABSL_GUARDED_BY(mu);  // when the oldest of them was queued
  bool sse ABSL_GUARDED_BY(mu) = false;   // a 200 event stream has begun
  bool done ABSL_GUARDED_BY(mu) = false;  // nothing more comes: end after `out`
  // A whole reply (not streamed, or an error before the stream began).
  int status ABSL_GUARDED_BY(mu) = 200;
  std::string body ABSL_GUARDED_BY(mu);
  std::vector<std::pair<std::string, std::string>> headers ABSL_GUARDED_BY(mu);
  // The client went away (its connection closed, or it stopped reading):
  // the generation's relay, attached while it runs, is cancelled.
  ClientCancel gone;

  // The loop's watch on the client's socket while the generation runs:
  // libevent reads nothing more from a connection while its request is
  // being answered, so a client that goes away before the reply's first
  // write would go unnoticed. An end of stream or an error on it cancels
  // the call (one that half-closes after sending its request counts as
  // gone). Bytes (a pipelined request, which libevent reads only after
  // this reply) end the watch, since the socket stays readable from then
  // on; the reply's writes and the connection's close callback still see
  // the client leave. Loop thread.
  void Watch(event_base* base);
  void Unwatch();
  // The generation's answer is no longer wanted: the watch ends and the
  // relay is cancelled.
  void Cancel();

 private:
  static void OnClientReadable(evutil_socket_t fd, short, void* arg);
};
using CallPtr = std::shared_ptr<Call>;

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_CALL_H_
