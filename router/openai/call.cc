#include "router/openai/call.h"

#include <event2/bufferevent.h>
#include <sys/socket.h>

#include <cerrno>

namespace pdserve::router::openai {

void Call::Watch(event_base* base) {
  bufferevent* bev = evhttp_connection_get_bufferevent(conn);
  const evutil_socket_t fd = bev == nullptr ? -1 : bufferevent_getfd(bev);
  if (fd < 0) return;
  watch = event_new(base, fd, EV_READ, &Call::OnClientReadable, this);
  if (watch != nullptr) event_add(watch, nullptr);
}

void Call::Unwatch() {
  if (watch == nullptr) return;
  event_free(watch);
  watch = nullptr;
}

void Call::OnClientReadable(evutil_socket_t fd, short, void* arg) {
  auto& call = *static_cast<Call*>(arg);
  char byte;
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return;  // not added again
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    event_add(call.watch, nullptr);
    return;
  }
  call.gone.Cancel();
}

void Call::Cancel() {
  Unwatch();
  gone.Cancel();
}

}  // namespace pdserve::router::openai
