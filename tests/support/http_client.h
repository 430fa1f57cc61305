// A raw HTTP/1.1 client over a loopback socket, for tests that need what
// a library client hides: bytes exactly as sent (invalid UTF-8, huge or
// malformed bodies), each read as it arrived (SSE flushing), and closing
// the connection mid-response.
#ifndef PDSERVE_TESTS_SUPPORT_HTTP_CLIENT_H_
#define PDSERVE_TESTS_SUPPORT_HTTP_CLIENT_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"

struct ssl_ctx_st;
struct ssl_st;

namespace pdserve::testing_support {

struct HttpReply {
  int status = 0;                              // 0: no status line came back
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // de-chunked
  std::vector<std::string> reads;              // the raw bytes of each read, in order
};

// A POST (or GET when `body` is empty and `method` says so) of `body` as
// JSON, with extra header lines ("Authorization: Bearer x").
std::string HttpRequest(const std::string& method, const std::string& path, const std::string& body,
                        const std::vector<std::string>& headers = {});

class HttpConnection {
 public:
  // Connects to 127.0.0.1:port (check ok()); `receive_buffer` > 0 sets
  // SO_RCVBUF first (a small one makes a client that does not read fill
  // up quickly).
  // `tls_ca` non-empty: HTTPS, the server's certificate checked against
  // that CA (names are not checked).
  explicit HttpConnection(int port, int receive_buffer = 0, const std::string& tls_ca = "");
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  bool ok() const { return fd_ >= 0; }
  bool Send(const std::string& bytes);
  // Reads until `done(reply so far)` holds, the server closes, or the
  // timeout; returns what came. The body is de-chunked when complete.
  HttpReply Read(absl::Duration timeout, bool (*until)(const std::string& raw) = nullptr);
  // The next request on this connection (kept alive) and its whole reply.
  HttpReply Exchange(const std::string& request, absl::Duration timeout = absl::Seconds(60));
  void Close();
  int fd() const { return fd_; }
  int local_port() const;  // 0: not connected

 private:
  // Reads what is there (TLS: decrypted) into buf: the bytes read; 0:
  // closed or failed; -1 (TLS): no whole record yet, poll again.
  ssize_t Receive(char* buf, size_t size);
  bool Pending() const;  // TLS bytes decrypted but not yet read

  int fd_ = -1;
  ssl_ctx_st* ssl_ctx_ = nullptr;
  ssl_st* ssl_ = nullptr;
  std::string raw_;
  std::vector<std::string> reads_;
};

// One whole exchange: sends `request`, reads the reply to its end.
HttpReply HttpExchange(int port, const std::string& request, absl::Duration timeout = absl::Seconds(60));

// The payloads of an SSE body's "data: " lines, in order.
std::vector<std::string> SseData(const std::string& body);

}  // namespace pdserve::testing_support

#endif  // PDSERVE_TESTS_SUPPORT_HTTP_CLIENT_H_
