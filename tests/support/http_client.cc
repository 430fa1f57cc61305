#include "tests/support/http_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <openssl/ssl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace pdserve::testing_support {
namespace {

// Whether `raw` holds a whole response: headers, then Content-Length bytes
// or a chunked body's last chunk.
bool Complete(const std::string& raw) {
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return false;
  const std::string head = absl::AsciiStrToLower(raw.substr(0, end));
  if (absl::StrContains(head, "transfer-encoding: chunked")) {
    return absl::EndsWith(raw, "\r\n0\r\n\r\n") || raw.find("\r\n0\r\n\r\n", end) != std::string::npos;
  }
  const size_t cl = head.find("content-length:");
  if (cl == std::string::npos) return false;  // to the close
  return raw.size() - end - 4 >= static_cast<size_t>(std::atoll(head.c_str() + cl + 15));
}

std::string Dechunk(const std::string& body) {
  std::string out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) break;
    const size_t n = std::strtoul(body.substr(at, eol - at).c_str(), nullptr, 16);
    if (n == 0) break;
    out += body.substr(eol + 2, n);
    at = eol + 2 + n + 2;
  }
  return out;
}

}  // namespace

std::string HttpRequest(const std::string& method, const std::string& path, const std::string& body,
                        const std::vector<std::string>& headers) {
  std::string r = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\n");
  for (const std::string& h : headers) absl::StrAppend(&r, h, "\r\n");
  if (method == "POST") absl::StrAppend(&r, "Content-Type: application/json\r\nContent-Length: ", body.size(), "\r\n");
  absl::StrAppend(&r, "Connection: close\r\n\r\n", body);
  return r;
}

HttpConnection::HttpConnection(int port, int receive_buffer, const std::string& tls_ca) {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ >= 0 && receive_buffer > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) Close();
  if (fd_ < 0 || tls_ca.empty()) return;
  ssl_ctx_ = SSL_CTX_new(TLS_client_method());
  if (ssl_ctx_ == nullptr || SSL_CTX_load_verify_locations(ssl_ctx_, tls_ca.c_str(), nullptr) != 1) {
    Close();
    return;
  }
  SSL_CTX_set_verify(ssl_ctx_, SSL_VERIFY_PEER, nullptr);
  ssl_ = SSL_new(ssl_ctx_);
  if (ssl_ == nullptr || SSL_set_fd(ssl_, fd_) != 1 || SSL_connect(ssl_) != 1) {
    Close();
    return;
  }
  // Non-blocking from here: a record whose end has not come must not hold
  // a read past its timeout.
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
}

HttpConnection::~HttpConnection() { Close(); }

void HttpConnection::Close() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  if (ssl_ctx_ != nullptr) SSL_CTX_free(ssl_ctx_);
  ssl_ = nullptr;
  ssl_ctx_ = nullptr;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

int HttpConnection::local_port() const {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (fd_ < 0 || getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return 0;
  return ntohs(a.sin_port);
}

bool HttpConnection::Send(const std::string& bytes) {
  size_t sent = 0;
  while (fd_ >= 0 && sent < bytes.size()) {
    ssize_t n;
    if (ssl_ != nullptr) {
      n = SSL_write(ssl_, bytes.data() + sent, static_cast<int>(bytes.size() - sent));
      const int e = n > 0 ? SSL_ERROR_NONE : SSL_get_error(ssl_, static_cast<int>(n));
      if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        pollfd p{fd_, static_cast<short>(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
        poll(&p, 1, 100);
        continue;
      }
    } else {
      n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    }
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return fd_ >= 0;
}

ssize_t HttpConnection::Receive(char* buf, size_t size) {
  if (ssl_ == nullptr) return recv(fd_, buf, size, 0);
  const int n = SSL_read(ssl_, buf, static_cast<int>(size));
  if (n > 0) return n;
  const int e = SSL_get_error(ssl_, n);
  return e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE ? -1 : 0;
}

bool HttpConnection::Pending() const { return ssl_ != nullptr && SSL_pending(ssl_) > 0; }

HttpReply HttpConnection::Read(absl::Duration timeout, bool (*until)(const std::string& raw)) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[65536];
  while (fd_ >= 0 && !Complete(raw_) && !(until != nullptr && until(raw_))) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) break;
    pollfd p{fd_, POLLIN, 0};
    if (!Pending() && poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = Receive(buf, sizeof(buf));
    if (n < 0 && ssl_ != nullptr) continue;  // a record not yet whole
    if (n <= 0) break;
    raw_.append(buf, static_cast<size_t>(n));
    reads_.emplace_back(buf, static_cast<size_t>(n));
  }
  HttpReply r;
  r.reads = reads_;
  const size_t end = raw_.find("\r\n\r\n");
  if (end == std::string::npos) return r;
  std::vector<std::string> lines = absl::StrSplit(raw_.substr(0, end), "\r\n");
  if (lines.empty()) return r;
  std::vector<std::string> first = absl::StrSplit(lines[0], ' ');
  if (first.size() < 2 || !absl::SimpleAtoi(first[1], &r.status)) return r;
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string::npos) continue;
    r.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
  }
  r.body = raw_.substr(end + 4);
  if (r.headers["transfer-encoding"] == "chunked") r.body = Dechunk(r.body);
  return r;
}

HttpReply HttpConnection::Exchange(const std::string& request, absl::Duration timeout) {
  raw_.clear();
  reads_.clear();
  if (!Send(request)) return {};
  return Read(timeout);
}

HttpReply HttpExchange(int port, const std::string& request, absl::Duration timeout) {
  HttpConnection c(port);
  if (!c.ok() || !c.Send(request)) return {};
  return c.Read(timeout);
}

std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(body, '\n')) {
    if (absl::ConsumePrefix(&line, "data: ")) out.emplace_back(line);
  }
  return out;
}

}  // namespace pdserve::testing_support
