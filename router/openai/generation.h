// The generations' side of the OpenAI HTTP API: on a generation's own
// thread, a request's body is decoded (request.h), its key admitted, its
// prompt resolved (router/resolve.h) and a Relay run (router/relay.h), as
// for a gRPC call; the reply, whole or as SSE events while they come
// (response.h), is put on the Call for the event loop to write. A whole
// reply has nowhere to put an error after the first token, so a request
// that fails or is cancelled mid-way gets an error reply; a stream gets an
// error event.
//
// Thread safety: Run from any number of generation threads at once.
#ifndef PDSERVE_ROUTER_OPENAI_GENERATION_H_
#define PDSERVE_ROUTER_OPENAI_GENERATION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "router/openai/call.h"
#include "router/openai/request.h"
#include "router/openai/server_options.h"

namespace pdserve::router::openai {

class Generations {
 public:
  // `wake` hands a call with new bytes, or its end, to the event loop.
  // `options` and `backend` outlive this.
  Generations(const HttpServerOptions& options, const HttpBackend& backend, std::function<void(const CallPtr&)> wake);

  // One generation to its end (the caller's thread runs it): the call
  // ends with its reply, or with nothing more to send once the client is
  // gone (call->gone cancels the relay).
  void Run(const CallPtr& call, Endpoint endpoint, const std::string& body, const std::string& authorization,
           const std::string& peer, const std::string& client_id);

 private:
  void Reply(const CallPtr& call, int status, std::string body,
             std::vector<std::pair<std::string, std::string>> headers = {});
  void ReplyError(const CallPtr& call, const absl::Status& st);
  void Stream(const CallPtr& call, std::string events, bool done);

  const HttpServerOptions& options_;
  const HttpBackend& backend_;
  const std::function<void(const CallPtr&)> wake_;
  // Response ids: a random base per server, counted up.
  uint64_t id_base_ = 0;
  std::atomic<uint64_t> next_id_{0};
};

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_GENERATION_H_
