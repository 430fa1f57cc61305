#include "kv_transfer/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <emmintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kv_transfer/pages.h"

namespace pdserve::kv {
namespace {

static_assert(std::endian::native == std::endian::little, "the wire format is the host's little-endian layout");

enum FrameType : uint32_t { kMessage = 1, kData = 2, kFlush = 3, kFlushAck = 4, kBye = 5, kByeAck = 6 };
constexpr size_t kControlHeaderBytes = 8;   // u32 type, u32 length.
constexpr size_t kDataHeaderBytes = 24;     // u32 type, u32 0, u64 address, u64 length.
constexpr uint64_t kListenerBit = uint64_t{1} << 63;
constexpr int kMaxEvents = 64;
// Bytes read from one connection per turn of the loop, so one busy peer
// cannot keep the loop from the others and from its posted tasks (epoll is
// level-triggered: the rest is read on the next turn).
constexpr size_t kReadBudget = size_t{8} << 20;
constexpr size_t kScratchBytes = size_t{256} << 10;
// While a permitted payload is arriving, the loop asks to be woken only
// once this much of it (or all that is left of it) is queued. Left at one
// byte, the reader drains the socket as fast as the sender fills it, and
// sleeps and wakes once per segment or two: in `pdctl bench-kv` on a
// 2-vCPU VM those wake-ups, not the copies, kept the frames behind UCX's
// tcp transport (the comparison as it stands: docs/performance.md). The
// kernel still wakes the reader at once on the peer's close or an error.
constexpr int kPayloadWakeBytes = 256 << 10;
constexpr int kMaxIov = 64;

uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void PutU32(char* p, uint32_t v) { std::memcpy(p, &v, sizeof(v)); }
void PutU64(char* p, uint64_t v) { std::memcpy(p, &v, sizeof(v)); }

std::string ErrnoText(int e) {
  char buf[128];
  return strerror_r(e, buf, sizeof(buf));  // GNU: returns the message.
}

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

absl::StatusOr<SocketAddress> ParseAddress(std::string host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("TCP transport: port ", port, " of ", host, " is out of range"));
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  SocketAddress a;
  auto* in4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (inet_pton(AF_INET, host.c_str(), &in4->sin_addr) == 1) {
    in4->sin_family = AF_INET;
    in4->sin_port = htons(static_cast<uint16_t>(port));
    a.length = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, host.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(static_cast<uint16_t>(port));
    a.length = sizeof(sockaddr_in6);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("TCP transport: '", host, "' is not an IPv4 or IPv6 address literal"));
  }
  return a;
}

// An address's host as text; an IPv4 client of a dual-stack listener
// (::ffff:a.b.c.d) as plain IPv4, as grants name it.
std::string HostOf(const sockaddr_storage& s) {
  char text[INET6_ADDRSTRLEN] = {};
  if (s.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&s)->sin_addr, text, sizeof(text));
  } else if (s.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      inet_ntop(AF_INET, &a.s6_addr[12], text, sizeof(text));
    } else {
      inet_ntop(AF_INET6, &a, text, sizeof(text));
    }
  }
  return text;
}

int PortOf(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&s)->sin_port);
  if (s.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&s)->sin6_port);
  return 0;
}

std::string HostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos && host.front() != '['
             ? absl::StrCat("[", host, "]:", port)
             : absl::StrCat(host, ":", port);
}

// A non-blocking stream socket of `addr`'s family; `where` names it in the
// error.
absl::StatusOr<int> OpenSocket(const SocketAddress& addr, const std::string& where) {
  const int fd = socket(addr.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("TCP transport: socket for ", where, ": ", ErrnoText(errno)));
  }
  return fd;
}

void SetNoDelay(int fd) {
  const int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// A peer's region: written by data frames; or, where the peer's process
// is one this process may write (pid != 0), into a mapping of its pool's
// memory file (`mapped`) or by process_vm_writev.
class TcpRemote final : public RemoteRegion {
 public:
  explicit TcpRemote(uint64_t base, uint64_t size = 0, pid_t pid = 0) : base(base), size(size), pid(pid) {}
  ~TcpRemote() override {
    if (warmer_.joinable()) {
      stop_ = true;
      warmer_.join();
    }
    if (mapped != nullptr) munmap(mapped, size);
  }
  // Maps the whole region writable, and readies its pages in the
  // background: a page's first write through a fresh mapping faults (and,
  // in a VM, traps to the hypervisor), ~10x the copy.
  void Map(char* at) {
    mapped = at;
    warmer_ = std::thread([this] {
      // Readying pages is background work, and it runs for seconds over a
      // large pool: in the idle class it never keeps a transport loop or
      // a caller waiting for a handoff's answer off the core for a tick.
      sched_param idle{};
      (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
      constexpr size_t kChunk = size_t{64} << 20;
      for (uint64_t off = 0; off < size && !stop_.load(std::memory_order_relaxed); off += kChunk) {
        ReadyPagesForWrites(mapped + off, (std::min<uint64_t>(kChunk, size - off) + PageBytes() - 1) / PageBytes());
      }
    });
  }
  uint64_t base;
  uint64_t size;
  pid_t pid;
  char* mapped = nullptr;

 private:
  std::atomic<bool> stop_{false};
  std::thread warmer_;
};

// Copies into another process's memory with non-temporal stores: the
// bytes are for the peer's cores to read, not this one's, and stores that
// bypass the cache skip reading each line in first (the ordinary copy's
// cost at these sizes). Below a few pages, an ordinary memcpy.
void CopyToPeer(char* dst, const char* src, size_t n) {
  constexpr size_t kStreamFrom = size_t{64} << 10;
  if (n < kStreamFrom) {
    std::memcpy(dst, src, n);
    return;
  }
  const size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // Ordered before whatever this thread sends next.
}

// The descriptor PackRegion gives a same-host peer: the base address, then
// what lets that peer write the region directly (see "Same host" in the
// header): size, pid, where the nonce lies in this process, the nonce, and
// the region's memory file (descriptor number in this process, inode;
// ~0: none).
constexpr size_t kBaseBytes = 8;
constexpr size_t kNonceBytes = 16;
constexpr size_t kDirectBytes = kBaseBytes + 8 + 8 + 8 + kNonceBytes + 8 + 8;
constexpr uint64_t kNoFile = ~uint64_t{0};

// Zeroed memory in a file of its own (memfd), mapped shared: the pool a
// same-host peer maps and writes with memcpy.
class SharedRegion final : public KvRegion {
 public:
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(size_t bytes) {
    const size_t page = PageBytes();
    const size_t rounded = (bytes + page - 1) / page * page;
    const int fd = memfd_create("pdserve-kv", MFD_CLOEXEC);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("memfd_create: ", std::strerror(errno)));
    struct stat st {};
    void* p = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(rounded)) == 0 && fstat(fd, &st) == 0) {
      p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (p == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache: cannot map ", rounded, " bytes of shared memory: ", std::strerror(err)));
    }
    // Huge pages where the machine lets shared memory have them
    // (transparent_hugepage/shmem_enabled: advise or always).
    (void)madvise(p, rounded, MADV_HUGEPAGE);
    return std::unique_ptr<SharedRegion>(new SharedRegion(p, rounded, fd, st.st_ino));
  }
  ~SharedRegion() override {
    munmap(p_, size_);
    close(fd_);
  }
  void* data() override { return p_; }
  size_t size() const override { return size_; }
  int fd() const { return fd_; }
  uint64_t inode() const { return inode_; }

 private:
  SharedRegion(void* p, size_t size, int fd, uint64_t inode) : p_(p), size_(size), fd_(fd), inode_(inode) {}
  void* p_;
  size_t size_;
  int fd_;
  uint64_t inode_;
};

bool IsLoopback(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(&s)->sin_addr.s_addr) >> 24) == 127;
  }
  if (s.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&s)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

// Whether an accepted connection comes from this host's own network stack:
// from a loopback address, or from the very address it reached (a peer on
// another host, or in another network namespace, has an address of its
// own). Decided from the kernel's view of the socket, never from what the
// peer says.
bool FromThisHost(int fd, const sockaddr_storage& peer) {
  if (IsLoopback(peer)) return true;
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return false;
  return HostOf(local) == HostOf(peer);
}

}  // namespace

class TcpTransport::Region final : public KvRegion {
 public:
  Region(TcpTransport* owner, std::unique_ptr<KvRegion> memory) : owner_(owner), memory_(std::move(memory)) {
    absl::MutexLock lock(&owner_->regions_mu_);
    owner_->regions_.push_back(this);
  }
  ~Region() override {
    absl::MutexLock lock(&owner_->regions_mu_);
    std::erase(owner_->regions_, this);
  }
  void* data() override { return memory_->data(); }
  size_t size() const override { return memory_->size(); }
  const TcpTransport* owner() const { return owner_; }
  // Its memory file, when it is one (direct writes on).
  const SharedRegion* shared() const { return dynamic_cast<const SharedRegion*>(memory_.get()); }

 private:
  TcpTransport* owner_;
  std::unique_ptr<KvRegion> memory_;
};

class TcpTransport::Allocator final : public KvRegionAllocator {
 public:
  explicit Allocator(TcpTransport* owner) : owner_(owner) {}
  // A memory file when same-host peers may write directly (they map it),
  // else (or when that fails) ordinary host memory.
  absl::StatusOr<std::unique_ptr<KvRegion>> Allocate(size_t bytes) override {
    if (owner_->direct_writes_) {
      absl::StatusOr<std::unique_ptr<SharedRegion>> shared = SharedRegion::Create(bytes);
      if (shared.ok()) return std::unique_ptr<KvRegion>(new Region(owner_, *std::move(shared)));
    }
    absl::StatusOr<std::unique_ptr<KvRegion>> memory = host_.Allocate(bytes);
    if (!memory.ok()) return memory.status();
    return std::unique_ptr<KvRegion>(new Region(owner_, *std::move(memory)));
  }

 private:
  TcpTransport* owner_;
  HostKvRegionAllocator host_;
};

class TcpTransport::Conn final : public Connection {
 public:
  Conn(TcpTransport* owner, uint64_t id, int fd, ConnectionHandler* handler, std::string name,
       std::string peer_host, bool connected, bool outbound, bool same_host = false)
      : owner_(owner),
        id_(id),
        fd_(fd),
        handler_(handler),
        name_(std::move(name)),
        peer_host_(std::move(peer_host)),
        connected_(connected),
        outbound_(outbound),
        same_host_(same_host) {}
  ~Conn() override {
    if (fd_ >= 0) close(fd_);
  }

  void Send(std::string message) override {
    if (state_ != State::kOpen) return;
    if (message.size() > kMaxMessageBytes) {
      Fail(absl::InvalidArgumentError(absl::StrCat("TCP connection ", name_, ": a message of ", message.size(),
                                                   " bytes exceeds the limit of ", kMaxMessageBytes)));
      return;
    }
    Out& o = out_.emplace_back();
    PutU32(o.header, kMessage);
    PutU32(o.header + 4, static_cast<uint32_t>(message.size()));
    o.header_bytes = kControlHeaderBytes;
    o.owned = std::move(message);
    o.payload_bytes = o.owned.size();
    WriteSome();
  }

  absl::StatusOr<std::shared_ptr<RemoteRegion>> ImportRegion(absl::string_view packed) override {
    if (packed.size() != kBaseBytes && packed.size() != kDirectBytes) {
      return absl::InvalidArgumentError(absl::StrCat("TCP connection ", name_, ": a region descriptor of ",
                                                     packed.size(), " bytes (want 8: the base address, or ",
                                                     kDirectBytes, ")"));
    }
    const uint64_t base = GetU64(packed.data());
    if (packed.size() == kDirectBytes) {
      const uint64_t size = GetU64(packed.data() + 8);
      const auto pid = static_cast<pid_t>(GetU64(packed.data() + 16));
      const uint64_t nonce_at = GetU64(packed.data() + 24);
      // The pid is the peer's, in its pid namespace: the process it names
      // here is the peer only if it holds the peer's nonce where the peer
      // said. Otherwise (or without the right to write it) by frames.
      char nonce[kNonceBytes];
      iovec mine{nonce, sizeof(nonce)};
      iovec theirs{reinterpret_cast<void*>(static_cast<uintptr_t>(nonce_at)), sizeof(nonce)};
      if (pid > 0 && process_vm_readv(pid, &mine, 1, &theirs, 1, 0) == static_cast<ssize_t>(sizeof(nonce)) &&
          std::memcmp(nonce, packed.data() + 32, sizeof(nonce)) == 0) {
        auto remote = std::make_shared<TcpRemote>(base, size, pid);
        // Its memory file, where it has one and this process may open it
        // (the same ptrace rule); the inode tells it is the region's.
        const uint64_t fd = GetU64(packed.data() + 48), inode = GetU64(packed.data() + 56);
        if (fd != kNoFile) {
          const int mine_fd = open(absl::StrCat("/proc/", pid, "/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
          struct stat st {};
          if (mine_fd >= 0 && fstat(mine_fd, &st) == 0 && static_cast<uint64_t>(st.st_ino) == inode &&
              static_cast<uint64_t>(st.st_size) >= size) {
            void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, mine_fd, 0);
            if (p != MAP_FAILED) remote->Map(static_cast<char*>(p));
          }
          if (mine_fd >= 0) close(mine_fd);
        }
        return std::shared_ptr<RemoteRegion>(std::move(remote));
      }
    }
    return std::shared_ptr<RemoteRegion>(new TcpRemote(base));
  }

  void Put(const void* local, int64_t bytes, RemoteRegion& remote, int64_t remote_offset,
           DoneCallback done) override {
    if (state_ != State::kOpen) return Complete(std::move(done), Down());
    if (bytes < 0) {
      return Complete(std::move(done), absl::InvalidArgumentError(absl::StrCat(
                                           "TCP connection ", name_, ": a put of ", bytes, " bytes")));
    }
    if (bytes == 0) return Complete(std::move(done), absl::OkStatus());
    auto& r = static_cast<TcpRemote&>(remote);
    if (r.pid != 0) return Complete(std::move(done), WriteDirect(local, bytes, r, remote_offset));
    Out& o = out_.emplace_back();
    PutU32(o.header, kData);
    PutU32(o.header + 4, 0);
    // Unsigned: the receiver checks the sum, whatever it is.
    PutU64(o.header + 8, static_cast<TcpRemote&>(remote).base + static_cast<uint64_t>(remote_offset));
    PutU64(o.header + 16, static_cast<uint64_t>(bytes));
    o.header_bytes = kDataHeaderBytes;
    o.borrowed = static_cast<const char*>(local);
    o.payload_bytes = static_cast<size_t>(bytes);
    o.done = std::move(done);
    WriteSome();
  }

  // Data frames and messages share one stream, read in order, and a direct
  // write is copied before Put returns.
  bool MessagesFollowPuts() const override { return true; }

  void Flush(DoneCallback done) override {
    if (state_ != State::kOpen) return Complete(std::move(done), Down());
    flushes_.push_back(std::move(done));
    QueueControl(kFlush);
  }

  void Close() override {
    if (state_ != State::kOpen) return;
    state_ = State::kClosing;
    QueueControl(kBye);
  }

  void Fail(absl::Status why) override {
    failed_ = true;
    if (why.ok()) why = absl::UnavailableError(absl::StrCat("TCP connection ", name_, " failed"));
    Finish(std::move(why));
  }

  bool failed() const override { return failed_; }
  const std::string& name() const override { return name_; }
  std::string peer_host() const override { return peer_host_; }
  bool PeerMayMapMemory() const override { return same_host_; }

  uint64_t id() const { return id_; }
  int fd() const { return fd_; }
  ConnectionHandler* handler() const { return handler_; }
  bool outbound() const { return outbound_; }

  // Loop thread, from here on.

  void OnEvents(uint32_t events) {
    if (state_ == State::kDone) return;
    if (!connected_) {
      if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) == 0) return;
      int err = 0;
      socklen_t len = sizeof(err);
      if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) return FailConnect(err);
      connected_ = true;
      UpdateInterest();
    }
    if ((events & (EPOLLIN | EPOLLERR | EPOLLHUP)) != 0 && Reading()) ReadSome();
    if (state_ != State::kDone && !out_.empty()) WriteSome();
  }

  // A connect that failed at once or later.
  void FailConnect(int err) {
    Finish(absl::UnavailableError(absl::StrCat("TCP transport: connect to ", name_, ": ", ErrnoText(err))));
  }

  // No callback reaches the handler after this; closes gracefully. A
  // write landing for it ends here (its remaining bytes are dropped).
  void Detach() {
    if (read_ == Read::kPayload) {
      read_ = Read::kDiscard;
      if (handler_ != nullptr) handler_->WriteLanded(*this, payload_dst_, payload_bytes_);
    }
    handler_ = nullptr;
    Close();
  }

  // A Put into a same-host peer's region, copied into its process at once:
  // visible there before anything sent after it.
  absl::Status WriteDirect(const void* local, int64_t bytes, const TcpRemote& r, int64_t offset) {
    const auto n = static_cast<uint64_t>(bytes);
    if (offset < 0 || n > r.size || static_cast<uint64_t>(offset) > r.size - n) {
      return absl::InvalidArgumentError(absl::StrCat("TCP connection ", name_, ": a put of ", bytes, " bytes at ",
                                                     offset, " lies outside the peer's region of ", r.size));
    }
    if (r.mapped != nullptr) {
      CopyToPeer(r.mapped + offset, static_cast<const char*>(local), n);
      return absl::OkStatus();
    }
    uint64_t done = 0;
    while (done < n) {
      iovec mine{const_cast<char*>(static_cast<const char*>(local)) + done, n - done};
      iovec theirs{reinterpret_cast<void*>(static_cast<uintptr_t>(r.base + static_cast<uint64_t>(offset) + done)),
                   n - done};
      const ssize_t wrote = process_vm_writev(r.pid, &mine, 1, &theirs, 1, 0);
      if (wrote <= 0) {
        const int err = wrote < 0 ? errno : EIO;
        const absl::Status why =
            absl::UnavailableError(absl::StrCat("TCP connection ", name_, ": write into the peer: ", ErrnoText(err)));
        Fail(why);
        return why;
      }
      done += static_cast<uint64_t>(wrote);
    }
    return absl::OkStatus();
  }

  // Once over and kept for its handler (an outbound connection): what it
  // held beyond its own few words goes.
  void ReleaseBuffers() {
    std::string().swap(message_);
    std::deque<Out>().swap(out_);
    std::deque<DoneCallback>().swap(flushes_);
  }

  // The transport is going away: ends the connection without telling the
  // handler (as UCX's), but a write it allowed is still reported landed.
  void Shutdown() {
    if (state_ == State::kDone) return;
    state_ = State::kClosing;  // Not open: no OnDisconnected.
    Finish(absl::UnavailableError(absl::StrCat("TCP transport ", owner_->name_, " shut down")));
  }

  // The epoll interest: reads while the stream may carry frames for us,
  // writability while connecting or while the kernel's buffer is full.
  void UpdateInterest() {
    if (state_ == State::kDone) return;
    uint32_t want = 0;
    if (!connected_ || write_blocked_) want |= EPOLLOUT;
    if (Reading()) want |= EPOLLIN;
    if (want == interest_) return;
    interest_ = want;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = id_;
    (void)epoll_ctl(owner_->epoll_fd_, EPOLL_CTL_MOD, fd_, &ev);
  }
  uint32_t interest() const { return interest_; }
  void set_interest(uint32_t i) { interest_ = i; }

 private:
  // kOpen: both ways. kClosing: this side sent Bye (or is going away),
  // reads until ByeAck. kLingering: the peer sent Bye and the handler was
  // told; the queue (ending in ByeAck) drains, then the socket closes.
  enum class State { kOpen, kClosing, kLingering, kDone };
  enum class Read { kHeader, kMessage, kPayload, kDiscard };

  // One frame on the send queue: the header, then a payload that is either
  // owned (a message) or the caller's memory (a Put).
  struct Out {
    char header[kDataHeaderBytes];
    size_t header_bytes = 0;
    std::string owned;
    const char* borrowed = nullptr;
    size_t payload_bytes = 0;
    DoneCallback done;
    size_t sent = 0;
    const char* payload() const { return borrowed != nullptr ? borrowed : owned.data(); }
    size_t bytes() const { return header_bytes + payload_bytes; }
  };

  bool Reading() const { return connected_ && (state_ == State::kOpen || state_ == State::kClosing); }

  absl::Status Down() const {
    return error_.ok() ? absl::UnavailableError(absl::StrCat("TCP connection ", name_, " is closed")) : error_;
  }

  void Complete(DoneCallback done, absl::Status s) {
    if (done) owner_->loop_.Post([done = std::move(done), s = std::move(s)] { done(s); });
  }

  void QueueControl(FrameType type) {
    Out& o = out_.emplace_back();
    PutU32(o.header, type);
    PutU32(o.header + 4, 0);
    o.header_bytes = kControlHeaderBytes;
    WriteSome();
  }

  absl::Status ProtocolError(absl::string_view what) const {
    return absl::UnavailableError(absl::StrCat("TCP connection ", name_, ": protocol error: ", what));
  }

  // Hands as much of the queue to the kernel as it takes.
  void WriteSome() {
    if (!connected_ || state_ == State::kDone) return;
    while (!out_.empty()) {
      iovec iov[kMaxIov];
      int n = 0;
      for (auto it = out_.begin(); it != out_.end() && n + 2 <= kMaxIov; ++it) {
        size_t at = it->sent;
        if (at < it->header_bytes) {
          iov[n++] = {it->header + at, it->header_bytes - at};
          at = 0;
        } else {
          at -= it->header_bytes;
        }
        if (at < it->payload_bytes) iov[n++] = {const_cast<char*>(it->payload()) + at, it->payload_bytes - at};
      }
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<size_t>(n);
      const ssize_t wrote = sendmsg(fd_, &m, MSG_NOSIGNAL);
      if (wrote < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          write_blocked_ = true;
          UpdateInterest();
          return;
        }
        const int err = errno;
        Finish(absl::UnavailableError(absl::StrCat("TCP connection ", name_, ": send: ", ErrnoText(err))));
        return;
      }
      auto left = static_cast<size_t>(wrote);
      while (left > 0) {
        Out& front = out_.front();
        const size_t rest = front.bytes() - front.sent;
        if (left < rest) {
          front.sent += left;
          break;
        }
        left -= rest;
        Complete(std::move(front.done), absl::OkStatus());
        out_.pop_front();
      }
    }
    write_blocked_ = false;
    if (state_ == State::kLingering) {
      Finish(absl::OkStatus());
      return;
    }
    UpdateInterest();
  }

  // Reads frames until the socket is drained or this turn's budget is
  // spent. Every handler call may end the connection (Fail): the state is
  // checked after each.
  void ReadSome() {
    size_t budget = kReadBudget;
    while (Reading() && budget > 0) {
      char* into = nullptr;
      size_t want = 0;
      switch (read_) {
        case Read::kHeader:
          into = header_ + header_have_;
          want = header_need_ - header_have_;
          break;
        case Read::kMessage:
          into = message_.data() + message_have_;
          want = message_.size() - message_have_;
          break;
        case Read::kPayload:
          into = static_cast<char*>(payload_dst_) + payload_have_;
          want = std::min<uint64_t>(payload_bytes_ - payload_have_, budget);
          break;
        case Read::kDiscard:
          into = owner_->scratch_.data();
          want = std::min<uint64_t>({payload_bytes_ - payload_have_, budget, owner_->scratch_.size()});
          break;
      }
      const ssize_t got = recv(fd_, into, want, 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        const int err = errno;
        Finish(absl::UnavailableError(absl::StrCat("TCP connection ", name_, ": recv: ", ErrnoText(err))));
        return;
      }
      if (got == 0) {
        // A peer we sent Bye may close instead of answering: the close is
        // still graceful from here.
        Finish(state_ == State::kClosing && read_ == Read::kHeader && header_have_ == 0
                   ? absl::OkStatus()
                   : absl::UnavailableError(absl::StrCat("TCP connection ", name_, ": closed by the peer")));
        return;
      }
      const auto n = static_cast<size_t>(got);
      budget -= std::min(budget, n);
      switch (read_) {
        case Read::kHeader:
          header_have_ += n;
          if (header_have_ == kControlHeaderBytes && GetU32(header_) == kData) header_need_ = kDataHeaderBytes;
          if (header_have_ == header_need_) OnHeader();
          break;
        case Read::kMessage:
          message_have_ += n;
          if (message_have_ == message_.size()) DeliverMessage();
          break;
        case Read::kPayload:
          payload_have_ += n;
          if (payload_have_ == payload_bytes_) {
            read_ = Read::kHeader;
            if (handler_ != nullptr) handler_->WriteLanded(*this, payload_dst_, payload_bytes_);
          }
          break;
        case Read::kDiscard:
          payload_have_ += n;
          if (payload_have_ == payload_bytes_) read_ = Read::kHeader;
          break;
      }
    }
    // Drained or out of budget: either way the next wake-up must suit the
    // frame now being read (a threshold left from a payload would keep a
    // short frame after it waiting).
    if (Reading()) SetWakeBytes();
  }

  // Before the loop next waits on this socket: wake for a permitted payload's
  // next kPayloadWakeBytes, never for more than the frame has left (so the
  // frame always completes), and for any byte otherwise.
  void SetWakeBytes() {
    int bytes = 1;
    if (read_ == Read::kPayload) {
      bytes = static_cast<int>(std::min<uint64_t>(payload_bytes_ - payload_have_, kPayloadWakeBytes));
    }
    if (bytes == wake_bytes_) return;
    wake_bytes_ = bytes;
    (void)setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof(bytes));
  }

  void OnHeader() {
    const uint32_t type = GetU32(header_);
    const uint32_t word = GetU32(header_ + 4);
    header_have_ = 0;
    header_need_ = kControlHeaderBytes;
    read_ = Read::kHeader;
    if (type != kMessage && word != 0) return Finish(ProtocolError(absl::StrCat("frame type ", type, " with ", word)));
    switch (type) {
      case kMessage:
        if (word > kMaxMessageBytes) {
          return Finish(ProtocolError(
              absl::StrCat("a message of ", word, " bytes exceeds the limit of ", kMaxMessageBytes)));
        }
        message_.resize(word);
        message_have_ = 0;
        read_ = Read::kMessage;
        if (word == 0) DeliverMessage();
        return;
      case kData:
        return OnDataHeader(GetU64(header_ + 8), GetU64(header_ + 16));
      case kFlush:
        return QueueControl(kFlushAck);
      case kFlushAck: {
        if (flushes_.empty()) return Finish(ProtocolError("a flush answer without a flush"));
        DoneCallback done = std::move(flushes_.front());
        flushes_.pop_front();
        return Complete(std::move(done), absl::OkStatus());
      }
      case kBye: {
        const bool tell = state_ == State::kOpen;  // Not when both sides said Bye at once.
        state_ = State::kLingering;
        if (tell && handler_ != nullptr) handler_->OnDisconnected(*this, absl::OkStatus());
        if (state_ != State::kLingering) return;  // The handler failed it.
        return QueueControl(kByeAck);
      }
      case kByeAck:
        if (state_ != State::kClosing) return Finish(ProtocolError("a close answer without a close"));
        return Finish(absl::OkStatus());
      default:
        return Finish(ProtocolError(absl::StrCat("unknown frame type ", type)));
    }
  }

  // Where a data frame goes: into [address, address + bytes) only if that
  // lies in one registered region and the handler allows it, else nowhere.
  void OnDataHeader(uint64_t address, uint64_t bytes) {
    if (bytes == 0) return;
    if (bytes > std::max<uint64_t>(owner_->LargestRegion(), kMaxMessageBytes)) {
      return Finish(ProtocolError(absl::StrCat("a put of ", bytes, " bytes, more than any region holds")));
    }
    payload_bytes_ = bytes;
    payload_have_ = 0;
    payload_dst_ = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
    read_ = Read::kDiscard;
    // The handler judges every frame, so each refusal is counted in one
    // place (the receiver's put_outside_reservation); the registered check
    // stands behind it, whatever the handler allowed.
    if (handler_ == nullptr || !handler_->MayWrite(*this, payload_dst_, bytes)) return;
    if (state_ == State::kDone) return;
    if (!owner_->Registered(address, bytes)) {
      if (handler_ != nullptr) handler_->WriteLanded(*this, payload_dst_, bytes);
      return;
    }
    read_ = Read::kPayload;
  }

  void DeliverMessage() {
    read_ = Read::kHeader;
    std::string m = std::move(message_);
    message_.clear();
    if (handler_ != nullptr && (state_ == State::kOpen || state_ == State::kClosing)) {
      handler_->OnMessage(*this, std::move(m));
    }
  }

  // The end, once: the socket closes, outstanding operations complete
  // with an error, a write landing is reported, and the handler of an
  // open connection is told why; the object is freed after the tasks
  // already posted.
  void Finish(const absl::Status& why) {
    if (state_ == State::kDone) return;
    const bool report = state_ == State::kOpen;
    state_ = State::kDone;
    if (!why.ok()) {
      failed_ = true;
      error_ = why;
    }
    (void)epoll_ctl(owner_->epoll_fd_, EPOLL_CTL_DEL, fd_, nullptr);
    close(fd_);
    fd_ = -1;
    const absl::Status down = Down();
    for (Out& o : out_) Complete(std::move(o.done), down);
    out_.clear();
    for (DoneCallback& f : flushes_) Complete(std::move(f), down);
    flushes_.clear();
    if (read_ == Read::kPayload) {
      read_ = Read::kDiscard;
      if (handler_ != nullptr) handler_->WriteLanded(*this, payload_dst_, payload_bytes_);
    }
    if (report && handler_ != nullptr) handler_->OnDisconnected(*this, why);
    owner_->Retire(id_);
  }

  TcpTransport* owner_;
  uint64_t id_;
  int fd_;
  ConnectionHandler* handler_;
  std::string name_;
  std::string peer_host_;
  bool connected_;
  const bool outbound_;  // Made by Connect (kept once over: see the header).
  const bool same_host_;  // Accepted from this host (FromThisHost).
  State state_ = State::kOpen;
  bool failed_ = false;
  absl::Status error_;
  uint32_t interest_ = 0;
  bool write_blocked_ = false;
  int wake_bytes_ = 1;  // The socket's SO_RCVLOWAT.
  std::deque<Out> out_;
  std::deque<DoneCallback> flushes_;
  // The frame being read.
  Read read_ = Read::kHeader;
  char header_[kDataHeaderBytes];
  size_t header_have_ = 0;
  size_t header_need_ = kControlHeaderBytes;
  std::string message_;
  size_t message_have_ = 0;
  void* payload_dst_ = nullptr;  // A data frame's destination (allowed or not).
  uint64_t payload_bytes_ = 0;
  uint64_t payload_have_ = 0;
};

absl::StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Create(const Options& options) {
  std::unique_ptr<TcpTransport> t(new TcpTransport());
  t->name_ = options.name;
  t->direct_writes_ = options.direct_writes;
  t->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (t->epoll_fd_ < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("TCP transport ", options.name, ": epoll: ", ErrnoText(errno)));
  }
  t->allocator_ = std::make_unique<Allocator>(t.get());
  t->scratch_.resize(kScratchBytes);
  if (getrandom(t->nonce_, sizeof(t->nonce_), 0) != static_cast<ssize_t>(sizeof(t->nonce_))) {
    return absl::InternalError(absl::StrCat("TCP transport ", options.name, ": getrandom: ", ErrnoText(errno)));
  }
  TcpTransport* self = t.get();
  t->loop_.Start(options.name, EventLoop::Device{
                                   .progress = [self] { return self->Progress(); },
                                   .arm = [] { return true; },
                                   .fd = t->epoll_fd_,
                               },
                 {.realtime = options.realtime_loop});
  return t;
}

TcpTransport::~TcpTransport() {
  loop_.RunSync([this] {
    for (auto& [id, l] : listeners_) close(l.fd);
    listeners_.clear();
    for (auto& [id, c] : conns_) c->Shutdown();
  });
  loop_.Stop();  // Runs the completions and frees the connections.
  conns_.clear();
  husks_.clear();
  close(epoll_fd_);
}

KvRegionAllocator& TcpTransport::region_allocator() { return *allocator_; }

absl::StatusOr<std::string> TcpTransport::PackRegion(KvRegion& region) {
  auto* r = dynamic_cast<Region*>(&region);
  if (r == nullptr || r->owner() != this) {
    return absl::InvalidArgumentError(absl::StrCat("TCP transport ", name_, ": region was not allocated by it"));
  }
  std::string out(kDirectBytes, '\0');
  PutU64(out.data(), reinterpret_cast<uintptr_t>(r->data()));
  PutU64(out.data() + 8, r->size());
  PutU64(out.data() + 16, static_cast<uint64_t>(getpid()));
  PutU64(out.data() + 24, reinterpret_cast<uintptr_t>(nonce_));
  std::memcpy(out.data() + 32, nonce_, kNonceBytes);
  const SharedRegion* shared = r->shared();
  PutU64(out.data() + 48, shared != nullptr ? static_cast<uint64_t>(shared->fd()) : kNoFile);
  PutU64(out.data() + 56, shared != nullptr ? shared->inode() : 0);
  return out;
}

bool TcpTransport::Registered(uint64_t address, uint64_t bytes) const {
  absl::MutexLock lock(&regions_mu_);
  for (Region* r : regions_) {
    const uint64_t base = reinterpret_cast<uintptr_t>(r->data());
    const uint64_t size = r->size();
    // No sum that could wrap: the offset and the length each within size.
    if (address >= base && bytes <= size && address - base <= size - bytes) return true;
  }
  return false;
}

uint64_t TcpTransport::LargestRegion() const {
  absl::MutexLock lock(&regions_mu_);
  uint64_t largest = 0;
  for (Region* r : regions_) largest = std::max<uint64_t>(largest, r->size());
  return largest;
}

bool TcpTransport::Progress() {
  epoll_event events[kMaxEvents];
  const int n = epoll_wait(epoll_fd_, events, kMaxEvents, 0);
  for (int i = 0; i < n; ++i) {
    const uint64_t id = events[i].data.u64;
    if ((id & kListenerBit) != 0) {
      auto l = listeners_.find(id);
      if (l != listeners_.end()) Accept(l->second);
    } else if (auto c = conns_.find(id); c != conns_.end()) {
      c->second->OnEvents(events[i].events);
    }
  }
  return n > 0;
}

void TcpTransport::Accept(Listener& l) {
  for (int i = 0; i < kMaxEvents; ++i) {
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    const int fd = accept4(l.fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // EAGAIN; or out of descriptors: the next turn tries again.
    }
    SetNoDelay(fd);
    const std::string host = HostOf(peer);
    AddConn(fd, l.handler, absl::StrCat(name_, "<-", HostPort(host, PortOf(peer))), host, true, false,
            direct_writes_ && FromThisHost(fd, peer));
  }
}

TcpTransport::Conn* TcpTransport::AddConn(int fd, ConnectionHandler* handler, std::string name,
                                          std::string peer_host, bool connected, bool outbound, bool same_host) {
  const uint64_t id = next_id_++;
  auto conn = std::make_unique<Conn>(this, id, fd, handler, std::move(name), std::move(peer_host), connected,
                                     outbound, same_host);
  Conn* c = conn.get();
  epoll_event ev{};
  ev.events = connected ? EPOLLIN : EPOLLOUT;
  ev.data.u64 = id;
  c->set_interest(ev.events);
  (void)epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  conns_.emplace(id, std::move(conn));
  live_.fetch_add(1);
  return c;
}

void TcpTransport::Retire(uint64_t id) {
  // Posted: the caller may be deep in this connection's own frames, and
  // tasks posted before (completions, lookups by id) run first.
  loop_.Post([this, id] {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    live_.fetch_sub(1);
    if (it->second->outbound() && it->second->handler() != nullptr) {
      it->second->ReleaseBuffers();
      husks_.push_back(std::move(it->second));
    }
    conns_.erase(it);
  });
}

absl::StatusOr<int> TcpTransport::Listen(const std::string& host, int port, ConnectionHandler* handler) {
  absl::StatusOr<SocketAddress> addr = ParseAddress(host, port);
  if (!addr.ok()) return addr.status();
  const std::string where = HostPort(host, port);
  absl::StatusOr<int> socket_fd = OpenSocket(*addr, where);
  if (!socket_fd.ok()) return socket_fd.status();
  const int fd = *socket_fd;
  const int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, addr->get(), addr->length) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    close(fd);
    const std::string message = absl::StrCat("TCP transport: listen on ", where, ": ", ErrnoText(err));
    if (err == EADDRINUSE) return absl::AlreadyExistsError(message);
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::UnavailableError(message);
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  (void)getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = PortOf(bound);
  loop_.RunSync([&] {
    const uint64_t id = next_id_++ | kListenerBit;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = id;
    (void)epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    listeners_.emplace(id, Listener{fd, handler});
  });
  return bound_port;
}

absl::StatusOr<Connection*> TcpTransport::Connect(const std::string& host, int port, ConnectionHandler* handler) {
  absl::StatusOr<SocketAddress> addr = ParseAddress(host, port);
  if (!addr.ok()) return addr.status();
  const std::string where = HostPort(host, port);
  absl::StatusOr<int> socket_fd = OpenSocket(*addr, where);
  if (!socket_fd.ok()) return socket_fd.status();
  const int fd = *socket_fd;
  SetNoDelay(fd);
  std::string peer_host = host;
  if (peer_host.size() >= 2 && peer_host.front() == '[') peer_host = peer_host.substr(1, peer_host.size() - 2);
  return loop_.RunSync([&]() -> absl::StatusOr<Connection*> {
    const int rc = connect(fd, addr->get(), addr->length);
    const int err = rc == 0 ? 0 : errno;
    Conn* c = AddConn(fd, handler, where, peer_host, rc == 0, true);
    if (err != 0 && err != EINPROGRESS) {
      // Reported as a later failure, like a refusal that takes a round trip.
      loop_.Post([this, id = c->id(), err] {
        if (auto it = conns_.find(id); it != conns_.end()) it->second->FailConnect(err);
      });
    }
    return static_cast<Connection*>(c);
  });
}

void TcpTransport::Detach(ConnectionHandler* handler) {
  loop_.RunSync([&] {
    for (auto it = listeners_.begin(); it != listeners_.end();) {
      auto cur = it++;
      if (cur->second.handler != handler) continue;
      close(cur->second.fd);
      listeners_.erase(cur);
    }
    for (auto& [id, c] : conns_) {
      if (c->handler() == handler) c->Detach();
    }
    std::erase_if(husks_, [handler](const std::unique_ptr<Conn>& c) { return c->handler() == handler; });
  });
}

}  // namespace pdserve::kv
