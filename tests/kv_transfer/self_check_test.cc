#include "kv_transfer/self_check.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kv_transfer/loopback_transport.h"

namespace pdserve::kv {
namespace {

// A transport whose connections are accepted but never answered (what UCX
// does without /sys: it refuses the connection request and only logs why),
// until answer() is set.
class SilentTransport final : public Transport {
 public:
  SilentTransport() { loop_.Start("silent"); }
  ~SilentTransport() override { loop_.Stop(); }

  EventLoop& loop() override { return loop_; }
  KvRegionAllocator& region_allocator() override { return allocator_; }
  absl::StatusOr<std::string> PackRegion(KvRegion&) override { return absl::UnimplementedError("silent"); }
  absl::StatusOr<int> Listen(const std::string&, int, ConnectionHandler*) override { return 7; }
  absl::StatusOr<Connection*> Connect(const std::string&, int, ConnectionHandler* handler) override {
    conns_.push_back(std::make_unique<Conn>(this, handler));
    return conns_.back().get();
  }
  void Detach(ConnectionHandler* handler) override {
    loop_.RunSync([&] {
      for (auto& c : conns_) {
        if (c->handler == handler) c->handler = nullptr;
      }
    });
  }
  std::string RecentErrors() const override { return "lib: connection request refused"; }

  std::atomic<bool> answer{false};

 private:
  struct Conn final : public Connection {
    Conn(SilentTransport* owner, ConnectionHandler* handler) : owner(owner), handler(handler) {}
    void Send(std::string message) override {
      if (owner->answer && handler != nullptr) handler->OnMessage(*this, std::move(message));
    }
    absl::StatusOr<std::shared_ptr<RemoteRegion>> ImportRegion(absl::string_view) override {
      return absl::UnimplementedError("silent");
    }
    void Put(const void*, int64_t, RemoteRegion&, int64_t, DoneCallback) override {}
    void Flush(DoneCallback) override {}
    void Close() override {}
    void Fail(absl::Status) override { failed_ = true; }
    bool failed() const override { return failed_; }
    const std::string& name() const override { return name_; }
    SilentTransport* owner;
    ConnectionHandler* handler;
    bool failed_ = false;
    std::string name_ = "silent";
  };
  EventLoop loop_;
  HostKvRegionAllocator allocator_;
  std::vector<std::unique_ptr<Conn>> conns_;  // Loop thread only.
};

TEST(SelfCheckTest, TransportThatCarriesMessagesPasses) {
  LoopbackNetwork net;
  LoopbackTransport t(&net, "t");
  EXPECT_TRUE(CheckTransport(t, "127.0.0.1", absl::Seconds(5)).ok());
  TransportSelfCheck check(&t, {.host = "127.0.0.1"});
  EXPECT_EQ(check.reason(), "");
}

TEST(SelfCheckTest, UnansweredConnectionFailsWithTheLibrarysLog) {
  SilentTransport t;
  const absl::Status s = CheckTransport(t, "127.0.0.1", absl::Milliseconds(50));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), "KV handoff self-check over 127.0.0.1:7 failed: no answer within")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "lib: connection request refused")) << s;
}

TEST(SelfCheckTest, FailingCheckIsRunAgainUntilItPasses) {
  SilentTransport t;
  TransportSelfCheck check(
      &t, {.host = "127.0.0.1", .timeout = absl::Milliseconds(50), .recheck_period = absl::Milliseconds(10)});
  EXPECT_NE(check.reason(), "");
  t.answer = true;
  // The re-check runs on its own thread; its verdict is polled.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!check.reason().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(check.reason(), "");
}

TEST(SelfCheckTest, CheckThatCannotRunFailsForGood) {
  TransportSelfCheck check(absl::FailedPreconditionError("no network device"));
  EXPECT_EQ(check.reason(), "no network device");
}

}  // namespace
}  // namespace pdserve::kv
