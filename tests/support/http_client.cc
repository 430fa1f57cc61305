#include "tests/support/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
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

HttpConnection::HttpConnection(int port, int receive_buffer) {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ >= 0 && receive_buffer > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) Close();
}

HttpConnection::~HttpConnection() { Close(); }

void HttpConnection::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

bool HttpConnection::Send(const std::string& bytes) {
  size_t sent = 0;
  while (fd_ >= 0 && sent < bytes.size()) {
    const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return fd_ >= 0;
}

HttpReply HttpConnection::Read(absl::Duration timeout, bool (*until)(const std::string& raw)) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[65536];
  while (fd_ >= 0 && !Complete(raw_) && !(until != nullptr && until(raw_))) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) break;
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
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
