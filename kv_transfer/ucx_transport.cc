#include "kv_transfer/ucx_transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ucs/debug/log_def.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::kv {
namespace {

enum AmId : unsigned { kAmControl = 1, kAmBye = 2, kAmByeAck = 3, kAmHello = 4, kAmData = 5 };

absl::Status UcxError(absl::string_view what, ucs_status_t s) {
  const std::string msg = absl::StrCat("UCX ", what, ": ", ucs_status_string(s));
  switch (s) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_NOT_CONNECTED:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Errors UCX logged in this process, newest last (see RecentErrors).
struct UcxErrorLog {
  static constexpr size_t kKept = 8;
  absl::Mutex mu;
  std::deque<std::string> errors ABSL_GUARDED_BY(mu);
};

UcxErrorLog& ErrorLog() {
  static UcxErrorLog* log = new UcxErrorLog();
  return *log;
}

// A ucs log handler (any UCX thread): keeps errors, lets UCX print them.
ucs_log_func_rc_t KeepUcxError(const char* /*file*/, unsigned /*line*/, const char* /*function*/, ucs_log_level_t level,
                               const ucs_log_component_config_t* /*comp_conf*/, const char* format, va_list ap) {
  if (level > UCS_LOG_LEVEL_ERROR) return UCS_LOG_FUNC_RC_CONTINUE;
  char text[512];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  UcxErrorLog& log = ErrorLog();
  absl::MutexLock lock(&log.mu);
  if (log.errors.size() == UcxErrorLog::kKept) log.errors.pop_front();
  log.errors.push_back(absl::StrCat("UCX: ", text));
  return UCS_LOG_FUNC_RC_CONTINUE;
}

// 36 characters identifying this boot of this machine.
std::string HostId() {
  std::string id(36, '?');
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    const size_t n = std::fread(id.data(), 1, id.size(), f);
    std::fclose(f);
    id.resize(36);
    if (n != 36) id.assign(36, '?');
  }
  return id;
}

// UCX's listing of a context's resources ("... tcp/eth0" lines); UCX has
// no query for which transports and devices it found.
std::string ContextInfo(ucp_context_h context) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  ucp_context_print_info(context, f);
  std::fclose(f);
  std::string info(buf, size);
  std::free(buf);
  return info;
}

// Whether UCX_TLS left a shared-memory transport in the context.
bool HasSharedMemory(const std::string& info) {
  for (const char* tl : {"posix/memory", "sysv/memory", "cma/memory", "xpmem/memory", "knem/memory"}) {
    if (info.find(tl) != std::string::npos) return true;
  }
  return false;
}

absl::StatusOr<sockaddr_in> Address(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("UCX transport: '", host, "' is not an IPv4 address"));
  }
  return a;
}

// Heap state of one UCX request with a completion callback.
struct Op {
  DoneCallback done = nullptr;
  EventLoop* loop = nullptr;
  std::string payload = {};  // Kept alive for sends (the header of data messages).
  std::function<void()> after = nullptr;  // Posted after completion.
};

void Finish(Op* op, ucs_status_t s) {
  op->loop->AddBusy(-1);
  if (op->after) op->loop->Post(std::move(op->after));
  if (op->done) {
    absl::Status st = s == UCS_OK ? absl::OkStatus() : UcxError("operation", s);
    op->loop->Post([done = std::move(op->done), st] { done(st); });
  }
  delete op;
}

void OnSendDone(void* request, ucs_status_t s, void* user) {
  Finish(static_cast<Op*>(user), s);
  ucp_request_free(request);
}

// Issues an nbx call's result: immediate, error, or pending (the loop
// keeps polling while any is pending: not every lane raises events).
void Track(ucs_status_ptr_t r, Op* op) {
  op->loop->AddBusy(1);
  if (r == nullptr) {
    Finish(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    Finish(op, UCS_PTR_STATUS(r));
  }
}

}  // namespace

class UcxTransport::Region final : public KvRegion {
 public:
  Region(UcxTransport* owner, ucp_mem_h memh, void* data, size_t size)
      : owner_(owner), memh_(memh), data_(data), size_(size) {}
  ~Region() override {
    {
      absl::MutexLock lock(&owner_->regions_mu_);
      std::erase(owner_->regions_, this);
    }
    owner_->loop_.RunSync([this] { ucp_mem_unmap(owner_->context_, memh_); });
  }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  ucp_mem_h memh() const { return memh_; }
  // Unsigned and without wrap-around: p and n may come from the wire.
  bool Contains(const void* p, size_t n) const {
    const auto at = reinterpret_cast<uintptr_t>(p);
    const auto base = reinterpret_cast<uintptr_t>(data_);
    return at >= base && at - base <= size_ && n <= size_ - (at - base);
  }

 private:
  UcxTransport* owner_;
  ucp_mem_h memh_;
  void* data_;
  size_t size_;
};

class UcxTransport::Allocator final : public KvRegionAllocator {
 public:
  explicit Allocator(UcxTransport* owner) : owner_(owner) {}
  absl::StatusOr<std::unique_ptr<KvRegion>> Allocate(size_t bytes) override {
    return owner_->loop_.RunSync([&]() -> absl::StatusOr<std::unique_ptr<KvRegion>> {
      ucp_mem_map_params_t p{};
      p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                     UCP_MEM_MAP_PARAM_FIELD_FLAGS;
      p.address = nullptr;
      p.length = bytes;
      p.flags = UCP_MEM_MAP_ALLOCATE;
      ucp_mem_h memh;
      if (ucs_status_t s = ucp_mem_map(owner_->context_, &p, &memh); s != UCS_OK) {
        return absl::ResourceExhaustedError(
            absl::StrCat("UCX: cannot allocate ", bytes, " bytes of registered memory: ", ucs_status_string(s)));
      }
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
      ucp_mem_query(memh, &attr);
      std::memset(attr.address, 0, bytes);
      auto* r = new Region(owner_, memh, attr.address, attr.length);
      absl::MutexLock lock(&owner_->regions_mu_);
      owner_->regions_.push_back(r);
      return std::unique_ptr<KvRegion>(r);
    });
  }

 private:
  UcxTransport* owner_;
};

namespace {

class UcxRemote final : public RemoteRegion {
 public:
  UcxRemote(EventLoop* loop, uint64_t base, ucp_rkey_h rkey) : loop_(loop), base(base), rkey(rkey) {}
  ~UcxRemote() override {
    ucp_rkey_h k = rkey;
    if (k == nullptr) return;  // A descriptor without a remote key.
    if (loop_->InLoop()) {
      ucp_rkey_destroy(k);
    } else {
      loop_->Post([k] { ucp_rkey_destroy(k); });
    }
  }
  EventLoop* loop_;
  uint64_t base;
  ucp_rkey_h rkey;
  // Pages of this process's mapping of the receiver's pool already readied
  // for writes (PageWarmer's thread only): 64 pages a word, by page number.
  absl::flat_hash_map<uint64_t, uint64_t> readied;
};

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it (EINVAL).
#endif

}  // namespace

// A same-host receiver's pool is a shared-memory segment that UCX maps into
// this process when its rkey is unpacked, and the first write to each page
// of that mapping costs far more than the copy (a soft page fault and, in
// a VM, a trap to the hypervisor on the page's first store):
// `pdctl bench-kv` prints a fresh mapping's first copy of a request beside
// a warm one and a readied one. In a cluster every new request writes new
// pages, and its first token gap grew by as much. This thread readies the
// pages a handoff will write while the prompt's forward runs
// (ReadyPagesForWrites, per run of new pages), each page once per
// imported region (connection and pool).
class UcxTransport::PageWarmer {
 public:
  PageWarmer() : thread_([this] { Run(); }) {}
  ~PageWarmer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  // A range of the peer's region: where it lies in this process's mapping,
  // its length, and the page it starts at in the peer's address space.
  struct Range {
    char* local;
    int64_t bytes;
    uint64_t first_page;
  };
  struct Job {
    std::shared_ptr<RemoteRegion> keep;  // Keeps the rkey, so the mapping, alive.
    UcxRemote* remote;
    std::vector<Range> ranges;
  };

  void Add(Job job) {
    absl::MutexLock lock(&mu_);
    jobs_.push_back(std::move(job));
    ++added_;
  }

  int64_t pages() const { return pages_.load(std::memory_order_relaxed); }

  void WaitIdle() {
    absl::MutexLock lock(&mu_);
    const int64_t target = added_;
    while (done_ < target) done_cv_.Wait(&mu_);
  }

 private:
  void Run() {
    for (;;) {
      Job job;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); };
        mu_.Await(absl::Condition(&ready));
        if (stop_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      for (const Range& range : job.ranges) Ready(*job.remote, range);
      job.keep.reset();  // Before counting it done (the rkey's release is posted to the loop).
      absl::MutexLock lock(&mu_);
      ++done_;
      done_cv_.SignalAll();
    }
  }

  // The range's pages not yet readied, in runs.
  void Ready(UcxRemote& r, const Range& range) {
    const uint64_t page = PageBytes();
    const uint64_t first = range.first_page;
    if (range.bytes <= 0) return;
    const uint64_t offset_in_page = reinterpret_cast<uintptr_t>(range.local) % page;
    const uint64_t last = first + (offset_in_page + static_cast<uint64_t>(range.bytes) - 1) / page;
    char* const first_page = range.local - offset_in_page;
    for (uint64_t w = first / 64; w <= last / 64; ++w) {
      uint64_t want = ~uint64_t{0};
      if (w == first / 64) want &= ~uint64_t{0} << (first % 64);
      if (w == last / 64) want &= ~uint64_t{0} >> (63 - last % 64);
      uint64_t& have = r.readied[w];
      uint64_t missing = want & ~have;
      have |= want;
      while (missing != 0) {
        const int b = __builtin_ctzll(missing);
        const uint64_t from_b = missing >> b;
        const int len = ~from_b == 0 ? 64 - b : __builtin_ctzll(~from_b);
        ReadyPagesForWrites(first_page + (w * 64 + b - first) * page, static_cast<size_t>(len));
        pages_.fetch_add(len, std::memory_order_relaxed);
        missing &= len == 64 ? 0 : ~(((uint64_t{1} << len) - 1) << b);
      }
    }
  }

  mutable absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t added_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::CondVar done_cv_;
  std::atomic<int64_t> pages_{0};
  std::thread thread_;
};

struct EpErrorArg {
  EventLoop* loop;
  std::function<void(ucs_status_t)> fn;
};

// How long control messages that arrive before the peer's hello wait for it.
constexpr absl::Duration kHelloWait = absl::Milliseconds(200);

class UcxTransport::Conn final : public Connection {
 public:
  enum class State { kOpen, kClosing, kClosed, kFailed };

  Conn(UcxTransport* owner, ConnectionHandler* handler, std::string name)
      : owner_(owner), handler_(handler), name_(std::move(name)) {}

  void Send(std::string message) override { SendAm(kAmControl, std::move(message)); }

  absl::StatusOr<std::shared_ptr<RemoteRegion>> ImportRegion(absl::string_view packed) override {
    if (packed.size() < sizeof(uint64_t)) return absl::InvalidArgumentError("UCX: bad region descriptor");
    if (state_ != State::kOpen) return Down();
    uint64_t base;
    std::memcpy(&base, packed.data(), sizeof(base));
    // No remote key (the receiver keeps it from peers that are not on its
    // machine): every write goes by message.
    if (packed.size() == sizeof(uint64_t)) return std::shared_ptr<RemoteRegion>(new UcxRemote(&owner_->loop_, base, nullptr));
    ucp_rkey_h rkey;
    if (ucs_status_t s = ucp_ep_rkey_unpack(DataEp(), packed.data() + sizeof(base), &rkey); s != UCS_OK) {
      return UcxError(absl::StrCat("rkey unpack from ", name_), s);
    }
    return std::shared_ptr<RemoteRegion>(new UcxRemote(&owner_->loop_, base, rkey));
  }

  void Put(const void* local, int64_t bytes, RemoteRegion& remote, int64_t remote_offset,
           DoneCallback done) override {
    if (state_ != State::kOpen) {
      owner_->loop_.Post([done = std::move(done), s = Down()] { done(s); });
      return;
    }
    auto& r = static_cast<UcxRemote&>(remote);
    if (data_ep_ == nullptr || r.rkey == nullptr) return SendData(local, bytes, r.base + remote_offset, std::move(done));
    // Tracked even without `done`: a large put goes out in fragments as the
    // worker progresses, so the loop must keep polling until it completes.
    auto* op = new Op{std::move(done), &owner_->loop_, {}};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = OnSendDone;
    p.user_data = op;
    if (ucp_mem_h memh = owner_->FindMemh(local, bytes)) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    Track(ucp_put_nbx(DataEp(), local, bytes, r.base + remote_offset, r.rkey, &p), op);
  }

  void Flush(DoneCallback done) override {
    if (state_ != State::kOpen) {
      owner_->loop_.Post([done = std::move(done), s = Down()] { done(s); });
      return;
    }
    if (data_inflight_ > 0) {
      flush_waiters_.push_back(std::move(done));
      return;
    }
    auto* op = new Op{std::move(done), &owner_->loop_, {}};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = OnSendDone;
    p.user_data = op;
    Track(ucp_ep_flush_nbx(DataEp(), &p), op);
  }

  // Loop thread (the rkey's local pointers are taken here, not on the
  // warmer's thread).
  void PrepareWrites(const std::shared_ptr<RemoteRegion>& remote,
                     const std::vector<std::pair<int64_t, int64_t>>& ranges) override {
    auto* r = static_cast<UcxRemote*>(remote.get());
    if (state_ != State::kOpen || data_ep_ == nullptr || r == nullptr || r->rkey == nullptr) return;
    PageWarmer::Job job{remote, r, {}};
    for (const auto& [offset, bytes] : ranges) {
      void* local;
      if (bytes <= 0 || ucp_rkey_ptr(r->rkey, r->base + offset, &local) != UCS_OK) continue;  // Not mapped here.
      job.ranges.push_back({static_cast<char*>(local), bytes, (r->base + offset) / PageBytes()});
    }
    if (!job.ranges.empty()) owner_->warmer_->Add(std::move(job));
  }

  void Close() override {
    if (state_ != State::kOpen) return;
    state_ = State::kClosing;
    SendAm(kAmBye, {});
    // The peer answers ByeAck; a peer that never does is closed by the
    // transport's destructor.
  }

  bool failed() const override { return state_ == State::kFailed; }
  const std::string& name() const override { return name_; }
  std::string peer_host() const override { return peer_host_; }
  bool PeerMayMapMemory() const override { return owner_->has_shm_ && peer_same_host_; }
  void set_connecting() { connecting_ = true; }
  void set_peer_host(std::string h) { peer_host_ = std::move(h); }

  // Loop thread.
  void OnAm(unsigned id, std::string data) {
    if (id == kAmControl) {
      // Each side says hello before anything else, but UCX can deliver a
      // message sent right after it (while the endpoint was still wiring
      // up) first: measured, a cluster's first reservation then went out
      // without the pool's remote key and its KV over tcp. Control
      // messages wait for the hello, at most kHelloWait (a peer that never
      // says it is taken to be on another machine).
      if (!hello_seen_) {
        if (held_.empty()) {
          held_since_ = absl::Now();
          CheckHeld();
        }
        held_.push_back(std::move(data));
        return;
      }
      Deliver(std::move(data));
    } else if (id == kAmHello) {
      // Each side says hello: the accepting side learns whether the peer
      // shares this machine; the connecting side opens its data endpoint.
      const std::string& host = owner_->host_id_;
      peer_same_host_ = data.size() > host.size() && data.compare(0, host.size(), host) == 0;
      if (connecting_) OpenDataEp(data);
      ReleaseHeld();
    } else if (id == kAmBye) {
      if (state_ != State::kOpen) return;
      SendAm(kAmByeAck, {});
      state_ = State::kClosed;
      if (handler_ != nullptr) handler_->OnDisconnected(*this, absl::OkStatus());
      CloseEp(0);
    } else if (id == kAmByeAck) {
      if (state_ != State::kClosing) return;
      state_ = State::kClosed;
      CloseEp(0);
    }
  }

  void Deliver(std::string data) {
    if (handler_ != nullptr && (state_ == State::kOpen || state_ == State::kClosing)) {
      handler_->OnMessage(*this, std::move(data));
    }
  }

  void ReleaseHeld() {
    hello_seen_ = true;
    std::deque<std::string> held;
    held.swap(held_);
    for (std::string& m : held) Deliver(std::move(m));
  }

  // While messages wait for the hello: gives up on it after kHelloWait
  // (the loop polls meanwhile; the hello normally follows within the
  // same burst).
  void CheckHeld() {
    owner_->loop_.Post([this] {
      if (held_.empty()) return;
      if (absl::Now() - held_since_ >= kHelloWait) {
        ReleaseHeld();
      } else {
        CheckHeld();
      }
    });
  }

  // The data endpoint: to the peer's worker address, without peer error
  // handling, because UCX 1.13 leaves shared-memory lanes out of endpoints
  // with UCP_ERR_HANDLING_MODE_PEER (measured: such an endpoint between two
  // local processes carries puts over tcp at ~0.5 GB/s). Failures are seen
  // on the control endpoint, which has peer error handling; after one, the
  // data endpoint is never used again.
  void OpenDataEp(const std::string& hello) {
    if (data_ep_ != nullptr || state_ != State::kOpen || !owner_->has_shm_) return;
    // Only to a peer on this machine (same boot id): shared memory is the
    // reason for the second endpoint, and two endpoints over tcp between
    // one pair of workers were seen to time each other out.
    const std::string& host = owner_->host_id_;
    if (hello.size() <= host.size() || hello.compare(0, host.size(), host) != 0) return;
    const std::string address = hello.substr(host.size());
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = reinterpret_cast<const ucp_address_t*>(address.data());
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    if (ucp_ep_create(owner_->worker_, &p, &data_ep_) != UCS_OK) data_ep_ = nullptr;
  }

  void SendHello(const std::string& address) { SendAm(kAmHello, address); }

  // Without a shared-memory data endpoint (tcp), a Put is an active message
  // whose header names the destination address and whose payload the
  // receiver fetches by rendezvous straight into its registered pool:
  // ucx_perftest here moved 2 MiB AMs over tcp at ~4.8 GB/s against ~1.4
  // GB/s for (emulated) puts. A send completes only after the receiver has
  // the data, so Flush waits for the outstanding ones, then flushes.
  void SendData(const void* local, int64_t bytes, uint64_t remote_address, DoneCallback done) {
    ++data_inflight_;
    auto* op = new Op{std::move(done), &owner_->loop_,
                      std::string(reinterpret_cast<const char*>(&remote_address), sizeof(remote_address)),
                      [this] { OnDataDone(); }};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = OnSendDone;
    p.user_data = op;
    // The reply endpoint tells the receiver which connection writes.
    p.flags = UCP_AM_SEND_FLAG_REPLY | (bytes >= (64 << 10) ? UCP_AM_SEND_FLAG_RNDV : 0);
    if (ucp_mem_h memh = owner_->FindMemh(local, bytes)) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    Track(ucp_am_send_nbx(ep_, kAmData, op->payload.data(), op->payload.size(), local, bytes, &p), op);
  }

  void OnDataDone() {
    if (--data_inflight_ > 0 || flush_waiters_.empty()) return;
    std::vector<DoneCallback> waiters;
    waiters.swap(flush_waiters_);
    for (DoneCallback& w : waiters) Flush(std::move(w));
  }

  // No more callbacks to the handler; closes gracefully.
  void Detach() {
    handler_ = nullptr;
    Close();
  }

  void Fail(absl::Status why) override {
    if (state_ == State::kFailed) return;
    const bool report = state_ == State::kOpen;
    state_ = State::kFailed;
    error_ = absl::UnavailableError(absl::StrCat("connection ", name_, ": ", why.message()));
    if (report && handler_ != nullptr) handler_->OnDisconnected(*this, error_);
    CloseEp(UCP_EP_CLOSE_FLAG_FORCE);
  }

  void OnError(ucs_status_t s) {
    if (state_ == State::kFailed) return;
    const bool report = state_ == State::kOpen;
    state_ = State::kFailed;
    error_ = UcxError(absl::StrCat("connection ", name_), s);
    if (report && handler_ != nullptr) handler_->OnDisconnected(*this, error_);
    CloseEp(UCP_EP_CLOSE_FLAG_FORCE);
  }

  // Closes the endpoint (flushing unless forced); `closing_` tracks it.
  void CloseEp(uint32_t flags) {
    if (ep_ == nullptr || ep_closed_) return;
    ep_closed_ = true;
    owner_->by_ep_.erase(ep_);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = flags;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep_, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) close_request_ = r;
    // A data endpoint to a dead peer is left to ucp_worker_destroy: a
    // flushing close could wait forever and a forced one needs peer error
    // handling on both sides.
    if (data_ep_ != nullptr && state_ != State::kFailed) {
      ucp_request_param_t dp{};
      ucs_status_ptr_t dr = ucp_ep_close_nbx(data_ep_, &dp);
      if (dr != nullptr && !UCS_PTR_IS_ERR(dr)) data_close_request_ = dr;
      data_ep_ = nullptr;
    }
  }

  // Destructor-time: force close and wait (bounded) for it.
  void Shutdown() {
    if (!ep_closed_) {
      state_ = State::kClosed;
      CloseEp(UCP_EP_CLOSE_FLAG_FORCE);
    }
    if (close_request_ != nullptr) {
      for (int i = 0; i < 100000 && ucp_request_check_status(close_request_) == UCS_INPROGRESS; ++i) {
        ucp_worker_progress(owner_->worker_);
      }
      ucp_request_free(close_request_);
      close_request_ = nullptr;
    }
    if (data_close_request_ != nullptr) {
      for (int i = 0; i < 100000 && ucp_request_check_status(data_close_request_) == UCS_INPROGRESS; ++i) {
        ucp_worker_progress(owner_->worker_);
      }
      ucp_request_free(data_close_request_);
      data_close_request_ = nullptr;
    }
  }

  ucp_ep_h ep_ = nullptr;
  ucp_ep_h data_ep_ = nullptr;
  std::unique_ptr<EpErrorArg> err_arg_;
  ConnectionHandler* handler() const { return handler_; }
  ucp_ep_h DataEp() const { return data_ep_ != nullptr ? data_ep_ : ep_; }

 private:
  absl::Status Down() const {
    return error_.ok() ? absl::UnavailableError(absl::StrCat("UCX connection ", name_, " is closed")) : error_;
  }

  void SendAm(unsigned id, std::string data) {
    if (ep_ == nullptr || ep_closed_) return;
    auto* op = new Op{nullptr, &owner_->loop_, std::move(data)};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = OnSendDone;
    p.user_data = op;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    Track(ucp_am_send_nbx(ep_, id, nullptr, 0, op->payload.data(), op->payload.size(), &p), op);
  }

  UcxTransport* owner_;
  ConnectionHandler* handler_;
  std::string name_;
  std::string peer_host_;  // Accepted connections: the client's IP.
  bool peer_same_host_ = false;  // Its hello named this machine.
  bool hello_seen_ = false;      // Its hello came (or kHelloWait passed without).
  std::deque<std::string> held_;  // Control messages that came before the hello.
  absl::Time held_since_;
  bool connecting_ = false;      // This side connected (it opens the data endpoint).
  State state_ = State::kOpen;
  absl::Status error_;
  bool ep_closed_ = false;
  void* close_request_ = nullptr;
  void* data_close_request_ = nullptr;
  int64_t data_inflight_ = 0;
  std::vector<DoneCallback> flush_waiters_;
};

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(const Options& options) {
  // Before ucp_init: it logs what it cannot read (e.g. /sys/class/net).
  static std::once_flag log_handler_pushed;
  std::call_once(log_handler_pushed, [] { ucs_log_push_handler(KeepUcxError); });
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  ucp_config_t* config;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return UcxError("config read", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = options.name.c_str();
  ucs_status_t s = ucp_init(&params, config, &t->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return UcxError("init", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (s = ucp_worker_create(t->context_, &wp, &t->worker_); s != UCS_OK) {
    ucp_cleanup(t->context_);
    t->context_ = nullptr;
    return UcxError("worker create", s);
  }
  if (s = ucp_worker_get_efd(t->worker_, &t->efd_); s != UCS_OK) return UcxError("worker event fd", s);
  ucp_address_t* address;
  size_t address_length;
  if (s = ucp_worker_get_address(t->worker_, &address, &address_length); s != UCS_OK) {
    return UcxError("worker address", s);
  }
  t->worker_address_.assign(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(t->worker_, address);
  t->host_id_ = HostId();
  t->context_info_ = ContextInfo(t->context_);
  t->has_shm_ = HasSharedMemory(t->context_info_);
  for (unsigned id : {kAmControl, kAmBye, kAmByeAck, kAmHello, kAmData}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = OnAm;
    hp.arg = reinterpret_cast<void*>(static_cast<uintptr_t>(id) | reinterpret_cast<uintptr_t>(t.get()) << 3);
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    if (s = ucp_worker_set_am_recv_handler(t->worker_, &hp); s != UCS_OK) return UcxError("AM handler", s);
  }
  t->allocator_ = std::make_unique<Allocator>(t.get());
  t->warmer_ = std::make_unique<PageWarmer>();
  ucp_worker_h w = t->worker_;
  t->loop_.Start(options.name, EventLoop::Device{
                                   .progress = [w] { return ucp_worker_progress(w) != 0; },
                                   .arm = [w] { return ucp_worker_arm(w) == UCS_OK; },
                                   .fd = t->efd_,
                               },
                 {.realtime = options.realtime_loop});
  return t;
}

UcxTransport::~UcxTransport() {
  if (worker_ == nullptr) {
    if (context_ != nullptr) ucp_cleanup(context_);
    return;
  }
  warmer_.reset();  // Its jobs hold remote regions, whose release runs on the loop.
  loop_.RunSync([this] {
    for (auto& l : listeners_) ucp_listener_destroy(l->listener);
    listeners_.clear();
    for (auto& c : conns_) c->Shutdown();
  });
  loop_.Stop();
  conns_.clear();
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

ucs_status_t UcxTransport::OnAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
  const auto bits = reinterpret_cast<uintptr_t>(arg);
  auto* self = reinterpret_cast<UcxTransport*>(bits >> 3);
  const unsigned id = static_cast<unsigned>(bits & 7);
  if (id == kAmData) return self->OnData(header, header_length, data, length, param);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    return UCS_OK;  // Never sent by us: control messages are eager with a reply ep.
  }
  std::string bytes(static_cast<const char*>(data), length);
  ucp_ep_h ep = param->reply_ep;
  self->loop_.Post([self, ep, id, bytes = std::move(bytes)]() mutable {
    auto it = self->by_ep_.find(ep);
    if (it != self->by_ep_.end()) it->second->OnAm(id, std::move(bytes));
  });
  return UCS_OK;
}

ucp_ep_h UcxTransport::EndpointOf(Connection* c) { return static_cast<Conn*>(c)->ep_; }

std::string UcxTransport::Describe(Connection* c) {
  return loop_.RunSync([&] {
    auto* conn = static_cast<Conn*>(c);
    if (conn->ep_ == nullptr) return std::string("(no endpoint)");
    char* buf = nullptr;
    size_t size = 0;
    FILE* f = open_memstream(&buf, &size);
    std::fputs("control endpoint:\n", f);
    ucp_ep_print_info(conn->ep_, f);
    if (conn->data_ep_ != nullptr) {
      std::fputs("data endpoint:\n", f);
      ucp_ep_print_info(conn->data_ep_, f);
    }
    std::fclose(f);
    std::string out(buf, size);
    std::free(buf);
    return out;
  });
}

void UcxTransport::Detach(ConnectionHandler* handler) {
  loop_.RunSync([&] {
    for (auto it = listeners_.begin(); it != listeners_.end();) {
      if ((*it)->handler == handler) {
        ucp_listener_destroy((*it)->listener);
        it = listeners_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& c : conns_) {
      if (c->handler() == handler) c->Detach();
    }
  });
}

KvRegionAllocator& UcxTransport::region_allocator() { return *allocator_; }

absl::StatusOr<std::string> UcxTransport::ConnectableHost() const {
  ifaddrs* addrs = nullptr;
  if (getifaddrs(&addrs) != 0) return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  std::string found;
  for (ifaddrs* a = addrs; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (context_info_.find(absl::StrCat(" tcp/", a->ifa_name, "\n")) == std::string::npos) continue;
    char host[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, host, sizeof(host));
    const bool loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
    if (found.empty() || loopback) found = host;
    if (loopback) break;
  }
  freeifaddrs(addrs);
  if (!found.empty()) return found;
  std::string message = "UCX found no network device with an IPv4 address to set up connections over (tcp)";
  if (const std::string log = RecentErrors(); !log.empty()) absl::StrAppend(&message, " (", log, ")");
  return absl::FailedPreconditionError(message);
}

std::string UcxTransport::RecentErrors() const {
  UcxErrorLog& log = ErrorLog();
  absl::MutexLock lock(&log.mu);
  return absl::StrJoin(log.errors, "; ");
}

ucs_status_t UcxTransport::OnData(const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param) {
  uint64_t address;
  if (header_length != sizeof(address)) return UCS_OK;
  std::memcpy(&address, header, sizeof(address));
  void* dst = reinterpret_cast<void*>(address);
  // Only into this transport's registered regions (what an rkey allows),
  // and only where the connection's handler allows (the KV receiver: the
  // blocks of that connection's live reservations). On the loop thread.
  const ucp_mem_h memh = FindMemh(dst, length);
  if (memh == nullptr) return UCS_OK;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  auto it = by_ep_.find(param->reply_ep);
  if (it == by_ep_.end() || it->second->handler() == nullptr ||
      !it->second->handler()->MayWrite(*it->second, dst, length)) {
    return UCS_OK;
  }
  Conn* conn = it->second;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // The bytes land when the receive completes, turns of the loop later:
    // the handler hears of it then (WriteLanded), so it keeps the blocks
    // until they have.
    auto* landing = new Landing{conn, dst, length};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.memh = memh;
    p.cb.recv_am = OnDataLanded;
    p.user_data = landing;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, data, dst, length, &p);
    // Done at once (or never will be); else the callback frees the
    // request (freed earlier, UCX would never call it).
    if (r == nullptr || UCS_PTR_IS_ERR(r)) OnDataLanded(nullptr, UCS_OK, 0, landing);
    return UCS_OK;
  }
  std::memcpy(dst, data, length);
  if (ConnectionHandler* h = conn->handler()) h->WriteLanded(*conn, dst, length);
  return UCS_OK;
}

void UcxTransport::OnDataLanded(void* request, ucs_status_t status, size_t length, void* user) {
  (void)status;
  (void)length;
  if (request != nullptr) ucp_request_free(request);
  std::unique_ptr<Landing> landing(static_cast<Landing*>(user));
  if (ConnectionHandler* h = landing->conn->handler()) h->WriteLanded(*landing->conn, landing->dst, landing->bytes);
}

int64_t UcxTransport::pages_prepared() const { return warmer_ == nullptr ? 0 : warmer_->pages(); }

void UcxTransport::WaitForPreparedWrites() {
  if (warmer_ != nullptr) warmer_->WaitIdle();
}

ucp_mem_h UcxTransport::FindMemh(const void* p, size_t n) const {
  absl::MutexLock lock(&regions_mu_);
  for (Region* r : regions_) {
    if (r->Contains(p, n)) return r->memh();
  }
  return nullptr;
}

absl::StatusOr<std::string> UcxTransport::PackRegion(KvRegion& region) {
  auto* r = dynamic_cast<Region*>(&region);
  if (r == nullptr) return absl::InvalidArgumentError("UCX: region was not allocated by this transport");
  return loop_.RunSync([&]() -> absl::StatusOr<std::string> {
    void* buf;
    size_t size;
    if (ucs_status_t s = ucp_rkey_pack(context_, r->memh(), &buf, &size); s != UCS_OK) {
      return UcxError("rkey pack", s);
    }
    const uint64_t base = reinterpret_cast<uint64_t>(r->data());
    std::string out(reinterpret_cast<const char*>(&base), sizeof(base));
    out.append(static_cast<const char*>(buf), size);
    ucp_rkey_buffer_release(buf);
    return out;
  });
}

UcxTransport::Conn* UcxTransport::AddConn(ConnectionHandler* handler, std::string name) {
  conns_.push_back(std::make_unique<Conn>(this, handler, std::move(name)));
  return conns_.back().get();
}

namespace {
void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* a = static_cast<EpErrorArg*>(arg);
  a->loop->Post([a, status] { a->fn(status); });
}
}  // namespace

void UcxTransport::OnConnRequest(ucp_conn_request_h request, void* arg) {
  auto* l = static_cast<Listener*>(arg);
  UcxTransport* self = l->owner;
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "peer";
  std::string peer_host;
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    char host[INET6_ADDRSTRLEN] = {};
    auto* in = reinterpret_cast<sockaddr_in*>(&attr.client_address);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    peer_host = host;
    peer = absl::StrCat(host, ":", ntohs(in->sin_port));
  }
  Conn* c = self->AddConn(l->handler, absl::StrCat("<-", peer));
  c->set_peer_host(std::move(peer_host));
  c->err_arg_.reset(new EpErrorArg{&self->loop_, [c](ucs_status_t s) { c->OnError(s); }});
  EpErrorArg* err = c->err_arg_.get();
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = OnEpError;
  ep.err_handler.arg = err;
  if (ucp_ep_create(self->worker_, &ep, &c->ep_) != UCS_OK) {
    c->ep_ = nullptr;
    return;
  }
  self->by_ep_[c->ep_] = c;
  c->SendHello(self->host_id_ + self->worker_address_);
}

absl::StatusOr<int> UcxTransport::Listen(const std::string& host, int port, ConnectionHandler* handler) {
  absl::StatusOr<sockaddr_in> addr = Address(host, port);
  if (!addr.ok()) return addr.status();
  return loop_.RunSync([&]() -> absl::StatusOr<int> {
    auto l = std::make_unique<Listener>();
    l->handler = handler;
    l->owner = this;
    ucp_listener_params_t p{};
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*addr);
    p.sockaddr.addrlen = sizeof(*addr);
    p.conn_handler.cb = OnConnRequest;
    p.conn_handler.arg = l.get();
    if (ucs_status_t s = ucp_listener_create(worker_, &p, &l->listener); s != UCS_OK) {
      return UcxError(absl::StrCat("listen on ", host, ":", port, " (UCX_TLS needs tcp for sockaddr setup)"), s);
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucs_status_t s = ucp_listener_query(l->listener, &attr); s != UCS_OK) {
      return UcxError("listener query", s);
    }
    const int bound = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
    listeners_.push_back(std::move(l));
    return bound;
  });
}

absl::StatusOr<Connection*> UcxTransport::Connect(const std::string& host, int port, ConnectionHandler* handler) {
  absl::StatusOr<sockaddr_in> addr = Address(host, port);
  if (!addr.ok()) return addr.status();
  return loop_.RunSync([&]() -> absl::StatusOr<Connection*> {
    Conn* c = AddConn(handler, absl::StrCat(host, ":", port));
    c->err_arg_.reset(new EpErrorArg{&loop_, [c](ucs_status_t s) { c->OnError(s); }});
    EpErrorArg* err = c->err_arg_.get();
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*addr);
    ep.sockaddr.addrlen = sizeof(*addr);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = OnEpError;
    ep.err_handler.arg = err;
    if (ucs_status_t s = ucp_ep_create(worker_, &ep, &c->ep_); s != UCS_OK) {
      c->ep_ = nullptr;
      return UcxError(absl::StrCat("connect to ", host, ":", port), s);
    }
    by_ep_[c->ep_] = c;
    c->set_connecting();
    c->SendHello(host_id_ + worker_address_);  // Before anything else on the endpoint.
    return static_cast<Connection*>(c);
  });
}

}  // namespace pdserve::kv
