// Connection::PrepareWrites over UCX shared memory, two transports in one
// process: the sender readies the pages of the receiver's pool it is about
// to write (its own mapping of them) without changing a byte, once per
// page, and a Put into readied pages lands as usual.
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kv_transfer/ucx_transport.h"

namespace pdserve::kv {
namespace {

// Receiver side: answers every message with "pong".
class Echo final : public ConnectionHandler {
 public:
  void OnMessage(Connection& c, std::string) override { c.Send("pong"); }
  void OnDisconnected(Connection&, absl::Status) override {}
};

// Sender side: the first message back fulfils `got`.
class Waiter final : public ConnectionHandler {
 public:
  void OnMessage(Connection&, std::string m) override {
    if (!done_) {
      done_ = true;
      got.set_value(std::move(m));
    }
  }
  void OnDisconnected(Connection&, absl::Status) override {}
  std::promise<std::string> got;

 private:
  bool done_ = false;
};

uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i * 131 + (i >> 12)); }

TEST(UcxPrepareWritesTest, ReadiesTheMappedPagesOnceWithoutChangingAByte) {
  absl::StatusOr<std::unique_ptr<UcxTransport>> recv = UcxTransport::Create({.name = "prepare-recv"});
  absl::StatusOr<std::unique_ptr<UcxTransport>> send = UcxTransport::Create({.name = "prepare-send"});
  ASSERT_TRUE(recv.ok()) << recv.status();
  ASSERT_TRUE(send.ok()) << send.status();
  constexpr size_t kBytes = 4 << 20;
  absl::StatusOr<std::unique_ptr<KvRegion>> region = (*recv)->region_allocator().Allocate(kBytes);
  ASSERT_TRUE(region.ok()) << region.status();
  auto* pool = static_cast<uint8_t*>((*region)->data());
  for (size_t i = 0; i < kBytes; ++i) pool[i] = Pattern(i);
  absl::StatusOr<std::string> packed = (*recv)->PackRegion(**region);
  ASSERT_TRUE(packed.ok()) << packed.status();

  Echo echo;
  Waiter waiter;
  absl::StatusOr<int> port = (*recv)->Listen("127.0.0.1", 0, &echo);
  ASSERT_TRUE(port.ok()) << port.status();
  absl::StatusOr<Connection*> conn = (*send)->Connect("127.0.0.1", *port, &waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  // The answer comes after the receiver's hello, which opens the sender's
  // shared-memory data endpoint.
  (*send)->loop().Post([c = *conn] { c->Send("ping"); });
  std::future<std::string> pong = waiter.got.get_future();
  ASSERT_EQ(pong.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(pong.get(), "pong");
  const bool mappable = (*send)->loop().RunSync([c = *conn] { return c->PeerMayMapMemory(); });
  if (!mappable) GTEST_SKIP() << "UCX_TLS leaves no shared-memory transport: PrepareWrites has nothing to ready";

  absl::StatusOr<std::shared_ptr<RemoteRegion>> remote =
      (*send)->loop().RunSync([&] { return (*conn)->ImportRegion(*packed); });
  ASSERT_TRUE(remote.ok()) << remote.status();
  const long page = sysconf(_SC_PAGESIZE);
  // Two runs: whole pages from 0, and one starting and ending mid-page
  // (3 pages touched), then one overlapping both (only its new pages count).
  const std::vector<std::pair<int64_t, int64_t>> first = {{0, 16 * page}, {100 * page + 100, 2 * page}};
  (*send)->loop().RunSync([&] { (*conn)->PrepareWrites(*remote, first); });
  (*send)->WaitForPreparedWrites();
  EXPECT_EQ((*send)->pages_prepared(), 16 + 3);
  (*send)->loop().RunSync([&] { (*conn)->PrepareWrites(*remote, {{8 * page, 16 * page}}); });
  (*send)->WaitForPreparedWrites();
  EXPECT_EQ((*send)->pages_prepared(), 16 + 3 + 8);
  (*send)->loop().RunSync([&] { (*conn)->PrepareWrites(*remote, first); });
  (*send)->WaitForPreparedWrites();
  EXPECT_EQ((*send)->pages_prepared(), 16 + 3 + 8) << "a page is readied once per imported region";
  size_t changed = 0;
  for (size_t i = 0; i < kBytes; ++i) changed += pool[i] != Pattern(i);
  EXPECT_EQ(changed, 0u);

  // A put into readied pages lands byte for byte; the rest stays.
  std::vector<uint8_t> src(3 * page + 77);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(255 - i % 251);
  std::promise<absl::Status> flushed;
  (*send)->loop().Post([&] {
    (*conn)->Put(src.data(), static_cast<int64_t>(src.size()), **remote, 5 * page + 3, nullptr);
    (*conn)->Flush([&](absl::Status s) { flushed.set_value(s); });
  });
  std::future<absl::Status> f = flushed.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  ASSERT_TRUE(f.get().ok());
  EXPECT_EQ(std::memcmp(pool + 5 * page + 3, src.data(), src.size()), 0);
  changed = 0;
  for (size_t i = 0; i < kBytes; ++i) {
    if (i >= static_cast<size_t>(5 * page + 3) && i < 5 * page + 3 + src.size()) continue;
    changed += pool[i] != Pattern(i);
  }
  EXPECT_EQ(changed, 0u);
  (*send)->loop().RunSync([&] { remote->reset(); });
}

}  // namespace
}  // namespace pdserve::kv
