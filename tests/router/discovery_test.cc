#include "router/discovery.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/dnsmasq.h"

namespace pdserve::router {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(1);

TEST(DiscoveryParseTest, FixedHostPort) {
  absl::StatusOr<WorkerTarget> t = ParseWorkerTarget("worker-1.local:50051");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->spec, "worker-1.local:50051");
  EXPECT_FALSE(t->dns);
  EXPECT_EQ(t->name_server, "");
  EXPECT_EQ(t->host, "worker-1.local");
  EXPECT_EQ(t->port, 50051);

  t = ParseWorkerTarget("127.0.0.1:1");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->host, "127.0.0.1");
  EXPECT_EQ(t->port, 1);
}

TEST(DiscoveryParseTest, FixedIpv6) {
  absl::StatusOr<WorkerTarget> t = ParseWorkerTarget("[::1]:65535");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->dns);
  EXPECT_EQ(t->host, "::1");
  EXPECT_EQ(t->port, 65535);
}

TEST(DiscoveryParseTest, DnsWithSystemResolver) {
  absl::StatusOr<WorkerTarget> t = ParseWorkerTarget("dns:///prefill.pdserve.test:7000");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->dns);
  EXPECT_EQ(t->name_server, "");
  EXPECT_EQ(t->host, "prefill.pdserve.test");
  EXPECT_EQ(t->port, 7000);
}

TEST(DiscoveryParseTest, DnsWithServer) {
  absl::StatusOr<WorkerTarget> t = ParseWorkerTarget("dns://10.0.0.2:5353/decode:7001");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->dns);
  EXPECT_EQ(t->name_server, "10.0.0.2:5353");
  EXPECT_EQ(t->host, "decode");
  EXPECT_EQ(t->port, 7001);

  t = ParseWorkerTarget("dns://10.0.0.2/decode:7001");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->name_server, "10.0.0.2:53");

  t = ParseWorkerTarget("dns://[fd00::53]/decode:7001");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->name_server, "[fd00::53]:53");

  t = ParseWorkerTarget("dns://[::1]:5353/decode:7001");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->name_server, "[::1]:5353");
}

struct BadCase {
  const char* spec;
  const char* message;
};

TEST(DiscoveryParseTest, RejectsBadTargetsSayingWhy) {
  const BadCase cases[] = {
      {"", "empty"},
      {"worker", "missing port after host"},
      {"worker:", "missing port after host"},
      {":50051", "empty host"},
      {"worker:0", "port 0 out of range 1..65535"},
      {"worker:65536", "port 65536 out of range 1..65535"},
      {"worker:1234567", "port 1234567 out of range 1..65535"},
      {"worker:http", "port 'http' is not a number"},
      {"worker:-1", "port '-1' is not a number"},
      {"wor ker:1", "bad host 'wor ker'"},
      {"::1:50051", "an IPv6 host needs brackets"},
      {"[::1]", "missing port after host"},
      {"[::1:50051", "unclosed '['"},
      {"[worker]:1", "'[worker]' is not an IPv6 address"},
      {"[::1]50051", "expected ':' after ']'"},
      {"http://worker:1", "unsupported scheme 'http'"},
      {"dns://", "expected '/' before the name"},
      {"dns://10.0.0.2", "expected '/' before the name"},
      {"dns:///", "empty name"},
      {"dns:///:7000", "empty name"},
      {"dns:///decode", "missing port after name"},
      {"dns:///decode:70000", "port 70000 out of range"},
      {"dns:///[::1]:7000", "needs a host name"},
      {"dns://ns.example/decode:7000", "name server 'ns.example' must be an IPv4 or [IPv6] literal"},
      {"dns://10.0.0.2:0/decode:7000", "port 0 out of range"},
      {"dns://10.0.0.2:/decode:7000", "missing port after name server"},
      {"dns://[fd00::53/decode:7000", "unclosed '[' in name server"},
  };
  for (const BadCase& c : cases) {
    absl::StatusOr<WorkerTarget> t = ParseWorkerTarget(c.spec);
    ASSERT_FALSE(t.ok()) << c.spec;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    EXPECT_THAT(t.status().message(), HasSubstr(c.message)) << c.spec;
    EXPECT_THAT(t.status().message(), HasSubstr(absl::StrCat("'", c.spec, "'"))) << c.spec;
  }
}

TEST(DiscoveryResolveTest, FixedTargetIsUsedAsIs) {
  for (const char* spec : {"worker-1.invalid:50051", "127.0.0.1:9", "[::1]:9"}) {
    absl::StatusOr<WorkerTarget> t = ParseWorkerTarget(spec);
    ASSERT_TRUE(t.ok()) << t.status();
    absl::StatusOr<std::vector<std::string>> a = ResolveWorkerTarget(*t, kTimeout);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_THAT(*a, ElementsAre(spec));
  }
}

TEST(DiscoveryResolveTest, SystemResolverFindsLocalhost) {
  absl::StatusOr<WorkerTarget> t = ParseWorkerTarget("dns:///localhost:7000");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::vector<std::string>> a = ResolveWorkerTarget(*t, kTimeout);
  ASSERT_TRUE(a.ok()) << a.status();
  // /etc/hosts may or may not list ::1 for localhost.
  EXPECT_THAT(*a, AnyOf(ElementsAre("127.0.0.1:7000"), ElementsAre("127.0.0.1:7000", "[::1]:7000"),
                        ElementsAre("[::1]:7000", "127.0.0.1:7000")));
  EXPECT_NE(std::find(a->begin(), a->end(), "127.0.0.1:7000"), a->end());
}

// A loopback UDP socket that is open but never answers.
class SilentServer {
 public:
  SilentServer() {
    fd_ = socket(AF_INET, SOCK_DGRAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), len);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~SilentServer() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

absl::StatusOr<std::vector<std::string>> Resolve(const std::string& spec) {
  absl::StatusOr<WorkerTarget> t = ParseWorkerTarget(spec);
  if (!t.ok()) return t.status();
  return ResolveWorkerTarget(*t, kTimeout);
}

TEST(DiscoveryResolveTest, SilentServerIsUnavailableWithinTimeout) {
  SilentServer silent;
  const std::string spec = absl::StrCat("dns://127.0.0.1:", silent.port(), "/decode.pdserve.test:7000");
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<std::string>> a = Resolve(spec);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(a.status().code(), absl::StatusCode::kUnavailable) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr(spec));
  EXPECT_LT(took, absl::Seconds(5));
}

TEST(DiscoveryResolveTest, NothingListeningIsUnavailable) {
  int port = 0;
  {
    SilentServer closed_after;
    port = closed_after.port();
  }
  for (const std::string& server : {absl::StrCat("127.0.0.1:", port), absl::StrCat("[::1]:", port)}) {
    const std::string spec = absl::StrCat("dns://", server, "/decode.pdserve.test:7000");
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<std::string>> a = Resolve(spec);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kUnavailable) << a.status();
    EXPECT_THAT(a.status().message(), HasSubstr(spec));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << spec;
  }
}

class DiscoveryDnsmasqTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing_support::DnsmasqAvailable()) {
      GTEST_SKIP() << "dnsmasq not installed (/usr/sbin/dnsmasq; deploy/bootstrap.sh installs dnsmasq-base)";
    }
    char tmpl[] = "/tmp/pdserve_dnsmasq_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ASSERT_TRUE(dns_.Start(dir_).ok());
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  std::string Spec(const std::string& name, int port) const {
    return absl::StrCat("dns://", dns_.server(), "/", name, ":", port);
  }

  std::string dir_;
  testing_support::Dnsmasq dns_;
};

TEST_F(DiscoveryDnsmasqTest, FollowsTheRecordsAsTheyChange) {
  const std::string spec = Spec("prefill.pdserve.test", 7000);
  ASSERT_TRUE(
      dns_.SetHosts({{"prefill.pdserve.test", {"127.0.0.12", "127.0.0.11"}}, {"decode.pdserve.test", {"127.0.0.99"}}})
          .ok());
  absl::StatusOr<std::vector<std::string>> a = Resolve(spec);
  ASSERT_TRUE(a.ok()) << a.status() << "\n" << dns_.LogTail();
  EXPECT_THAT(*a, ElementsAre("127.0.0.11:7000", "127.0.0.12:7000"));

  ASSERT_TRUE(dns_.SetHosts({{"prefill.pdserve.test", {"127.0.0.11", "127.0.0.12", "127.0.0.13"}}}).ok());
  a = Resolve(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(*a, ElementsAre("127.0.0.11:7000", "127.0.0.12:7000", "127.0.0.13:7000"));

  ASSERT_TRUE(dns_.SetHosts({{"prefill.pdserve.test", {"127.0.0.13"}}}).ok());
  a = Resolve(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(*a, ElementsAre("127.0.0.13:7000"));
}

TEST_F(DiscoveryDnsmasqTest, ReturnsIpv6RecordsBracketed) {
  ASSERT_TRUE(dns_.SetHosts({{"decode.pdserve.test", {"127.0.0.21", "::1"}}}).ok());
  absl::StatusOr<std::vector<std::string>> a = Resolve(Spec("decode.pdserve.test", 7001));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(*a, ElementsAre("127.0.0.21:7001", "[::1]:7001"));
}

TEST_F(DiscoveryDnsmasqTest, ConcurrentResolvesAgree) {
  ASSERT_TRUE(dns_.SetHosts({{"decode.pdserve.test", {"127.0.0.22", "127.0.0.21"}}}).ok());
  const std::string spec = Spec("decode.pdserve.test", 7001);
  std::vector<std::thread> threads;
  std::vector<int> ok(8, 0);
  for (int& count : ok) {
    threads.emplace_back([&spec, &count] {
      for (int i = 0; i < 20; ++i) {
        absl::StatusOr<std::vector<std::string>> a = Resolve(spec);
        if (a.ok() && *a == std::vector<std::string>{"127.0.0.21:7001", "127.0.0.22:7001"}) ++count;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_THAT(ok, ::testing::Each(20));
}

TEST_F(DiscoveryDnsmasqTest, UnknownNameIsNotFound) {
  ASSERT_TRUE(dns_.SetHosts({{"decode.pdserve.test", {"127.0.0.21"}}}).ok());
  const std::string spec = Spec("missing.pdserve.test", 7001);
  absl::StatusOr<std::vector<std::string>> a = Resolve(spec);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr(spec));
}

}  // namespace
}  // namespace pdserve::router
