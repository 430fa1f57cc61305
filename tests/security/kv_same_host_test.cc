// Same host is decided from the socket, never from the peer's bytes.
//
// A worker that sends its boot id in a hello and takes a peer that echoes
// it back for one on its own machine hands that peer the pool's remote key
// (read and write of the whole pool); and a worker that cannot read its
// boot id sends 36 '?', which anyone can echo. So the KV transport decides
// from the accepted socket as the kernel sees it: a
// loopback peer, or one whose address is the very address it reached. A
// peer in another network namespace (standing for another host), joined by
// a veth pair, gets the pool's base address alone, whatever it sends, and
// its writes outside its reservation are refused and counted; a loopback
// peer of the same worker is offered direct writes.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/wire.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/kv_raw_peer.h"

namespace pdserve {
namespace {

constexpr char kPrefix[] = "pdsh";

bool Sh(const std::string& script, const std::string& log) {
  return std::system(absl::StrCat("(", script, ") >>", log, " 2>&1").c_str()) == 0;
}

class KvSameHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    const pid_t pid = getpid();
    ns_ = absl::StrCat(kPrefix, "-", pid);
    root_dev_ = absl::StrCat(kPrefix, pid, "r");
    const std::string ns_dev = absl::StrCat(kPrefix, pid, "n");
    const std::string net = absl::StrCat("10.78.", pid % 250 + 1, ".");
    root_ip_ = net + "1";
    peer_ip_ = net + "2";
    log_ = TempDir() + "/netns.log";
    const std::string in = "ip -n " + ns_ + " ";
    created_ = true;
    if (!Sh(absl::StrCat("set -e; ip netns add ", ns_, "; ", in, "link set lo up; ip link add ", root_dev_,
                         " type veth peer name ", ns_dev, " netns ", ns_, "; ip addr add ", root_ip_, "/24 dev ",
                         root_dev_, "; ip link set ", root_dev_, " up; ", in, "addr add ", peer_ip_, "/24 dev ",
                         ns_dev, "; ", in, "link set ", ns_dev, " up"),
            log_)) {
      GTEST_SKIP() << "cannot create a network namespace with a veth pair here (ip netns): " << log_;
    }
  }
  void TearDown() override {
    if (created_) Sh(absl::StrCat("ip netns del ", ns_, "; ip link del ", root_dev_), "/dev/null");
  }

  // Connects `transport` to host:port from inside the namespace: the
  // socket is made on a thread that joined it, and stays there.
  kv::Connection* ConnectFromNamespace(kv::Transport& transport, kv::ConnectionHandler* handler, const std::string& host,
                                       int port) {
    absl::StatusOr<kv::Connection*> conn = absl::UnknownError("not run");
    std::thread([&] {
      const int fd = open(absl::StrCat("/var/run/netns/", ns_).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
        conn = absl::InternalError("setns");
      } else {
        conn = transport.Connect(host, port, handler);
      }
      if (fd >= 0) close(fd);
    }).join();
    EXPECT_TRUE(conn.ok()) << conn.status();
    return conn.ok() ? *conn : nullptr;
  }

  std::string ns_, root_dev_, root_ip_, peer_ip_, log_;
  bool created_ = false;
};

TEST_F(KvSameHostTest, APeerFromAnotherNetworkGetsNoDirectWritesWhateverItSays) {
  DecodeUnderTest decode;
  ASSERT_TRUE(decode.Start({"--kv_host", root_ip_, "--kv_lease_s", "30"}).ok()) << decode.process.LogTail();
  const kv::GrantKey key = *kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");

  // The remote peer: it opens with a message of the old hello's shape (a
  // boot id of '?'), which the worker takes for a malformed message.
  std::unique_ptr<kv::Transport> transport = TestTransport("remote-peer", PeerTransport::kTcp);
  ASSERT_NE(transport, nullptr);
  Raw raw;
  kv::Connection* conn = ConnectFromNamespace(*transport, &raw, root_ip_, decode.kv_port);
  ASSERT_NE(conn, nullptr);
  transport->loop().RunSync([&] { conn->Send(std::string(36, '?')); });
  kv::ReserveRequest req;
  req.num_positions = 4;
  req.prompt_tokens = {1, 2, 3, 4};
  transport->loop().RunSync([&] { conn->Send(kv::Encode(req)); });
  std::optional<kv::ReserveReply> first = raw.Await<kv::ReserveReply>();
  ASSERT_TRUE(first.has_value());
  req.sender = first->receiver;
  req.tag = 2;
  req.grant = kv::EncodeGrant(
      TestGrant(key, "req-remote", 1, peer_ip_, decode.kv_address, absl::Now() + absl::Seconds(60)));
  transport->loop().RunSync([&] { conn->Send(kv::Encode(req)); });
  std::optional<kv::ReserveReply> r = raw.Await<kv::ReserveReply>();
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  EXPECT_EQ(r->region.size(), sizeof(uint64_t)) << "a peer from another network was offered direct writes";

  // Its writes outside its own blocks are frames the receiver refuses.
  const double refused = decode.Refusals("put_outside_reservation");
  auto region = transport->loop().RunSync([&] { return conn->ImportRegion(r->region); });
  ASSERT_TRUE(region.ok()) << region.status();
  const int64_t block_bytes = r->receiver.ToSpec(r->num_blocks).LayerBlockBytes();
  int32_t foreign = 0;
  while (std::find(r->blocks.begin(), r->blocks.end(), foreign) != r->blocks.end()) ++foreign;
  std::vector<char> bytes(static_cast<size_t>(block_bytes), 9);
  transport->loop().RunSync([&] {
    conn->Put(bytes.data(), block_bytes, **region, static_cast<int64_t>(foreign) * block_bytes, nullptr);
  });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (decode.Refusals("put_outside_reservation") < refused + 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(decode.Refusals("put_outside_reservation"), refused + 1);

  // A peer of this host's own network stack (it reaches the worker's
  // address from that same address) is offered direct writes.
  std::unique_ptr<kv::Transport> local = TestTransport("local-peer", PeerTransport::kTcp);
  ASSERT_NE(local, nullptr);
  Raw local_raw;
  absl::StatusOr<kv::Connection*> lc = local->Connect(root_ip_, decode.kv_port, &local_raw);
  ASSERT_TRUE(lc.ok()) << lc.status();
  req.tag = 3;
  req.grant = kv::EncodeGrant(
      TestGrant(key, "req-local", 1, root_ip_, decode.kv_address, absl::Now() + absl::Seconds(60)));
  local->loop().RunSync([&] { (*lc)->Send(kv::Encode(req)); });
  std::optional<kv::ReserveReply> lr = local_raw.Await<kv::ReserveReply>();
  ASSERT_TRUE(lr.has_value());
  ASSERT_EQ(lr->code, 0) << lr->message;
  EXPECT_GT(lr->region.size(), sizeof(uint64_t)) << "a peer on this host was not offered direct writes";

  transport->loop().RunSync([&] { region->reset(); });
  local.reset();
  transport.reset();
  decode.process.Kill();
}

}  // namespace
}  // namespace pdserve
