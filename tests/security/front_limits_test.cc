// Attacks on the router's HTTP front by clients without a key, against a
// real router (API keys on) and decode worker on loopback: what one such
// client, or many, can make the router hold, and whether it stays up.
// Each test says what the attack did before the front read headers ahead
// of libevent's parser and the limits existed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "router/api_keys.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/support/http_client.h"

namespace pdserve {
namespace {

using testing_support::HttpConnection;
using testing_support::HttpExchange;
using testing_support::HttpReply;
using testing_support::HttpRequest;

constexpr char kCompletion[] = R"({"prompt": "And God said", "max_tokens": 2})";
constexpr char kAlice[] = "Authorization: Bearer sk-test-alice";

// A decode worker and a router (keys on, plaintext) started for one test.
class Router {
 public:
  absl::Status Start(const std::vector<std::string>& router_flags, const std::vector<std::string>& decode_flags = {}) {
    dir_ = TempDir();
    std::ofstream(dir_ + "/api_keys") << "alice:" << router::Sha256Hex("sk-test-alice") << "\n";
    std::vector<std::string> dargs = {kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel, "--insecure",
                                      "--ready_file", dir_ + "/decode.ready"};
    dargs.insert(dargs.end(), decode_flags.begin(), decode_flags.end());
    if (absl::Status s = decode_.Start(dargs, dir_ + "/decode.log", {{"PDSERVE_MATRIX_PATH", "f32"}}); !s.ok()) {
      return s;
    }
    absl::StatusOr<int> dport = decode_.WaitReady(dir_ + "/decode.ready", absl::Seconds(60));
    if (!dport.ok()) return dport.status();
    std::vector<std::string> rargs = {kBin + "/router/pdserve-router", "--model", kModel, "--insecure", "--colocated",
                                      "--decode", absl::StrCat("127.0.0.1:", *dport), "--http_listen", "127.0.0.1:0",
                                      "--api_keys_file", dir_ + "/api_keys", "--ready_file", dir_ + "/router.ready"};
    rargs.insert(rargs.end(), router_flags.begin(), router_flags.end());
    if (absl::Status s = router_.Start(rargs, dir_ + "/router.log"); !s.ok()) return s;
    absl::StatusOr<int> rport = router_.WaitReady(dir_ + "/router.ready", absl::Seconds(60));
    if (!rport.ok()) return rport.status();
    http_port_ = ReadyPort(dir_ + "/router.ready", "http_port");
    metrics_port_ = MetricsPort(dir_ + "/router.ready");
    return absl::OkStatus();
  }

  int http_port() const { return http_port_; }
  pid_t pid() const { return router_.pid(); }
  bool alive() { return router_.Wait(absl::ZeroDuration()) == -1; }
  double Metric(const std::string& series) { return MetricValue(HttpGet(metrics_port_, "/metrics"), series); }
  // Waits (up to 10 s) until the metric reaches `want`; its last value.
  double AwaitMetric(const std::string& series, double want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    double v = Metric(series);
    while (v < want && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      v = Metric(series);
    }
    return v;
  }
  std::string LogTail() { return router_.LogTail(); }
  // The router's resident memory, from /proc (0: unreadable).
  int64_t RssKiB() const {
    std::ifstream f(absl::StrCat("/proc/", router_.pid(), "/status"));
    std::string line;
    while (std::getline(f, line)) {
      if (!absl::StartsWith(line, "VmRSS:")) continue;
      int64_t kib = 0;
      const std::string rest = line.substr(6);
      const std::string v(absl::StripAsciiWhitespace(absl::StripSuffix(rest, "kB")));
      return absl::SimpleAtoi(v, &kib) ? kib : 0;
    }
    return 0;
  }

 private:
  std::string dir_;
  testing_support::Subprocess decode_, router_;
  int http_port_ = 0, metrics_port_ = 0;
};

// A connected loopback socket (non-blocking when asked); -1 on failure.
int Connect(int port, bool nonblocking) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closes `fd` (EOF or reset) within `timeout`, reading
// and dropping whatever it sends first.
bool ClosedByServer(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[4096];
  while (absl::Now() < deadline) {
    pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
  }
  return false;
}

std::string Head(const std::string& authorization, int64_t content_length) {
  return absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
                      authorization.empty() ? "" : authorization + "\r\n", "Content-Length: ", content_length,
                      "\r\n\r\n");
}

// Raises this process's open-file limit to the hard limit; the limit now.
rlim_t RaiseFileLimit() {
  rlimit r{};
  getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  setrlimit(RLIMIT_NOFILE, &r);
  getrlimit(RLIMIT_NOFILE, &r);
  return r.rlim_cur;
}

// Attack: announce a large body without a key, send a few KB of it, wait.
// Were the key checked on the generation's thread after the whole body is
// read, with libevent taking bodies up to twice the 8 MiB limit, a 12 MiB
// announcement would get no answer until all 12 MiB had arrived (and been
// held), and a 100 MB one a 413 with the key never looked at.
TEST(FrontLimitsTest, AnUnauthenticatedBodyIsRefusedUnread) {
  Router r;
  ASSERT_TRUE(r.Start({}).ok());
  for (const int64_t announced : {int64_t{12} << 20, int64_t{100'000'000}}) {
    for (const std::string& key : {std::string(), std::string("Authorization: Bearer sk-wrong")}) {
      HttpConnection c(r.http_port());
      ASSERT_TRUE(c.ok());
      ASSERT_TRUE(c.Send(Head(key, announced) + std::string(4096, 'a')));
      const HttpReply got = c.Read(absl::Seconds(5));
      EXPECT_EQ(got.status, 401) << announced << " " << key << ": " << got.body;
      EXPECT_TRUE(absl::StrContains(got.body, "API key")) << got.body;
      // Up to twice the body limit the rest is read and dropped (a client
      // still sending sees the reply, not a reset); beyond, never read.
      const std::string connection = got.headers.count("connection") ? got.headers.at("connection") : "";
      EXPECT_EQ(connection == "close", announced > (int64_t{16} << 20)) << announced << " " << connection;
    }
  }
  EXPECT_EQ(r.Metric("pdserve_http_budget_bytes_used"), 0);
  // A keyed request is served as before.
  const HttpReply ok = HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
  EXPECT_EQ(ok.status, 200) << ok.body;
}

// Attack: open connections and send nothing. Without a cap, each open
// connection holds its descriptor and buffers until the 600 s idle timeout,
// so a client can take every descriptor the process has (accept then fails
// for everyone).
TEST(FrontLimitsTest, ConnectionsOverTheCapAreClosedAndCounted) {
  Router r;
  ASSERT_TRUE(r.Start({"--http_max_connections", "8"}).ok());
  std::vector<int> held;
  for (int i = 0; i < 8; ++i) held.push_back(Connect(r.http_port(), false));
  ASSERT_EQ(r.AwaitMetric("pdserve_http_connections_open", 8), 8);
  for (int i = 0; i < 4; ++i) {
    const int extra = Connect(r.http_port(), false);
    ASSERT_GE(extra, 0);
    EXPECT_TRUE(ClosedByServer(extra, absl::Seconds(5))) << i;
    close(extra);
  }
  EXPECT_EQ(r.Metric("pdserve_http_connections_refused_total"), 4);
  for (int fd : held) close(fd);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (r.Metric("pdserve_http_connections_open") > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  // Each closed before sending a byte, and each was let go.
  EXPECT_EQ(r.Metric("pdserve_http_connections_open"), 0);
  const HttpReply ok = HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
  EXPECT_EQ(ok.status, 200) << ok.body;
}

// Attack (slowloris): a request's headers, or its body, one piece at a
// time, each well inside the idle timeout. With libevent's 600 s per read
// as the only timeout, such a connection stays open as long as the client
// keeps dribbling.
TEST(FrontLimitsTest, SlowHeadersAndSlowBodiesMissTheirDeadline) {
  Router r;
  ASSERT_TRUE(r.Start({"--http_header_timeout", "1", "--http_request_timeout", "2"}).ok());
  const int slow_head = Connect(r.http_port(), false);
  ASSERT_GE(slow_head, 0);
  ASSERT_GT(send(slow_head, "POST /v1/completions HTTP/1.1\r\n", 31, MSG_NOSIGNAL), 0);
  const absl::Time start = absl::Now();
  bool closed = false;
  for (int i = 0; i < 40 && !closed; ++i) {
    send(slow_head, "X-A: b\r\n", 8, MSG_NOSIGNAL);
    closed = ClosedByServer(slow_head, absl::Milliseconds(200));
  }
  EXPECT_TRUE(closed);
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  close(slow_head);
  EXPECT_EQ(r.AwaitMetric("pdserve_http_deadline_closes_total{phase=\"headers\"}", 1), 1);

  const int slow_body = Connect(r.http_port(), false);
  ASSERT_GE(slow_body, 0);
  const std::string head = Head(kAlice, 1000);
  ASSERT_GT(send(slow_body, head.data(), head.size(), MSG_NOSIGNAL), 0);
  closed = false;
  for (int i = 0; i < 40 && !closed; ++i) {
    send(slow_body, "aaaaaaaaaa", 10, MSG_NOSIGNAL);
    closed = ClosedByServer(slow_body, absl::Milliseconds(200));
  }
  EXPECT_TRUE(closed);
  close(slow_body);
  EXPECT_EQ(r.AwaitMetric("pdserve_http_deadline_closes_total{phase=\"body\"}", 1), 1);
  EXPECT_EQ(r.Metric("pdserve_http_budget_bytes_used"), 0);
}

// Attack: hold connections open without a key by sending one refused
// request on each and then nothing (the connection cap filled with idle
// connections shuts keyed clients out). Left to the 600 s idle timeout, a
// connection whose request is answered waits that long for the next one,
// refused or not. So a connection that has not authenticated has the
// header deadline from its last reply to its next request's headers; one
// that has, keeps its keep-alive.
TEST(FrontLimitsTest, AnIdleConnectionAfterARefusalIsClosedAtTheHeaderDeadline) {
  // Requests that ask to be kept alive.
  auto keep_alive = [](std::string req) {
    return absl::StrReplaceAll(req, {{"Connection: close\r\n", ""}});
  };
  Router r;
  ASSERT_TRUE(r.Start({"--http_header_timeout", "1"}).ok());
  // Refused, then idle: closed within the header deadline.
  for (const std::string& key : {std::string(), std::string("Authorization: Bearer sk-wrong")}) {
    const int fd = Connect(r.http_port(), false);
    ASSERT_GE(fd, 0);
    const std::string req = keep_alive(HttpRequest(
        "POST", "/v1/completions", kCompletion, key.empty() ? std::vector<std::string>{} : std::vector<std::string>{key}));
    ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    const absl::Time start = absl::Now();
    EXPECT_TRUE(ClosedByServer(fd, absl::Seconds(5))) << key;
    EXPECT_LT(absl::Now() - start, absl::Seconds(4)) << key;
    close(fd);
  }
  EXPECT_EQ(r.AwaitMetric("pdserve_http_deadline_closes_total{phase=\"headers\"}", 2), 2);
  // Served with a key, then idle past the header deadline: still open, and
  // its next request is served.
  HttpConnection keyed(r.http_port());
  const HttpReply first = keyed.Exchange(keep_alive(HttpRequest("POST", "/v1/completions", kCompletion, {kAlice})));
  ASSERT_EQ(first.status, 200) << first.body;
  absl::SleepFor(absl::Milliseconds(2500));
  const HttpReply second = keyed.Exchange(keep_alive(HttpRequest("POST", "/v1/completions", kCompletion, {kAlice})));
  EXPECT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(r.Metric("pdserve_http_deadline_closes_total{phase=\"headers\"}"), 2);
}

// Attack: more concurrent generations than the router has threads for.
// With one detached thread per request and no bound (API keys' own
// concurrency limits apply only where keys are on and set), a thread that
// cannot be made throws std::system_error into libevent and the router
// dies.
TEST(FrontLimitsTest, GenerationsOverTheInflightCapGet503WithRetryAfter) {
  Router r;
  ASSERT_TRUE(r.Start({"--http_max_inflight", "2"}, {"--fault_step_delay_ms", "50"}).ok());
  constexpr int kClients = 8;
  std::vector<HttpReply> replies(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      replies[i] = HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions",
                                                           R"({"prompt": "And God said", "max_tokens": 20})", {kAlice}));
    });
  }
  for (std::thread& t : clients) t.join();
  int ok = 0, busy = 0;
  for (const HttpReply& got : replies) {
    if (got.status == 200) ++ok;
    if (got.status == 503 || got.status == 429) {
      ++busy;
      EXPECT_EQ(got.headers.count("retry-after"), 1u);
    }
  }
  EXPECT_GE(ok, 2);
  EXPECT_GE(busy, 1);
  EXPECT_EQ(ok + busy, kClients);
  EXPECT_GE(r.Metric("pdserve_http_inflight_refusals_total"), busy);
  EXPECT_TRUE(r.alive()) << r.LogTail();
  const HttpReply after = HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
  EXPECT_EQ(after.status, 200) << after.body;
}

// A pids cgroup of this test's own that holds one process, so that no
// thread can be started in it: cgroup v1's pids controller, or v2's where
// the root delegates it. Empty path where neither can be made (then the
// test says so and skips).
class ThreadCap {
 public:
  ThreadCap() {
    for (const std::string& root : {std::string("/sys/fs/cgroup/pids"), std::string("/sys/fs/cgroup")}) {
      std::ifstream controllers(root + "/cgroup.subtree_control");
      std::string line;
      std::getline(controllers, line);
      const bool v1 = root.ends_with("/pids");
      if (!v1 && line.find("pids") == std::string::npos) continue;
      const std::string dir = absl::StrCat(root, "/pdserve-front-test-", getpid());
      if (mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST) {
        root_ = root;
        dir_ = dir;
        return;
      }
      why_ = absl::StrCat("mkdir ", dir, ": ", strerror(errno));
    }
    if (why_.empty()) why_ = "no pids controller under /sys/fs/cgroup";
  }
  ~ThreadCap() {
    if (dir_.empty()) return;
    if (pid_ > 0) Write(root_ + "/cgroup.procs", std::to_string(pid_));
    rmdir(dir_.c_str());
  }
  bool ok() const { return !dir_.empty(); }
  const std::string& why() const { return why_; }
  // Moves `pid` (all its threads) in and caps the group at what it holds.
  bool Hold(pid_t pid) {
    pid_ = pid;
    if (!Write(dir_ + "/cgroup.procs", std::to_string(pid))) return false;
    std::ifstream current(dir_ + "/pids.current");
    int64_t n = 0;
    if (!(current >> n) || n <= 0) return false;
    return Write(dir_ + "/pids.max", std::to_string(n));
  }
  bool Release() { return Write(dir_ + "/pids.max", "max"); }

 private:
  static bool Write(const std::string& path, const std::string& value) {
    std::ofstream f(path);
    f << value;
    f.flush();
    return f.good();
  }
  std::string root_, dir_, why_;
  pid_t pid_ = 0;
};

// Attack: requests while the router can start no thread at all (its pids
// cgroup full; as when the process reaches its thread limit). Uncaught,
// the std::system_error of the thread's start escapes into libevent and
// the router dies. Each such request is refused with 503 and Retry-After,
// counted, and the router serves again once threads can be started.
TEST(FrontLimitsTest, RequestsWhenNoThreadCanStartGet503AndTheRouterLives) {
  ThreadCap cap;
  if (!cap.ok()) GTEST_SKIP() << "cannot make a pids cgroup to cap the router's threads: " << cap.why();
  Router r;
  ASSERT_TRUE(r.Start({}).ok());
  ASSERT_TRUE(cap.Hold(r.pid()));
  constexpr int kRequests = 5;
  for (int i = 0; i < kRequests; ++i) {
    const HttpReply got = HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
    EXPECT_EQ(got.status, 503) << got.body;
    EXPECT_EQ(got.headers.count("retry-after"), 1u);
    EXPECT_TRUE(absl::StrContains(got.body, "no thread could be started")) << got.body;
  }
  EXPECT_TRUE(r.alive()) << r.LogTail();
  ASSERT_TRUE(cap.Release());
  EXPECT_EQ(r.Metric("pdserve_http_inflight_refusals_total"), kRequests);
  const HttpReply after = HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
  EXPECT_EQ(after.status, 200) << after.body;
  EXPECT_TRUE(r.alive()) << r.LogTail();
}

// One attacking connection in the load test.
struct Attacker {
  enum Kind { kSlow, kOversize, kUnauthenticated } kind;
  int fd = -1;
  std::string pending;  // bytes still to send
  absl::Time next_drip;
  bool done = false;
  int status = 0;
  std::string reply;
};

// Attack, all at once: 2,000 slowloris connections, 200 unauthenticated
// 100 MB uploads and 1,000 unauthenticated requests, while a keyed client
// goes on asking for completions. Without the front's limits each upload
// is buffered up to 16 MiB before anything looks at it (200 of them: over
// 3 GB), every slow connection stays open for the 600 s idle timeout, and
// every request gets a thread of its own.
TEST(FrontLimitsTest, ALoadOfUnauthenticatedClientsLeavesTheRouterSmallAndServing) {
  const rlim_t files = RaiseFileLimit();
  if (files < 4000) GTEST_SKIP() << "the open-file limit (" << files << ") is below the 3,200 sockets the test opens";
  Router r;
  ASSERT_TRUE(r.Start({"--http_max_connections", "4000", "--http_header_timeout", "20"}).ok());
  const absl::Time start = absl::Now();

  std::atomic<bool> attacking{true};
  std::atomic<int> served{0}, failed{0};
  std::thread keyed([&] {
    while (attacking.load()) {
      const HttpReply got =
          HttpExchange(r.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}),
                       absl::Seconds(30));
      (got.status == 200 ? served : failed).fetch_add(1);
    }
  });

  std::vector<Attacker> attackers;
  auto add = [&](Attacker::Kind kind, int n) {
    for (int i = 0; i < n; ++i) {
      Attacker a;
      a.kind = kind;
      a.fd = Connect(r.http_port(), true);
      ASSERT_GE(a.fd, 0) << strerror(errno);
      if (kind == Attacker::kSlow) a.pending = "POST /v1/completions HTTP/1.1\r\n";
      if (kind == Attacker::kOversize) a.pending = Head("", 100'000'000);
      if (kind == Attacker::kUnauthenticated) {
        a.pending = HttpRequest("POST", "/v1/completions", kCompletion, {"Authorization: Bearer sk-mallory"});
      }
      a.next_drip = absl::Now() + absl::Seconds(1);
      attackers.push_back(std::move(a));
    }
  };
  add(Attacker::kSlow, 2000);
  add(Attacker::kOversize, 200);
  add(Attacker::kUnauthenticated, 1000);

  const std::string chunk(64 << 10, 'a');
  int64_t peak_kib = 0;
  const absl::Time attack_end = absl::Now() + absl::Seconds(15);
  std::vector<pollfd> fds(attackers.size());
  while (absl::Now() < attack_end) {
    for (size_t i = 0; i < attackers.size(); ++i) {
      Attacker& a = attackers[i];
      fds[i] = {a.done ? -1 : a.fd, static_cast<short>(POLLIN | (a.pending.empty() && a.kind != Attacker::kOversize
                                                                     ? 0
                                                                     : POLLOUT)),
                0};
    }
    poll(fds.data(), fds.size(), 100);
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < attackers.size(); ++i) {
      Attacker& a = attackers[i];
      if (a.done) continue;
      if (a.kind == Attacker::kSlow && a.pending.empty() && now >= a.next_drip) {
        a.pending = "X-Slow: 1\r\n";
        a.next_drip = now + absl::Seconds(1);
      }
      if (fds[i].revents & POLLOUT) {
        // An oversize upload sends its body for as long as it is let.
        if (a.pending.empty() && a.kind == Attacker::kOversize) a.pending = chunk;
        const ssize_t n = send(a.fd, a.pending.data(), a.pending.size(), MSG_NOSIGNAL);
        if (n > 0) a.pending.erase(0, static_cast<size_t>(n));
      }
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[4096];
        const ssize_t n = recv(a.fd, buf, sizeof(buf), 0);
        if (n > 0) a.reply.append(buf, static_cast<size_t>(n));
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          a.done = true;
          close(a.fd);
        }
      }
    }
    peak_kib = std::max(peak_kib, r.RssKiB());
    ASSERT_TRUE(r.alive()) << r.LogTail();
  }
  attacking.store(false);
  keyed.join();
  const absl::Duration took = absl::Now() - start;

  int slow_open = 0, refused_401 = 0, unauthenticated = 0, oversize = 0;
  for (Attacker& a : attackers) {
    if (a.kind == Attacker::kSlow && !a.done) ++slow_open;
    if (a.kind == Attacker::kUnauthenticated) ++unauthenticated;
    if (a.kind == Attacker::kOversize) ++oversize;
    if (a.kind != Attacker::kSlow && absl::StartsWith(a.reply, "HTTP/1.1 401")) ++refused_401;
    if (!a.done) close(a.fd);
  }
  std::cerr << "load: peak RSS " << peak_kib / 1024 << " MiB, " << served.load() << " keyed requests served, "
            << refused_401 << " of " << unauthenticated + oversize << " unauthenticated refused with 401, "
            << slow_open << " slow connections still open, " << absl::FormatDuration(took) << "\n";
  EXPECT_TRUE(r.alive()) << r.LogTail();
  EXPECT_LT(peak_kib, 256 << 10);
  EXPECT_GT(served.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  // Every unauthenticated request was answered 401, the oversize ones
  // before their body (an upload cut off by the close may lose the reply
  // to a reset, so those are counted only together).
  EXPECT_GE(refused_401, unauthenticated);
  EXPECT_EQ(r.Metric("pdserve_http_connections_refused_total"), 0);
  // Every slow connection was accepted and still waits within its header
  // deadline: none was reset out of a full listen queue (with libevent's
  // backlog of 128, about 300 of them were).
  EXPECT_EQ(slow_open, 2000);
}

}  // namespace
}  // namespace pdserve
