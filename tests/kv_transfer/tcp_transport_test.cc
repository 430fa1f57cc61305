// TcpTransport over loopback: messages in order, puts byte-exact and
// ordered before later messages by Flush, every write checked against the
// registered regions and the handler (MayWrite, WriteLanded), hostile
// streams fail only their own connection, and finished connections are
// freed. Raw sockets play the peers that do not follow the protocol.
#include "kv_transfer/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kv/block_hash.h"
#include "kv/kv_manager.h"
#include "gtest/gtest.h"
#include "kv_transfer/layout_copy.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/sender.h"

namespace pdserve::kv {
namespace {

constexpr absl::Duration kWait = absl::Seconds(20);

// Records what a transport delivers; the hooks run on the loop thread.
class Recorder : public ConnectionHandler {
 public:
  struct Landed {
    const void* dst;
    size_t bytes;
  };

  void OnMessage(Connection& c, std::string message) override {
    if (on_message) on_message(c, message);
    absl::MutexLock lock(&mu_);
    messages_.push_back(std::move(message));
    events_.push_back("message");
  }
  bool MayWrite(Connection&, const void* dst, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    asked_.push_back({dst, bytes});
    return allow_;
  }
  void WriteLanded(Connection&, const void* dst, size_t bytes) override {
    if (on_landed) on_landed(dst, bytes);
    absl::MutexLock lock(&mu_);
    landed_.push_back({dst, bytes});
    events_.push_back("landed");
  }
  void OnDisconnected(Connection&, absl::Status why) override {
    absl::MutexLock lock(&mu_);
    disconnects_.push_back(why);
    events_.push_back(why.ok() ? "closed" : "failed");
  }

  // Waits until `pred` holds over the recorder's state; false on timeout.
  bool Wait(const std::function<bool(const Recorder&)>& pred) {
    absl::MutexLock lock(&mu_);
    auto holds = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pred(*this); };
    return mu_.AwaitWithTimeout(absl::Condition(&holds), kWait);
  }
  bool WaitMessages(size_t n) {
    return Wait([n](const Recorder& r) ABSL_NO_THREAD_SAFETY_ANALYSIS { return r.messages_.size() >= n; });
  }
  bool WaitDisconnects(size_t n) {
    return Wait([n](const Recorder& r) ABSL_NO_THREAD_SAFETY_ANALYSIS { return r.disconnects_.size() >= n; });
  }

  void set_allow(bool allow) {
    absl::MutexLock lock(&mu_);
    allow_ = allow;
  }
  std::vector<std::string> messages() const {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  std::vector<Landed> asked() const {
    absl::MutexLock lock(&mu_);
    return asked_;
  }
  std::vector<Landed> landed() const {
    absl::MutexLock lock(&mu_);
    return landed_;
  }
  std::vector<absl::Status> disconnects() const {
    absl::MutexLock lock(&mu_);
    return disconnects_;
  }
  std::vector<std::string> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }

  std::function<void(Connection&, const std::string&)> on_message;
  std::function<void(const void*, size_t)> on_landed;

 private:
  mutable absl::Mutex mu_;
  bool allow_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<std::string> messages_ ABSL_GUARDED_BY(mu_);
  std::vector<Landed> asked_ ABSL_GUARDED_BY(mu_);
  std::vector<Landed> landed_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> disconnects_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

// A blocking client socket that speaks raw bytes.
class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    timeval tv{.tv_sec = 20, .tv_usec = 0};  // A bound on a test gone wrong, not a synchronisation.
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawSocket() { Close(); }
  bool connected() const { return connected_; }
  bool SendAll(const std::string& bytes) {
    size_t at = 0;
    while (at < bytes.size()) {
      const ssize_t n = send(fd_, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return false;
      at += static_cast<size_t>(n);
    }
    return true;
  }
  // True when the peer closed the stream (reads until end of stream).
  bool SeesEndOfStream() {
    char buf[4096];
    for (;;) {
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::string U32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
std::string U64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
// Frames as tcp_transport.h lays them out.
std::string MessageFrame(const std::string& body) { return U32(1) + U32(static_cast<uint32_t>(body.size())) + body; }
std::string DataHeader(uint64_t address, uint64_t bytes) { return U32(2) + U32(0) + U64(address) + U64(bytes); }

std::string Pattern(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& ch : s) ch = static_cast<char>(rng());
  return s;
}

class TcpTransportTest : public ::testing::Test {
 protected:
  static constexpr size_t kRegionBytes = size_t{32} << 20;

  void SetUp() override {
    server_ = *TcpTransport::Create({.name = "tcp-server"});
    client_ = *TcpTransport::Create({.name = "tcp-client"});
    region_ = *server_->region_allocator().Allocate(kRegionBytes);
    source_ = *client_->region_allocator().Allocate(kRegionBytes);
    const std::string fill = Pattern(kRegionBytes, 7);
    std::memcpy(source_->data(), fill.data(), fill.size());
    base_ = reinterpret_cast<uintptr_t>(region_->data());
    port_ = *server_->Listen("127.0.0.1", 0, &server_handler_);
  }

  void TearDown() override {
    server_->Detach(&server_handler_);
    client_->Detach(&client_handler_);
    region_.reset();
    source_.reset();
    client_.reset();
    server_.reset();
  }

  Connection* ConnectClient() {
    absl::StatusOr<Connection*> c = client_->Connect("127.0.0.1", port_, &client_handler_);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : nullptr;
  }

  // The server's region as the client addresses it, with base `base`.
  std::shared_ptr<RemoteRegion> Remote(Connection* c, uint64_t base) {
    return client_->loop().RunSync([&] { return *c->ImportRegion(U64(base)); });
  }

  std::string RegionBytes() const { return std::string(static_cast<const char*>(region_->data()), kRegionBytes); }

  // Puts `bytes` from the client's source at `from` to the remote at `to`.
  void Put(Connection* c, RemoteRegion& remote, int64_t from, int64_t bytes, int64_t to) {
    client_->loop().Post([c, &remote, this, from, bytes, to] {
      c->Put(static_cast<char*>(source_->data()) + from, bytes, remote, to, nullptr);
    });
  }

  // A Flush, then a message after it completes; waits for the message.
  void FlushThenMessage(Connection* c, const std::string& message, size_t expect_messages) {
    client_->loop().Post([c, message] {
      c->Flush([c, message](absl::Status s) {
        EXPECT_TRUE(s.ok()) << s;
        c->Send(message);
      });
    });
    ASSERT_TRUE(server_handler_.WaitMessages(expect_messages));
  }

  // Waits until both transports freed every connection: each round trip
  // to a loop runs the frees posted before it.
  bool AllFreed() {
    const absl::Time end = absl::Now() + kWait;
    while (absl::Now() < end) {
      server_->loop().RunSync([] {});
      client_->loop().RunSync([] {});
      if (server_->live_connections() == 0 && client_->live_connections() == 0) return true;
    }
    return false;
  }

  Recorder server_handler_, client_handler_;  // Outlive the transports.
  std::unique_ptr<TcpTransport> server_, client_;
  std::unique_ptr<KvRegion> region_, source_;
  uint64_t base_ = 0;
  int port_ = 0;
};

TEST_F(TcpTransportTest, MessagesArriveInOrder) {
  Connection* c = ConnectClient();
  constexpr int kMessages = 1000;
  constexpr size_t kMaxSize = 70 << 10;
  auto body = [](int i) { return Pattern((static_cast<size_t>(i) * 7919) % (kMaxSize + 1), i); };
  client_->loop().Post([&] {
    for (int i = 0; i < kMessages; ++i) c->Send(body(i));
  });
  ASSERT_TRUE(server_handler_.WaitMessages(kMessages));
  const std::vector<std::string> got = server_handler_.messages();
  ASSERT_EQ(got.size(), static_cast<size_t>(kMessages));
  for (int i = 0; i < kMessages; ++i) ASSERT_EQ(got[i], body(i)) << "message " << i;
  EXPECT_TRUE(server_handler_.disconnects().empty());
}

TEST_F(TcpTransportTest, PutsLandByteExactBeforeAMessageSentAfterFlush) {
  Connection* c = ConnectClient();
  std::shared_ptr<RemoteRegion> remote = Remote(c, base_);
  struct Write {
    int64_t from, bytes, to;
  };
  const std::vector<Write> writes = {{3, 1, 0},
                                     {100, 7, 4093},
                                     {5000, 4096, 8192},
                                     {70000, 65537, 1 << 20},
                                     {1 << 22, (1 << 20) + 3, 3 << 20},
                                     {8 << 20, 8 << 20, 16 << 20}};
  const auto* src = static_cast<const char*>(source_->data());
  auto* dst = static_cast<const char*>(region_->data());
  // Each write is whole when reported landed, and reported once.
  std::vector<int> landed_ok(writes.size(), 0);
  server_handler_.on_landed = [&](const void* at, size_t bytes) {
    for (size_t i = 0; i < writes.size(); ++i) {
      if (at == dst + writes[i].to && bytes == static_cast<size_t>(writes[i].bytes) &&
          std::memcmp(at, src + writes[i].from, bytes) == 0) {
        ++landed_ok[i];
      }
    }
  };
  // When the message after the flush arrives, every put is in place.
  bool all_in_place = false;
  server_handler_.on_message = [&](Connection&, const std::string& m) {
    if (m != "after") return;
    all_in_place = true;
    for (const Write& w : writes) all_in_place &= std::memcmp(dst + w.to, src + w.from, w.bytes) == 0;
  };
  for (const Write& w : writes) Put(c, *remote, w.from, w.bytes, w.to);
  FlushThenMessage(c, "after", 1);
  EXPECT_TRUE(all_in_place);
  EXPECT_EQ(landed_ok, std::vector<int>(writes.size(), 1));
  EXPECT_EQ(server_handler_.asked().size(), writes.size());
  EXPECT_EQ(server_handler_.landed().size(), writes.size());
  // Nothing else in the region changed.
  std::string expect(kRegionBytes, '\0');
  for (const Write& w : writes) std::memcpy(expect.data() + w.to, src + w.from, w.bytes);
  EXPECT_TRUE(RegionBytes() == expect);
}

// The stream keeps Puts and messages in order: a message sent right after
// Puts, with no Flush between, finds their bytes in place (what lets a
// handoff commit without a Flush round trip).
TEST_F(TcpTransportTest, AMessageSentRightAfterPutsFindsTheirBytesInPlace) {
  Connection* c = ConnectClient();
  std::shared_ptr<RemoteRegion> remote = Remote(c, base_);
  EXPECT_TRUE(c->MessagesFollowPuts());
  const auto* src = static_cast<const char*>(source_->data());
  auto* dst = static_cast<const char*>(region_->data());
  constexpr int64_t kPut = (2 << 20) + 5;
  constexpr int kPuts = 6;
  bool all_in_place = false;
  server_handler_.on_message = [&](Connection&, const std::string& m) {
    if (m != "commit") return;
    all_in_place = true;
    for (int i = 0; i < kPuts; ++i) all_in_place &= std::memcmp(dst + i * kPut, src + i * kPut, kPut) == 0;
  };
  client_->loop().Post([&] {
    for (int i = 0; i < kPuts; ++i) c->Put(src + i * kPut, kPut, *remote, i * kPut, nullptr);
    c->Send("commit");
  });
  ASSERT_TRUE(server_handler_.WaitMessages(1));
  EXPECT_TRUE(all_in_place);
  EXPECT_EQ(server_handler_.landed().size(), static_cast<size_t>(kPuts));
}

// A payload that trickles in, in pieces far smaller than the reader's wake
// threshold and with pauses between them, still lands whole, and a short
// message right behind it is delivered (the threshold never asks for more
// than the frame has left, and drops back to one byte after it).
TEST_F(TcpTransportTest, ATricklingPayloadLandsAndTheShortMessageBehindItArrives) {
  RawSocket raw(port_);
  ASSERT_TRUE(raw.connected());
  constexpr size_t kBytes = (1 << 20) + 777;
  const std::string payload = Pattern(kBytes, 11);
  ASSERT_TRUE(raw.SendAll(DataHeader(base_ + 8192, kBytes)));
  constexpr size_t kPiece = 3000;
  for (size_t at = 0; at < kBytes; at += kPiece) {
    ASSERT_TRUE(raw.SendAll(payload.substr(at, kPiece)));
    if ((at / kPiece) % 50 == 0) absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(raw.SendAll(MessageFrame("after")));
  ASSERT_TRUE(server_handler_.WaitMessages(1));
  EXPECT_EQ(server_handler_.messages()[0], "after");
  ASSERT_EQ(server_handler_.landed().size(), 1u);
  EXPECT_EQ(std::memcmp(static_cast<char*>(region_->data()) + 8192, payload.data(), kBytes), 0);
  // A frame that leaves the reader's budget mid-way (more than a turn
  // reads) and then one message of a few bytes: both arrive.
  const std::string big = Pattern((9 << 20) + 1, 12);
  ASSERT_TRUE(raw.SendAll(DataHeader(base_ + (16 << 20), big.size()) + big + MessageFrame("x")));
  ASSERT_TRUE(server_handler_.WaitMessages(2));
  EXPECT_EQ(server_handler_.messages()[1], "x");
  EXPECT_EQ(std::memcmp(static_cast<char*>(region_->data()) + (16 << 20), big.data(), big.size()), 0);
}

// A peer on this host (loopback) is offered direct writes: with the full
// descriptor its Puts land through a mapping of the region's memory file
// (or, where the file cannot be opened as the one named, by
// process_vm_writev), without a frame for the handler to judge,
// byte-exact before a message sent after the Flush.
TEST_F(TcpTransportTest, ASameHostPeerWritesDirectly) {
  std::atomic<int> may_map{-1};
  server_handler_.on_message = [&](Connection& sc, const std::string&) { may_map = sc.PeerMayMapMemory() ? 1 : 0; };
  Connection* c = ConnectClient();
  FlushThenMessage(c, "hello", 1);
  EXPECT_EQ(may_map.load(), 1) << "a loopback peer is on this host";
  const std::string packed = *server_->PackRegion(*region_);
  EXPECT_EQ(server_->WithoutRemoteKey(packed), U64(base_));
  std::shared_ptr<RemoteRegion> remote =
      client_->loop().RunSync([&] { return *c->ImportRegion(packed); });
  std::string other_inode = packed;
  other_inode[56] ^= 1;
  std::shared_ptr<RemoteRegion> unmapped =
      client_->loop().RunSync([&] { return *c->ImportRegion(other_inode); });
  Put(c, *remote, 4096, 1 << 20, 12345);
  Put(c, *unmapped, 3, (1 << 20) + 5, 3 << 20);
  FlushThenMessage(c, "after", 2);
  EXPECT_EQ(std::memcmp(static_cast<char*>(region_->data()) + 12345, static_cast<char*>(source_->data()) + 4096,
                        1 << 20),
            0);
  EXPECT_EQ(std::memcmp(static_cast<char*>(region_->data()) + (3 << 20), static_cast<char*>(source_->data()) + 3,
                        (1 << 20) + 5),
            0);
  EXPECT_TRUE(server_handler_.asked().empty()) << "a direct write went as a frame";
  // Out of the region: refused on this side, nothing written.
  const std::string before = RegionBytes();
  absl::Notification refused;
  client_->loop().Post([&] {
    c->Put(source_->data(), 100, *remote, static_cast<int64_t>(kRegionBytes) - 10, [&](absl::Status s) {
      EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
      refused.Notify();
    });
  });
  ASSERT_TRUE(refused.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(RegionBytes() == before);
}

// A descriptor whose nonce is not found where it says, in the process its
// pid names here (another process, or a forged nonce), gives frames only.
TEST_F(TcpTransportTest, ADescriptorThatDoesNotNameItsProcessWritesByFrames) {
  Connection* c = ConnectClient();
  std::string forged = *server_->PackRegion(*region_);
  forged[40] ^= 1;  // A nonce byte.
  std::string other_process = *server_->PackRegion(*region_);
  const uint64_t parent = static_cast<uint64_t>(getppid());
  std::memcpy(other_process.data() + 16, &parent, sizeof(parent));
  std::vector<std::shared_ptr<RemoteRegion>> remotes;  // Until the Puts ran.
  for (const std::string& packed : {forged, other_process}) {
    remotes.push_back(client_->loop().RunSync([&] { return *c->ImportRegion(packed); }));
    Put(c, *remotes.back(), 0, 64, 0);
  }
  FlushThenMessage(c, "after", 1);
  EXPECT_EQ(server_handler_.asked().size(), 2u) << "a write went around the handler";
}

// direct_writes = false: no peer is offered them, even on this host.
TEST(TcpTransportOptionsTest, WithoutDirectWritesNoPeerMayMapMemory) {
  std::unique_ptr<TcpTransport> server = *TcpTransport::Create({.name = "s", .direct_writes = false});
  std::unique_ptr<TcpTransport> client = *TcpTransport::Create({.name = "c"});
  Recorder server_handler, client_handler;
  std::atomic<int> may_map{-1};
  server_handler.on_message = [&](Connection& sc, const std::string&) { may_map = sc.PeerMayMapMemory() ? 1 : 0; };
  const int port = *server->Listen("127.0.0.1", 0, &server_handler);
  Connection* c = *client->Connect("127.0.0.1", port, &client_handler);
  client->loop().Post([c] { c->Send("hello"); });
  ASSERT_TRUE(server_handler.WaitMessages(1));
  EXPECT_EQ(may_map.load(), 0);
  server->Detach(&server_handler);
  client->Detach(&client_handler);
}

TEST_F(TcpTransportTest, PutDoneCompletesOk) {
  Connection* c = ConnectClient();
  std::shared_ptr<RemoteRegion> remote = Remote(c, base_);
  absl::Notification done;
  absl::Status status;
  client_->loop().Post([&] {
    c->Put(source_->data(), 2 << 20, *remote, 0, [&](absl::Status s) {
      status = s;
      done.Notify();
    });
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(status.ok()) << status;
}

TEST_F(TcpTransportTest, RefusedWriteChangesNothingAndTheConnectionWorks) {
  server_handler_.set_allow(false);
  Connection* c = ConnectClient();
  std::shared_ptr<RemoteRegion> remote = Remote(c, base_);
  const std::string before = RegionBytes();
  Put(c, *remote, 0, 3 << 20, 4096);
  Put(c, *remote, 0, 1, 0);
  FlushThenMessage(c, "after", 1);
  EXPECT_TRUE(RegionBytes() == before);
  EXPECT_EQ(server_handler_.asked().size(), 2u);
  EXPECT_TRUE(server_handler_.landed().empty());
  // Still up, and an allowed write now lands.
  server_handler_.set_allow(true);
  Put(c, *remote, 0, 4096, 0);
  FlushThenMessage(c, "again", 2);
  EXPECT_EQ(std::memcmp(region_->data(), source_->data(), 4096), 0);
  EXPECT_TRUE(server_handler_.disconnects().empty());
}

// The handler (here: one that allows everything) is asked about each, so
// it can count the refusal; the region check stands behind it.
TEST_F(TcpTransportTest, PutOutsideEveryRegionWritesNothingWhateverTheHandlerAllows) {
  Connection* c = ConnectClient();
  const std::string before = RegionBytes();
  struct Outside {
    uint64_t base;
    int64_t offset, bytes;
  };
  const std::vector<Outside> outside = {
      {base_, static_cast<int64_t>(kRegionBytes) - 10, 100},  // Runs past the end.
      {base_ - 4096, 0, 100},                                 // Before the start.
      {base_ - 50, 0, 100},                                   // Straddles the start.
      {~uint64_t{0} - 49, 0, 100},                            // Wraps around 2^64 onto low addresses.
      {base_ + kRegionBytes, 0, 1},                           // Just past the end.
      {base_, -4096, 4096},                                   // A negative offset.
  };
  std::vector<std::shared_ptr<RemoteRegion>> remotes;
  for (const Outside& o : outside) {
    remotes.push_back(Remote(c, o.base));
    Put(c, *remotes.back(), 0, o.bytes, o.offset);
  }
  FlushThenMessage(c, "after", 1);
  EXPECT_TRUE(RegionBytes() == before);
  EXPECT_EQ(server_handler_.asked().size(), outside.size());
  EXPECT_EQ(server_handler_.landed().size(), outside.size());  // Every allowed write is reported over.
  EXPECT_TRUE(server_handler_.disconnects().empty());
}

TEST_F(TcpTransportTest, LengthThatWrapsAroundFailsOnlyThatConnection) {
  Connection* good = ConnectClient();
  const std::string before = RegionBytes();
  RawSocket raw(port_);
  ASSERT_TRUE(raw.connected());
  // base + 16 + length wraps to base + 8: inside, if added up naively.
  ASSERT_TRUE(raw.SendAll(DataHeader(base_ + 16, ~uint64_t{0} - 7) + std::string(64, 'x')));
  EXPECT_TRUE(raw.SeesEndOfStream());
  ASSERT_TRUE(server_handler_.WaitDisconnects(1));
  EXPECT_FALSE(server_handler_.disconnects()[0].ok());
  EXPECT_TRUE(server_handler_.asked().empty());
  EXPECT_TRUE(RegionBytes() == before);
  client_->loop().Post([good] { good->Send("still here"); });
  ASSERT_TRUE(server_handler_.WaitMessages(1));
  EXPECT_EQ(server_handler_.disconnects().size(), 1u);
}

TEST_F(TcpTransportTest, PeerGoneMidPayloadLandsThenDisconnects) {
  RawSocket raw(port_);
  ASSERT_TRUE(raw.connected());
  constexpr size_t kBytes = 1 << 20;
  const std::string half = Pattern(kBytes / 2, 3);
  ASSERT_TRUE(raw.SendAll(MessageFrame("hello") + DataHeader(base_ + 4096, kBytes) + half));
  raw.Close();
  ASSERT_TRUE(server_handler_.WaitDisconnects(1));
  EXPECT_FALSE(server_handler_.disconnects()[0].ok());
  EXPECT_EQ(server_handler_.events(), (std::vector<std::string>{"message", "landed", "failed"}));
  ASSERT_EQ(server_handler_.landed().size(), 1u);
  EXPECT_EQ(server_handler_.landed()[0].dst, static_cast<char*>(region_->data()) + 4096);
  EXPECT_EQ(server_handler_.landed()[0].bytes, kBytes);
  EXPECT_EQ(std::memcmp(static_cast<char*>(region_->data()) + 4096, half.data(), half.size()), 0);
  // The transport carries on.
  Connection* c = ConnectClient();
  client_->loop().Post([c] { c->Send("next"); });
  ASSERT_TRUE(server_handler_.WaitMessages(2));
  EXPECT_EQ(server_handler_.messages()[1], "next");
}

TEST_F(TcpTransportTest, GarbageAndHugeLengthsFailOnlyTheirConnection) {
  Connection* good = ConnectClient();
  const std::vector<std::string> hostile = {
      std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),                      // Unknown frame type.
      U32(1) + U32(TcpTransport::kMaxMessageBytes + 1),                      // A message over the limit.
      DataHeader(base_, uint64_t{1} << 40),                                  // A put larger than any region.
      U32(4) + U32(0),                                                       // A flush answer never asked for.
      U32(2) + U32(1) + U64(base_) + U64(8) + std::string(8, 'x'),           // A data frame's reserved word set.
  };
  for (size_t i = 0; i < hostile.size(); ++i) {
    RawSocket raw(port_);
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.SendAll(hostile[i]));
    EXPECT_TRUE(raw.SeesEndOfStream()) << i;
    ASSERT_TRUE(server_handler_.WaitDisconnects(i + 1)) << i;
    EXPECT_TRUE(absl::IsUnavailable(server_handler_.disconnects()[i])) << server_handler_.disconnects()[i];
  }
  EXPECT_TRUE(server_handler_.asked().empty());
  client_->loop().Post([good] { good->Send("still here"); });
  ASSERT_TRUE(server_handler_.WaitMessages(1));
  EXPECT_EQ(server_handler_.messages()[0], "still here");
  EXPECT_EQ(server_handler_.disconnects().size(), hostile.size());
}

TEST_F(TcpTransportTest, CloseGivesThePeerOk) {
  Connection* c = ConnectClient();
  client_->loop().Post([c] {
    c->Send("bye soon");
    c->Close();
  });
  ASSERT_TRUE(server_handler_.WaitDisconnects(1));
  EXPECT_TRUE(server_handler_.disconnects()[0].ok()) << server_handler_.disconnects()[0];
  EXPECT_EQ(server_handler_.events(), (std::vector<std::string>{"message", "closed"}));
  EXPECT_TRUE(AllFreed());
  EXPECT_TRUE(client_handler_.disconnects().empty());  // The closing side is not told.
}

TEST_F(TcpTransportTest, ConnectToAClosedPortIsUnavailable) {
  // A port bound but not listening refuses connections.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  absl::StatusOr<Connection*> c = client_->Connect("127.0.0.1", port, &client_handler_);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(client_handler_.WaitDisconnects(1));
  const absl::Status why = client_handler_.disconnects()[0];
  EXPECT_TRUE(absl::IsUnavailable(why)) << why;
  EXPECT_TRUE(absl::StrContains(why.message(), absl::StrCat("127.0.0.1:", port))) << why;
  close(fd);
  EXPECT_TRUE(AllFreed());
}

TEST_F(TcpTransportTest, ListensAndConnectsOverIpv6) {
  Recorder v6;
  absl::StatusOr<int> port = server_->Listen("::1", 0, &v6);
  if (!port.ok()) GTEST_SKIP() << "no IPv6 loopback: " << port.status();
  absl::StatusOr<Connection*> c = client_->Connect("::1", *port, &client_handler_);
  ASSERT_TRUE(c.ok()) << c.status();
  std::string peer;
  v6.on_message = [&](Connection& conn, const std::string&) { peer = conn.peer_host(); };
  client_->loop().Post([c = *c] { c->Send("over v6"); });
  ASSERT_TRUE(v6.WaitMessages(1));
  EXPECT_EQ(v6.messages()[0], "over v6");
  EXPECT_EQ(peer, "::1");
  EXPECT_EQ(client_->loop().RunSync([c = *c] { return c->peer_host(); }), "::1");
  server_->Detach(&v6);
}

TEST_F(TcpTransportTest, ConnectAndCloseCyclesFreeEveryConnection) {
  constexpr int kCycles = 2000;
  constexpr int kBatch = 100;  // Bounds the descriptors open at once.
  for (int done = 0; done < kCycles; done += kBatch) {
    std::vector<Connection*> conns;
    for (int i = 0; i < kBatch; ++i) conns.push_back(ConnectClient());
    client_->loop().Post([conns] {
      for (size_t i = 0; i < conns.size(); ++i) {
        conns[i]->Send("hi");
        // Half leave gracefully, half fail (the peer sees the socket close).
        if (i % 2 == 0) {
          conns[i]->Close();
        } else {
          conns[i]->Fail(absl::CancelledError("test"));
        }
      }
    });
    ASSERT_TRUE(server_handler_.WaitDisconnects(static_cast<size_t>(done + kBatch)));
  }
  EXPECT_TRUE(AllFreed()) << server_->live_connections() << " " << client_->live_connections();
}

// The KV handoff (sender, receiver, MayWrite on reserved blocks) end to
// end over TCP.
TEST(TcpTransportHandoffTest, SameLayoutHandoffLandsByteIdentical) {
  const ModelIdentity model = HashBytes("tcp-handoff-test-model");
  const KvCacheSpec spec = {.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4,
                            .dtype = DType::kF32, .num_blocks = 32};
  std::unique_ptr<TcpTransport> prefill = *TcpTransport::Create({.name = "tcp-prefill"});
  std::unique_ptr<TcpTransport> decode = *TcpTransport::Create({.name = "tcp-decode"});
  std::unique_ptr<KvManager> sender_kv = *KvManager::Create(spec, &prefill->region_allocator());
  std::unique_ptr<KvManager> receiver_kv = *KvManager::Create(spec, &decode->region_allocator());
  {
    const std::string fill = Pattern(sender_kv->region().size(), 11);
    std::memcpy(sender_kv->region().data(), fill.data(), fill.size());
  }
  absl::Mutex mu;
  std::vector<CommittedSequence> committed;
  ReceiverOptions options;
  options.model = model;
  std::unique_ptr<KvReceiver> receiver =
      *KvReceiver::Create(decode.get(), receiver_kv.get(), options,
                          [&](CommittedSequence s) {
                            absl::MutexLock lock(&mu);
                            committed.push_back(std::move(s));
                          });
  const int port = *receiver->Listen("127.0.0.1", 0);
  auto sender = std::make_unique<KvSender>(prefill.get(), sender_kv->storage(),
                                           SenderOptions{.model = model, .timeout = absl::Seconds(10)});
  Connection* conn = *sender->Connect("127.0.0.1", port);

  constexpr int32_t kPositions = 23;
  SequenceKv seq = sender_kv->NewSequence();
  ASSERT_TRUE(sender_kv->Grow(seq, kPositions).ok());
  seq.SetNumPositions(kPositions);
  std::vector<int32_t> tokens(kPositions);
  for (int32_t i = 0; i < kPositions; ++i) tokens[i] = 1 + i % 50;
  auto h = sender->Reserve(conn, {.num_positions = kPositions, .margin_positions = 3, .prompt_tokens = tokens});
  ASSERT_TRUE(h.ok()) << h.status();
  for (int32_t l = 0; l < spec.num_layers; ++l) ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
  Commit state;
  state.num_positions = kPositions;
  state.tokens = tokens;
  state.first_token = 42;
  ASSERT_TRUE((*h)->Commit(state).ok());
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(committed.size(), 1u);
    const auto want =
        PositionChecksums(spec, sender_kv->storage().base, seq.block_table(), 0, kPositions, 4);
    const auto have = PositionChecksums(spec, receiver_kv->storage().base, committed[0].kv.block_table(), 0,
                                        kPositions, 4);
    EXPECT_EQ(want, have);
    EXPECT_EQ(committed[0].state.first_token, 42);
    committed[0].kv.Release();
    committed.clear();
  }
  EXPECT_EQ(receiver->metrics().transfers, 1);
  h->reset();
  seq.Release();
  sender.reset();
  receiver.reset();
  sender_kv.reset();
  receiver_kv.reset();
}

// A receiver that goes away gracefully (its KvReceiver closes each
// connection with a Bye, as a draining worker's does) leaves the sender's
// kept connection closed, not failed: the next reservation to that
// address must connect again at once, never wait out the sender's timeout
// on the closed connection. Here a new receiver listens on the same port,
// as a restarted worker would.
TEST(TcpTransportHandoffTest, AReceiverThatSaidByeIsConnectedAgainNotWaitedFor) {
  const ModelIdentity model = HashBytes("tcp-handoff-test-model");
  const KvCacheSpec spec = {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4,
                            .dtype = DType::kF32, .num_blocks = 32};
  std::unique_ptr<TcpTransport> prefill = *TcpTransport::Create({.name = "tcp-prefill"});
  std::unique_ptr<TcpTransport> decode = *TcpTransport::Create({.name = "tcp-decode"});
  std::unique_ptr<KvManager> sender_kv = *KvManager::Create(spec, &prefill->region_allocator());
  std::unique_ptr<KvManager> receiver_kv = *KvManager::Create(spec, &decode->region_allocator());
  ReceiverOptions options;
  options.model = model;
  auto make_receiver = [&] {
    return *KvReceiver::Create(decode.get(), receiver_kv.get(), options, [](CommittedSequence s) { s.kv.Release(); });
  };
  std::unique_ptr<KvReceiver> receiver = make_receiver();
  const int port = *receiver->Listen("127.0.0.1", 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  // A timeout longer than the test's bound below: a wait on the closed
  // connection would show as DEADLINE_EXCEEDED.
  auto sender = std::make_unique<KvSender>(prefill.get(), sender_kv->storage(),
                                           SenderOptions{.model = model, .timeout = absl::Seconds(15)});
  absl::Notification gone;
  sender->SetRoomListener([&gone](Connection&) {
    if (!gone.HasBeenNotified()) gone.Notify();
  });
  ReceiverConnections connections(sender.get());
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};
  const ReserveArgs args = {.num_positions = 5, .prompt_tokens = tokens};
  {
    auto h = connections.Reserve(address, args);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE((*h)->Abort(absl::CancelledError("test")).ok());
  }
  receiver.reset();  // Bye on every connection; the listener closes.
  ASSERT_TRUE(gone.WaitForNotificationWithTimeout(kWait));
  // Nothing listens: refused at once.
  absl::Time start = absl::Now();
  auto refused = connections.Reserve(address, args);
  EXPECT_TRUE(absl::IsUnavailable(refused.status())) << refused.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << refused.status();
  // Back on the same port: served.
  receiver = make_receiver();
  ASSERT_EQ(*receiver->Listen("127.0.0.1", port), port);
  start = absl::Now();
  auto h = connections.Reserve(address, args);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_TRUE((*h)->Abort(absl::CancelledError("test")).ok());
  h->reset();
  sender.reset();
  receiver.reset();
  sender_kv.reset();
  receiver_kv.reset();
}

}  // namespace
}  // namespace pdserve::kv
