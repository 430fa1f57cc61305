// http_sse_bench: measures the HTTP server libraries the router's OpenAI API
// could be built on (libmicrohttpd, libevent's evhttp, cpp-httplib) serving
// server-sent-event streams, so that the choice is made by measurement.
//
//   http_sse_bench [--libs=mhd,mhd_poll,libevent,httplib] [--streams=1,64,256]
//                  [--modes=flood,paced] [--paced_interval_us=1000,10000]
//                  [--events=400] [--flood_events_total=200000]
//
// Every run (library x streams x mode) forks a fresh server process pinned to
// --server_cpu; this process is the client, pinned to --client_cpu. The
// server process holds the library and one producer thread which, like the
// router's relay threads, generates the events for every open stream:
//   paced: one event per open stream every --paced_interval_us, on a common
//          clock (a decode step emits a token for every sequence at once);
//   flood: events as fast as the producer can make them (raw throughput).
// Each event carries two CLOCK_MONOTONIC times, read by the client on the
// same clock: "t", when the producer queued this event, and "s", when the
// producer's step began. t-latency is the library's own path; s-latency adds
// the producer's hand-off of the step's other events before this one, which
// differs by library (a thread wake-up per stream for cpp-httplib, a
// connection resume per stream for libmicrohttpd, one eventfd write per batch
// for libevent) and is what a client of a decode step sees.
//
// The client is a minimal raw-socket HTTP/1.1 reader (epoll, one thread): it
// only has to decode the chunked framing of a known SSE stream. The servers
// use each library's own HTTP code.
#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <fcntl.h>
#include <httplib.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

ABSL_FLAG(std::vector<std::string>, libs,
          std::vector<std::string>({"mhd", "mhd_poll", "libevent", "httplib"}),
          "servers to measure, in order: mhd (libmicrohttpd, epoll), mhd_poll (libmicrohttpd, poll), "
          "libevent, httplib");
ABSL_FLAG(std::vector<std::string>, streams, std::vector<std::string>({"1", "64", "256"}),
          "concurrent SSE streams per run");
ABSL_FLAG(std::vector<std::string>, modes, std::vector<std::string>({"flood", "paced"}),
          "producer modes: flood (no interval) and/or paced");
ABSL_FLAG(int, events, 400, "events per stream in the paced mode (the n of GET /stream?n=)");
ABSL_FLAG(std::vector<std::string>, paced_interval_us, std::vector<std::string>({"1000", "10000"}),
          "paced mode: the producer's steps to run, one run each; every open stream gets one event per step");
ABSL_FLAG(int, flood_events_total, 200000,
          "flood mode: events per run, split over the streams (at least --events each), so that "
          "every run lasts long enough to measure");
ABSL_FLAG(int, repeat, 1,
          "runs per library x streams x mode; the table gives each number's median over them, and the "
          "failures summed");
ABSL_FLAG(int, server_cpu, 0, "CPU the server process (library threads and producer) is pinned to");
ABSL_FLAG(int, client_cpu, 1, "CPU the client is pinned to");
ABSL_FLAG(int, timeout_s, 5, "a run's streams that are not complete after this (plus the paced duration) fail");
ABSL_FLAG(bool, tcp_nodelay, true,
          "set TCP_NODELAY on libevent's and cpp-httplib's connections (libmicrohttpd sets it itself); "
          "cpp-httplib's default is off");
ABSL_FLAG(int, httplib_threads, 0,
          "cpp-httplib worker threads (0: the largest --streams + 8; a stream holds a thread for its "
          "whole life, and the library's default pool has only max(8, cores - 1))");
ABSL_FLAG(int, listen_backlog, 1024,
          "listen backlog for all three servers, so that the client's burst of connects is not dropped "
          "(0: each library's default: libmicrohttpd SOMAXCONN, libevent 128, cpp-httplib 5 compiled "
          "into Debian's library)");
ABSL_FLAG(int, mhd_threads, 1, "libmicrohttpd polling threads (MHD_OPTION_THREAD_POOL_SIZE when > 1)");

namespace pdserve::bench {
namespace {

// The most bytes a server hands its library per write: the same cap for all
// three, so that none of them wins the flood mode by writing larger chunks.
constexpr size_t kMaxChunk = 16 * 1024;
constexpr std::string_view kDone = "data: [DONE]\n\n";

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void SleepUntilNs(int64_t t) {
  timespec ts{static_cast<time_t>(t / 1000000000), static_cast<long>(t % 1000000000)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
  }
}

// Pins the calling thread; threads it starts later inherit the mask.
void PinToCpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    std::fprintf(stderr, "sched_setaffinity(%d): %s\n", cpu, std::strerror(errno));
    std::exit(1);
  }
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Raises a listening socket's backlog: Linux applies a second listen() to a
// socket that is already listening. Used where a library fixes the backlog
// and takes no listening socket from its caller.
void Relisten(int fd) {
  const int backlog = absl::GetFlag(FLAGS_listen_backlog);
  if (backlog > 0 && listen(fd, backlog) != 0) std::fprintf(stderr, "listen(): %s\n", std::strerror(errno));
}

double CpuSeconds(const rusage& r) {
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

// ---------------------------------------------------------------------------
// Server side: one stream per request, filled by the producer thread.

// One SSE response. The producer appends encoded events to `pending`; the
// library side takes them. `parked` is the hand-off: the library side sets it
// (under `mu`) when it found nothing to send and waits; the producer clears
// it when it queues the next event and then calls Backend::Wake. So exactly
// one wake happens per park, whatever the library's waiting mechanism.
struct Stream {
  std::mutex mu;
  std::string pending;  // Encoded events not yet taken by the library.
  bool eof = false;     // [DONE] has been queued; nothing follows.
  bool parked = false;
  bool closed = false;  // The connection is gone; the producer stops.
  int to_produce = 0;   // Producer thread only.

  // Library-specific handles.
  std::condition_variable cv;                   // cpp-httplib: the handler thread waits here.
  MHD_Connection* mhd_connection = nullptr;     // libmicrohttpd: to suspend/resume.
  evhttp_request* ev_request = nullptr;         // libevent: valid until finished or closed.
  bool ev_finished = false;                     // libevent: reply ended (loop thread only).

  // Takes up to `max` bytes of queued events; `*end` is set when that
  // includes the end of the stream. Caller holds `mu`.
  std::string TakeLocked(size_t max, bool* end) {
    std::string out;
    if (pending.size() <= max) {
      out.swap(pending);
    } else {
      out = pending.substr(0, max);
      pending.erase(0, max);
    }
    *end = eof && pending.empty();
    return out;
  }
};

class Producer;

// A library's server. Start() binds 127.0.0.1 on an ephemeral port, starts
// the library's threads and returns the port (or -1).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual int Start(Producer* producer) = 0;
  // Called by the producer, without the stream's lock, after it queued data
  // for a parked stream.
  virtual void Wake(Stream* stream) = 0;
};

class Producer {
 public:
  explicit Producer(int64_t interval_ns) : interval_ns_(interval_ns) {}

  void set_backend(Backend* backend) { backend_ = backend; }

  // A stream for a request of n events. The library fills in its handles
  // and then calls Begin(). Streams are never freed: the server process
  // lives for one run, and this keeps the raw pointers the libraries'
  // callbacks hold valid however late those fire.
  Stream* NewStream(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    all_.push_back(std::make_unique<Stream>());
    all_.back()->to_produce = n;
    return all_.back().get();
  }

  void Begin(Stream* stream) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fresh_.push_back(stream);
    }
    cv_.notify_one();
  }

  // The producer thread.
  void Run() {
    std::vector<Stream*> active;
    int64_t next_step = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (active.empty()) cv_.wait(lock, [&] { return !fresh_.empty(); });
        active.insert(active.end(), fresh_.begin(), fresh_.end());
        fresh_.clear();
      }
      if (interval_ns_ > 0) {
        // A late step is not made up with a burst: the offered rate drops
        // instead, which the delivered events/s shows.
        next_step = std::max(next_step, NowNs());
        SleepUntilNs(next_step);
        next_step += interval_ns_;
      }
      const int64_t step_ns = NowNs();
      std::erase_if(active, [&](Stream* s) { return !Enqueue(s, step_ns); });
    }
  }

 private:
  // Queues the stream's next event (or its [DONE]); false once it has no
  // more to queue.
  bool Enqueue(Stream* s, int64_t step_ns) {
    char event[128];
    bool wake = false, more = false;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->closed) return false;
      if (s->to_produce > 0) {
        // The time is taken last, just before the event becomes visible to
        // the library side.
        const int len = std::snprintf(
            event, sizeof(event), "data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}],\"t\":%lld,\"s\":%lld}\n\n",
            static_cast<long long>(NowNs()), static_cast<long long>(step_ns));
        s->pending.append(event, len);
        --s->to_produce;
        more = true;  // At least [DONE] follows.
      } else {
        s->pending.append(kDone);
        s->eof = true;
      }
      if (s->parked) {
        s->parked = false;
        wake = true;
      }
    }
    if (wake) backend_->Wake(s);
    return more;
  }

  const int64_t interval_ns_;
  Backend* backend_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Stream>> all_;
  std::vector<Stream*> fresh_;
};

int ParseEvents(const char* value) {
  int n = 0;
  if (value == nullptr || !absl::SimpleAtoi(value, &n) || n < 0) return -1;
  return n;
}

// --- libmicrohttpd: one internal polling thread (or a pool); a stream with
// nothing to send suspends its connection from the content reader, and the
// producer resumes it.
//
// With epoll, 0.9.75 stalls under load: MHD_epoll() repeats epoll_wait()
// while a call returns MAX_EVENTS (128) events, with the same timeout, which
// for the internal thread is infinite; once the edge-triggered events are
// drained it blocks there with the ones it collected still unprocessed
// (daemon.c). Seen here at 256 streams: the polling thread sits in
// epoll_wait(-1) while most streams have not been answered, until some
// unrelated event arrives. That is why poll() ("mhd_poll") is measured too.
class MhdBackend : public Backend {
 public:
  explicit MhdBackend(bool use_epoll) : use_epoll_(use_epoll) {}

  int Start(Producer* producer) override {
    producer_ = producer;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    std::vector<MHD_OptionItem> options = {{MHD_OPTION_SOCK_ADDR, 0, &addr}};
    // One thread is the library's own polling thread; more make a pool.
    if (const int threads = absl::GetFlag(FLAGS_mhd_threads); threads > 1) {
      options.push_back({MHD_OPTION_THREAD_POOL_SIZE, threads, nullptr});
    }
    if (const int backlog = absl::GetFlag(FLAGS_listen_backlog); backlog > 0) {
      options.push_back({MHD_OPTION_LISTEN_BACKLOG_SIZE, backlog, nullptr});
    }
    options.push_back({MHD_OPTION_END, 0, nullptr});
    daemon_ = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | (use_epoll_ ? MHD_USE_EPOLL : MHD_USE_POLL) | MHD_ALLOW_SUSPEND_RESUME |
            MHD_USE_ERROR_LOG,
        0,
        nullptr, nullptr, &MhdBackend::Access, this, MHD_OPTION_ARRAY, options.data(), MHD_OPTION_END);
    if (daemon_ == nullptr) return -1;
    const MHD_DaemonInfo* info = MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_BIND_PORT);
    return info == nullptr ? -1 : info->port;
  }

  void Wake(Stream* stream) override { MHD_resume_connection(stream->mhd_connection); }

 private:
  static MHD_Result Access(void* cls, MHD_Connection* connection, const char* url, const char* method,
                           const char* version, const char* upload_data, size_t* upload_data_size,
                           void** con_cls) {
    auto* self = static_cast<MhdBackend*>(cls);
    const int n = ParseEvents(MHD_lookup_connection_value(connection, MHD_GET_ARGUMENT_KIND, "n"));
    if (std::strcmp(url, "/stream") != 0 || std::strcmp(method, "GET") != 0 || n < 0) return MHD_NO;
    Stream* s = self->producer_->NewStream(n);
    s->mhd_connection = connection;
    MHD_Response* response =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, kMaxChunk, &MhdBackend::Read, s, &MhdBackend::Free);
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(response, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    const MHD_Result queued = MHD_queue_response(connection, MHD_HTTP_OK, response);
    MHD_destroy_response(response);
    self->producer_->Begin(s);
    return queued;
  }

  static ssize_t Read(void* cls, uint64_t pos, char* buf, size_t max) {
    auto* s = static_cast<Stream*>(cls);
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->pending.empty()) {
      if (s->eof) return MHD_CONTENT_READER_END_OF_STREAM;
      // Suspending under the stream's lock orders it before the producer's
      // resume, which must never reach a connection that is not suspended.
      s->parked = true;
      MHD_suspend_connection(s->mhd_connection);
      return 0;
    }
    bool end;  // Unused: the next call finds the stream empty and ends it.
    const std::string out = s->TakeLocked(std::min(max, kMaxChunk), &end);
    std::memcpy(buf, out.data(), out.size());
    return static_cast<ssize_t>(out.size());
  }

  static void Free(void* cls) {
    auto* s = static_cast<Stream*>(cls);
    std::lock_guard<std::mutex> lock(s->mu);
    s->closed = true;
  }

  const bool use_epoll_;
  Producer* producer_ = nullptr;
  MHD_Daemon* daemon_ = nullptr;
};

// --- libevent evhttp: one event-loop thread. The producer hands woken
// streams to the loop through a list and an eventfd; the loop writes one
// chunk per stream at a time and asks for the next when the socket has
// taken it (evhttp_send_reply_chunk_with_cb), which is also the back
// pressure against a slow client.
class LibeventBackend : public Backend {
 public:
  int Start(Producer* producer) override {
    producer_ = producer;
    base_ = event_base_new();
    http_ = evhttp_new(base_);
    if (base_ == nullptr || http_ == nullptr) return -1;
    evhttp_set_cb(http_, "/stream", &LibeventBackend::OnRequest, this);
    evhttp_bound_socket* bound = evhttp_bind_socket_with_handle(http_, "127.0.0.1", 0);
    if (bound == nullptr) return -1;
    const int listen_fd = evhttp_bound_socket_get_fd(bound);
    Relisten(listen_fd);
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    if (getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    wake_event_ = event_new(base_, wake_fd_, EV_READ | EV_PERSIST, &LibeventBackend::OnWake, this);
    event_add(wake_event_, nullptr);
    loop_ = std::thread([this] { event_base_dispatch(base_); });
    return ntohs(addr.sin_port);
  }

  void Wake(Stream* stream) override {
    bool signal;
    {
      std::lock_guard<std::mutex> lock(woken_mu_);
      signal = woken_.empty();  // Otherwise the loop has a wake pending already.
      woken_.push_back(stream);
    }
    if (signal) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t r = write(wake_fd_, &one, sizeof(one));
    }
  }

 private:
  static void OnRequest(evhttp_request* req, void* arg) {
    auto* self = static_cast<LibeventBackend*>(arg);
    const char* q = evhttp_uri_get_query(evhttp_request_get_evhttp_uri(req));
    int n = -1;
    evkeyvalq query;
    if (q != nullptr && evhttp_parse_query_str(q, &query) == 0) {
      n = ParseEvents(evhttp_find_header(&query, "n"));
      evhttp_clear_headers(&query);
    }
    if (n < 0) {
      evhttp_send_error(req, HTTP_BADREQUEST, nullptr);
      return;
    }
    Stream* s = self->producer_->NewStream(n);
    s->ev_request = req;
    s->parked = true;  // Nothing calls back into us until the producer wakes it.
    evhttp_connection* conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(conn, &LibeventBackend::OnClose, s);
    if (absl::GetFlag(FLAGS_tcp_nodelay)) SetNoDelay(bufferevent_getfd(evhttp_connection_get_bufferevent(conn)));
    evkeyvalq* headers = evhttp_request_get_output_headers(req);
    evhttp_add_header(headers, "Content-Type", "text/event-stream");
    evhttp_add_header(headers, "Cache-Control", "no-cache");
    evhttp_send_reply_start(req, HTTP_OK, "OK");
    self->producer_->Begin(s);
  }

  static void OnWake(evutil_socket_t fd, short, void* arg) {
    auto* self = static_cast<LibeventBackend*>(arg);
    uint64_t count;
    [[maybe_unused]] ssize_t r = read(fd, &count, sizeof(count));
    std::vector<Stream*> woken;
    {
      std::lock_guard<std::mutex> lock(self->woken_mu_);
      woken.swap(self->woken_);
    }
    for (Stream* s : woken) Pump(s);
  }

  // Sends the stream's next chunk, or parks it. Loop thread only.
  static void Pump(Stream* s) {
    if (s->ev_finished) return;
    std::string out;
    bool end = false;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->closed) return;
      out = s->TakeLocked(kMaxChunk, &end);
      if (out.empty()) {
        s->parked = true;
        return;
      }
    }
    evbuffer* buf = evbuffer_new();
    evbuffer_add(buf, out.data(), out.size());
    if (end) {
      evhttp_send_reply_chunk(s->ev_request, buf);
      evhttp_send_reply_end(s->ev_request);
      s->ev_finished = true;
    } else {
      evhttp_send_reply_chunk_with_cb(s->ev_request, buf, &LibeventBackend::OnChunkSent, s);
    }
    evbuffer_free(buf);
  }

  static void OnChunkSent(evhttp_connection*, void* arg) { Pump(static_cast<Stream*>(arg)); }

  static void OnClose(evhttp_connection*, void* arg) {
    auto* s = static_cast<Stream*>(arg);
    std::lock_guard<std::mutex> lock(s->mu);
    s->closed = true;
  }

  Producer* producer_ = nullptr;
  event_base* base_ = nullptr;
  evhttp* http_ = nullptr;
  int wake_fd_ = -1;
  event* wake_event_ = nullptr;
  std::thread loop_;
  std::mutex woken_mu_;
  std::vector<Stream*> woken_;
};

// --- cpp-httplib: a thread pool; each stream's chunked content provider
// runs on its own pool thread and blocks until the producer has an event.
class HttplibBackend : public Backend {
 public:
  explicit HttplibBackend(int threads) : threads_(threads) {}

  int Start(Producer* producer) override {
    producer_ = producer;
    const size_t threads = threads_;
    server_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_.set_tcp_nodelay(absl::GetFlag(FLAGS_tcp_nodelay));
    server_.Get("/stream", [this](const httplib::Request& req, httplib::Response& res) { Handle(req, res); });
    // The library passes its listening socket through here before it binds
    // it; this is the one way to reach that socket.
    server_.set_socket_options([this](int fd) {
      httplib::default_socket_options(fd);
      if (listen_fd_ < 0) listen_fd_ = fd;
    });
    const int port = server_.bind_to_any_port("127.0.0.1");
    if (port <= 0 || listen_fd_ < 0) return -1;
    Relisten(listen_fd_);
    listener_ = std::thread([this] { server_.listen_after_bind(); });
    return port;
  }

  void Wake(Stream* stream) override { stream->cv.notify_one(); }

 private:
  void Handle(const httplib::Request& req, httplib::Response& res) {
    const int n = req.has_param("n") ? ParseEvents(req.get_param_value("n").c_str()) : -1;
    if (n < 0) {
      res.status = 400;
      return;
    }
    Stream* s = producer_->NewStream(n);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [s](size_t, httplib::DataSink& sink) {
          std::string out;
          bool end = false;
          {
            std::unique_lock<std::mutex> lock(s->mu);
            while (s->pending.empty() && !s->eof) {
              s->parked = true;
              s->cv.wait(lock);
            }
            out = s->TakeLocked(kMaxChunk, &end);
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (end) sink.done();
          return true;
        },
        [s](bool) {
          std::lock_guard<std::mutex> lock(s->mu);
          s->closed = true;
        });
    producer_->Begin(s);
  }

  const int threads_;
  Producer* producer_ = nullptr;
  int listen_fd_ = -1;
  httplib::Server server_;
  std::thread listener_;
};

bool KnownLibrary(const std::string& lib) {
  return lib == "mhd" || lib == "mhd_poll" || lib == "libevent" || lib == "httplib";
}

std::unique_ptr<Backend> MakeBackend(const std::string& lib, int httplib_threads) {
  if (lib == "mhd") return std::make_unique<MhdBackend>(/*use_epoll=*/true);
  if (lib == "mhd_poll") return std::make_unique<MhdBackend>(/*use_epoll=*/false);
  if (lib == "libevent") return std::make_unique<LibeventBackend>();
  if (lib == "httplib") return std::make_unique<HttplibBackend>(httplib_threads);
  return nullptr;
}

// The forked server process: serves until the parent writes to `stop_fd`,
// then reports its CPU time over `report_fd` and exits without tearing the
// library down (a fresh process serves the next run).
[[noreturn]] void ServerMain(const std::string& lib, int64_t interval_ns, int httplib_threads, int report_fd,
                             int stop_fd) {
  PinToCpu(absl::GetFlag(FLAGS_server_cpu));
  Producer producer(interval_ns);
  std::unique_ptr<Backend> backend = MakeBackend(lib, httplib_threads);
  producer.set_backend(backend.get());
  const int port = backend ? backend->Start(&producer) : -1;
  std::thread([&producer] { producer.Run(); }).detach();
  rusage before, after;
  getrusage(RUSAGE_SELF, &before);
  [[maybe_unused]] ssize_t r = write(report_fd, &port, sizeof(port));
  // Blocks until the parent's client is done (or the parent is gone).
  char byte;
  r = read(stop_fd, &byte, 1);
  getrusage(RUSAGE_SELF, &after);
  const double cpu = CpuSeconds(after) - CpuSeconds(before);
  r = write(report_fd, &cpu, sizeof(cpu));
  _exit(0);
}

// ---------------------------------------------------------------------------
// Client: C connections on one epoll thread.

struct ClientConn {
  enum class State { kConnecting, kHeaders, kChunkSize, kChunkData, kChunkEnd, kDone };
  int fd = -1;
  State state = State::kConnecting;
  std::string head;   // Response head, then the current chunk-size line.
  size_t chunk_left = 0;
  std::string body;   // Body bytes not yet split into events.
  int events = 0;     // Data events received.
  bool done_seen = false;
  bool ok = false;
  bool closed = false;
};

struct ClientResult {
  int64_t events = 0;
  int64_t reads_with_events = 0;
  int64_t multi_event_reads = 0;  // Reads that completed more than one event.
  int failures = 0;
  double seconds = 0;
  double max_first_byte_ms = 0;  // Slowest stream's request-to-response-head time.
  double cpu_s = 0;
  std::vector<int64_t> latencies_ns;       // From "t" (queued).
  std::vector<int64_t> step_latencies_ns;  // From "s" (step began).
};

class Client {
 public:
  Client(int port, int streams, int events) : port_(port), expected_(events), conns_(streams) {}

  ClientResult Run(double timeout_s) {
    rusage ru0, ru1;
    getrusage(RUSAGE_THREAD, &ru0);
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    request_ = absl::StrFormat("GET /stream?n=%d HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n",
                               expected_);
    start_ns_ = NowNs();
    int open = 0;
    for (size_t i = 0; i < conns_.size(); ++i) open += Connect(i) ? 1 : 0;
    result_.failures = static_cast<int>(conns_.size()) - open;
    const int64_t deadline = start_ns_ + static_cast<int64_t>(timeout_s * 1e9);
    int64_t last_done = start_ns_;
    std::vector<char> buf(64 * 1024);
    std::vector<epoll_event> ready(256);
    while (open > 0 && NowNs() < deadline) {
      const int n = epoll_wait(epoll_, ready.data(), static_cast<int>(ready.size()), 100);
      for (int i = 0; i < n; ++i) {
        ClientConn& c = conns_[ready[i].data.u32];
        if (c.closed) continue;
        if (c.state == ClientConn::State::kConnecting) {
          SendRequest(c);
        } else {
          ReadSome(c, buf);
        }
        if (c.closed) {
          --open;
          if (c.ok) last_done = NowNs();
          else ++result_.failures;
        }
      }
    }
    for (ClientConn& c : conns_) {
      if (!c.closed && c.fd >= 0) {
        close(c.fd);
        ++result_.failures;
      }
    }
    close(epoll_);
    result_.seconds = (last_done - start_ns_) / 1e9;
    getrusage(RUSAGE_THREAD, &ru1);
    result_.cpu_s = CpuSeconds(ru1) - CpuSeconds(ru0);
    return std::move(result_);
  }

 private:
  bool Connect(size_t i) {
    ClientConn& c = conns_[i];
    c.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    if (connect(c.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno != EINPROGRESS) {
      close(c.fd);
      c.closed = true;
      return false;
    }
    epoll_event ev{};
    ev.events = EPOLLOUT;
    ev.data.u32 = static_cast<uint32_t>(i);
    epoll_ctl(epoll_, EPOLL_CTL_ADD, c.fd, &ev);
    return true;
  }

  void SendRequest(ClientConn& c) {
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    // The request is a few dozen bytes: one send fits in any socket buffer.
    if (err != 0 || send(c.fd, request_.data(), request_.size(), MSG_NOSIGNAL) !=
                        static_cast<ssize_t>(request_.size())) {
      Close(c);
      return;
    }
    c.state = ClientConn::State::kHeaders;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = static_cast<uint32_t>(&c - conns_.data());
    epoll_ctl(epoll_, EPOLL_CTL_MOD, c.fd, &ev);
  }

  // One recv per readiness, so that a read holding several events means
  // they were already queued together when the client got to the socket.
  void ReadSome(ClientConn& c, std::vector<char>& buf) {
    const ssize_t n = recv(c.fd, buf.data(), buf.size(), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    const int64_t now = NowNs();
    if (n <= 0) {  // The server closed (or reset) before the terminal chunk.
      Close(c);
      return;
    }
    int completed = 0;
    std::string_view in(buf.data(), static_cast<size_t>(n));
    while (!in.empty() && !c.closed) {
      switch (c.state) {
        case ClientConn::State::kHeaders: {
          const size_t before = c.head.size();
          c.head.append(in);
          const size_t end = c.head.find("\r\n\r\n");
          if (end == std::string::npos) {
            in = {};
            break;
          }
          in.remove_prefix(end + 4 - before);
          // Every server answers HTTP/1.1 200 with chunked framing here;
          // anything else is a failed stream.
          if (c.head.rfind("HTTP/1.1 200", 0) != 0 || c.head.find("hunked") == std::string::npos) {
            Close(c);
            break;
          }
          result_.max_first_byte_ms = std::max(result_.max_first_byte_ms, (now - start_ns_) / 1e6);
          c.head.clear();
          c.state = ClientConn::State::kChunkSize;
          break;
        }
        case ClientConn::State::kChunkSize: {
          const size_t lf = in.find('\n');
          c.head.append(in.substr(0, lf == std::string_view::npos ? in.size() : lf + 1));
          if (lf == std::string_view::npos) {
            in = {};
            break;
          }
          in.remove_prefix(lf + 1);
          c.chunk_left = std::strtoul(c.head.c_str(), nullptr, 16);
          c.head.clear();
          if (c.chunk_left == 0) {  // Terminal chunk (servers send no trailers).
            c.ok = c.done_seen && c.events == expected_;
            c.state = ClientConn::State::kDone;
            Close(c);
          } else {
            c.state = ClientConn::State::kChunkData;
          }
          break;
        }
        case ClientConn::State::kChunkData: {
          const size_t take = std::min(c.chunk_left, in.size());
          c.body.append(in.substr(0, take));
          in.remove_prefix(take);
          c.chunk_left -= take;
          if (c.chunk_left == 0) c.state = ClientConn::State::kChunkEnd;
          completed += SplitEvents(c, now);
          break;
        }
        case ClientConn::State::kChunkEnd: {  // The CRLF after a chunk's data.
          const size_t lf = in.find('\n');
          if (lf == std::string_view::npos) {
            in = {};
          } else {
            in.remove_prefix(lf + 1);
            c.state = ClientConn::State::kChunkSize;
          }
          break;
        }
        case ClientConn::State::kConnecting:
        case ClientConn::State::kDone:
          in = {};
          break;
      }
    }
    if (completed > 0) {
      ++result_.reads_with_events;
      if (completed > 1) ++result_.multi_event_reads;
    }
  }

  // Splits complete events off the body; returns how many were completed.
  int SplitEvents(ClientConn& c, int64_t now) {
    int completed = 0;
    size_t start = 0;
    for (size_t end; (end = c.body.find("\n\n", start)) != std::string::npos; start = end + 2) {
      const std::string_view event(c.body.data() + start, end + 2 - start);
      ++completed;
      if (event == kDone) {
        c.done_seen = true;
        continue;
      }
      const size_t t = event.find("\"t\":");
      const size_t step = event.find("\"s\":");
      if (t == std::string_view::npos || step == std::string_view::npos) continue;
      ++c.events;
      ++result_.events;
      // Both numbers end at a ',' or '}' inside the event, so strtoll stops
      // within it.
      result_.latencies_ns.push_back(now - std::strtoll(event.data() + t + 4, nullptr, 10));
      result_.step_latencies_ns.push_back(now - std::strtoll(event.data() + step + 4, nullptr, 10));
    }
    c.body.erase(0, start);
    return completed;
  }

  void Close(ClientConn& c) {
    close(c.fd);  // Also leaves the epoll set.
    c.closed = true;
  }

  const int port_;
  const int expected_;
  std::vector<ClientConn> conns_;
  std::string request_;
  int epoll_ = -1;
  int64_t start_ns_ = 0;
  ClientResult result_;
};

// ---------------------------------------------------------------------------

struct Row {
  std::string lib;
  int streams = 0;
  std::string mode;
  double events_per_s = 0;
  double p50_us = 0, p99_us = 0;            // Queued to received.
  double step_p50_us = 0, step_p99_us = 0;  // Step began to received.
  int64_t multi_event_reads = 0, reads_with_events = 0;
  double server_cpu_per_m = 0;  // Server process CPU seconds per 1M events.
  double client_cpu_share = 0;  // Client CPU seconds / run seconds.
  double max_first_byte_ms = 0;
  int failures = 0;
};

// Each number's median over repeated runs (the runs' failures summed).
Row MedianRow(const std::vector<Row>& runs) {
  Row out = runs.front();
  auto median = [&runs](auto field) {
    std::vector<double> v;
    for (const Row& r : runs) v.push_back(static_cast<double>(r.*field));
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  out.events_per_s = median(&Row::events_per_s);
  out.p50_us = median(&Row::p50_us);
  out.p99_us = median(&Row::p99_us);
  out.step_p50_us = median(&Row::step_p50_us);
  out.step_p99_us = median(&Row::step_p99_us);
  out.multi_event_reads = static_cast<int64_t>(median(&Row::multi_event_reads));
  out.reads_with_events = static_cast<int64_t>(median(&Row::reads_with_events));
  out.server_cpu_per_m = median(&Row::server_cpu_per_m);
  out.client_cpu_share = median(&Row::client_cpu_share);
  out.max_first_byte_ms = median(&Row::max_first_byte_ms);
  out.failures = 0;
  for (const Row& r : runs) out.failures += r.failures;
  return out;
}

double Percentile(std::vector<int64_t>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * v.size()));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k] / 1e3;
}

// One run: a fresh server process, `streams` streams; interval_us == 0 is
// the flood mode.
Row RunOne(const std::string& lib, int streams, int interval_us, int httplib_threads) {
  const bool paced = interval_us > 0;
  const int events = paced ? absl::GetFlag(FLAGS_events)
                           : std::max(absl::GetFlag(FLAGS_events), absl::GetFlag(FLAGS_flood_events_total) / streams);
  Row row{lib, streams, paced ? absl::StrFormat("paced %d us", interval_us) : "flood"};
  row.failures = streams;

  int report[2], stop[2];
  if (pipe2(report, O_CLOEXEC) != 0 || pipe2(stop, O_CLOEXEC) != 0) return row;
  const pid_t pid = fork();
  if (pid == 0) {
    close(report[0]);
    close(stop[1]);
    ServerMain(lib, int64_t{interval_us} * 1000, httplib_threads, report[1], stop[0]);
  }
  close(report[1]);
  close(stop[0]);
  int port = -1;
  double server_cpu = 0;
  if (read(report[0], &port, sizeof(port)) == sizeof(port) && port > 0) {
    // Lets the server's threads finish starting (cpp-httplib starts its
    // pool in the listening thread), so that startup is not measured.
    usleep(100 * 1000);
    Client client(port, streams, events);
    const double timeout_s = absl::GetFlag(FLAGS_timeout_s) + events * interval_us / 1e6;
    ClientResult r = client.Run(timeout_s);
    [[maybe_unused]] ssize_t w = write(stop[1], "x", 1);
    if (read(report[0], &server_cpu, sizeof(server_cpu)) != sizeof(server_cpu)) {
      int status = 0;
      waitpid(pid, &status, 0);
      std::fprintf(stderr, "%s, %d streams: the server process died (%s %d)\n", lib.c_str(), streams,
                   WIFSIGNALED(status) ? "signal" : "exit status",
                   WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    }
    row.events_per_s = r.seconds > 0 ? r.events / r.seconds : 0;
    row.p50_us = Percentile(r.latencies_ns, 0.50);
    row.p99_us = Percentile(r.latencies_ns, 0.99);
    row.step_p50_us = Percentile(r.step_latencies_ns, 0.50);
    row.step_p99_us = Percentile(r.step_latencies_ns, 0.99);
    row.multi_event_reads = r.multi_event_reads;
    row.reads_with_events = r.reads_with_events;
    row.server_cpu_per_m = r.events > 0 ? server_cpu / r.events * 1e6 : 0;
    row.client_cpu_share = r.seconds > 0 ? r.cpu_s / r.seconds : 0;
    row.max_first_byte_ms = r.max_first_byte_ms;
    row.failures = r.failures;
  } else {
    std::fprintf(stderr, "%s: the server did not start\n", lib.c_str());
  }
  close(stop[1]);
  close(report[0]);
  kill(pid, SIGKILL);  // It has exited by now unless it failed to start.
  waitpid(pid, nullptr, 0);
  return row;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Measures HTTP server libraries serving SSE streams (see the file's comment).");
  absl::ParseCommandLine(argc, argv);
  // Writes to a client that went away must fail, not kill the server.
  signal(SIGPIPE, SIG_IGN);

  const std::vector<std::string> libs = absl::GetFlag(FLAGS_libs);
  for (const std::string& lib : libs) {
    if (!KnownLibrary(lib)) {
      std::fprintf(stderr, "unknown library: %s\n", lib.c_str());
      return 2;
    }
  }
  std::vector<int> stream_counts;
  for (const std::string& s : absl::GetFlag(FLAGS_streams)) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n <= 0) {
      std::fprintf(stderr, "bad --streams value: %s\n", s.c_str());
      return 2;
    }
    stream_counts.push_back(n);
  }
  // The producer steps of the runs per library and stream count; 0 is flood.
  std::vector<int> intervals_us;
  for (const std::string& mode : absl::GetFlag(FLAGS_modes)) {
    if (mode == "flood") {
      intervals_us.push_back(0);
    } else if (mode == "paced") {
      for (const std::string& s : absl::GetFlag(FLAGS_paced_interval_us)) {
        int us = 0;
        if (!absl::SimpleAtoi(s, &us) || us <= 0) {
          std::fprintf(stderr, "bad --paced_interval_us value: %s\n", s.c_str());
          return 2;
        }
        intervals_us.push_back(us);
      }
    } else {
      std::fprintf(stderr, "unknown mode: %s\n", mode.c_str());
      return 2;
    }
  }
  int httplib_threads = absl::GetFlag(FLAGS_httplib_threads);
  if (httplib_threads <= 0) httplib_threads = *std::max_element(stream_counts.begin(), stream_counts.end()) + 8;

  // Before any thread exists: the servers are forked from this process.
  PinToCpu(absl::GetFlag(FLAGS_client_cpu));

  std::string model = "unknown";
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[512];
    while (std::fgets(line, sizeof(line), f)) {
      const char* colon = std::strchr(line, ':');
      if (std::strncmp(line, "model name", 10) == 0 && colon != nullptr) {
        model = std::string(colon + 2, std::strcspn(colon + 2, "\n"));
        break;
      }
    }
    std::fclose(f);
  }
  std::printf("CPU: %s; server on CPU %d, client on CPU %d; libmicrohttpd %s, libevent %s, cpp-httplib %s\n",
              model.c_str(), absl::GetFlag(FLAGS_server_cpu), absl::GetFlag(FLAGS_client_cpu), MHD_get_version(),
              event_get_version(), CPPHTTPLIB_VERSION);
  std::printf("\nLatencies in us, p50/p99: t = from queued, s = from the producer's step. Medians of %d run(s); "
              "failures: failed streams over all runs.\n",
              std::max(1, absl::GetFlag(FLAGS_repeat)));
  std::printf("\n| library | C | mode | events/s | t p50/p99 | s p50/p99 | multi-event reads | "
              "server CPU s/1M ev | client CPU | slowest head ms | failures |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  int total_failures = 0;
  const int repeat = std::max(1, absl::GetFlag(FLAGS_repeat));
  for (const std::string& lib : libs) {
    for (int streams : stream_counts) {
      for (int interval_us : intervals_us) {
        std::vector<Row> runs;
        for (int i = 0; i < repeat; ++i) {
          runs.push_back(RunOne(lib, streams, interval_us, httplib_threads));
        }
        const Row r = MedianRow(runs);
        total_failures += r.failures;
        std::printf("| %s | %d | %s | %.0f | %.0f/%.0f | %.0f/%.0f | %lld/%lld | %.2f | %.0f%% | %.1f | %d |\n",
                    r.lib.c_str(), r.streams, r.mode.c_str(), r.events_per_s, r.p50_us, r.p99_us, r.step_p50_us,
                    r.step_p99_us, static_cast<long long>(r.multi_event_reads),
                    static_cast<long long>(r.reads_with_events),
                    r.server_cpu_per_m, 100 * r.client_cpu_share, r.max_first_byte_ms, r.failures);
        std::fflush(stdout);
      }
    }
  }
  return total_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) { return pdserve::bench::Main(argc, argv); }
