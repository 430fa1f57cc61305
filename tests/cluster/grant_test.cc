// KV handoff grants against a real decode worker over UCX: a reservation
// without a grant, with an expired one, with one naming another sender host
// or minted with another key, and one already used for its attempt are
// refused; a commit from another connection and one naming another request
// are refused; each is counted in pdserve_handoff_refusals_total{reason}; a
// valid grant still reserves, and a committed request's KV is unchanged,
// byte for byte, through all of it. A prefill worker's prefix pull
// receiver holds to the same grants.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <cstring>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/ucx_transport.h"
#include "kv_transfer/wire.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/kv_raw_peer.h"

namespace pdserve {
namespace {

TEST(GrantClusterTest, ADecodeWorkerRefusesEveryHandoffItsGrantDoesNotCoverAndCountsIt) {
  // Over UCX (--kv_transport=ucx) and shared memory, where the pool's
  // remote key lets the test read the victim's blocks back.
  DecodeUnderTest decode;
  ASSERT_TRUE(decode.Start({"--kv_lease_s", "30", "--kv_transport", "ucx"}).ok()) << decode.process.LogTail();
  const std::string kv_address = decode.kv_address;
  const int kv_port = decode.kv_port;
  absl::StatusOr<kv::GrantKey> key = kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");
  ASSERT_TRUE(key.ok()) << key.status();
  const kv::GrantKey other = *kv::GrantKey::FromBytes(std::string(32, 'x'));
  auto grant = [&](const std::string& request, uint32_t attempt, absl::Duration ttl,
                   const std::string& sender = "127.0.0.1", const kv::GrantKey* k = nullptr) {
    return kv::EncodeGrant(
        TestGrant(k != nullptr ? *k : *key, request, attempt, sender, kv_address, absl::Now() + ttl));
  };

  std::unique_ptr<kv::UcxTransport> owned = TestUcxTransport("grant-test", false);
  ASSERT_NE(owned, nullptr);
  std::unique_ptr<kv::UcxTransport>* transport = &owned;
  Raw raw;
  absl::StatusOr<kv::Connection*> conn = (*transport)->Connect("127.0.0.1", kv_port, &raw);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto send = [&](kv::Connection* c, const Message& m) { (*transport)->loop().RunSync([&] { c->Send(kv::Encode(m)); }); };
  kv::ReserveRequest req;
  req.num_positions = 4;
  req.prompt_tokens = {1, 2, 3, 4};
  auto reserve = [&](uint64_t tag, std::string g) {
    req.tag = tag;
    req.grant = std::move(g);
    send(*conn, req);
    std::optional<kv::ReserveReply> r = raw.Await<kv::ReserveReply>();
    EXPECT_TRUE(r.has_value()) << "no answer to reservation " << tag;
    return r.value_or(kv::ReserveReply{});
  };
  const int32_t denied = static_cast<int32_t>(absl::StatusCode::kPermissionDenied);

  // Without a grant: refused before anything else (the answer carries the
  // receiver's layout, which the later reservations then present).
  kv::ReserveReply r = reserve(1, "");
  EXPECT_EQ(r.code, denied) << r.message;
  EXPECT_NE(r.message.find("no grant"), std::string::npos) << r.message;
  req.sender = r.receiver;

  // A request handed off properly first (a pattern put into its blocks,
  // committed): its KV must not change, byte for byte, through every
  // refused attempt below. Over shared memory (this machine) the answer
  // carries the pool's remote key, which reads the blocks back.
  kv::ReserveReply legit = reserve(10, grant("req-0", 1, absl::Seconds(60)));
  ASSERT_EQ(legit.code, 0) << legit.message;
  ASSERT_GT(legit.region.size(), sizeof(uint64_t)) << "no remote key for a peer on this machine";
  kv::UcxTransport* t = transport->get();
  const int64_t block_bytes = legit.receiver.ToSpec(legit.num_blocks).LayerBlockBytes();
  absl::StatusOr<std::shared_ptr<kv::RemoteRegion>> region =
      t->loop().RunSync([&] { return (*conn)->ImportRegion(legit.region); });
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<char> pattern(static_cast<size_t>(block_bytes));
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<char>(i % 251);
  {
    std::promise<absl::Status> flushed;
    t->loop().RunSync([&] {
      for (int32_t b : legit.blocks) {
        (*conn)->Put(pattern.data(), block_bytes, **region, static_cast<int64_t>(b) * block_bytes, nullptr);
      }
      (*conn)->Flush([&](absl::Status s) { flushed.set_value(s); });
    });
    auto f = flushed.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    ASSERT_TRUE(f.get().ok());
  }
  send(*conn, FourPositionCommit(legit.id, "req-0"));
  std::optional<kv::CommitReply> ok = raw.Await<kv::CommitReply>();
  ASSERT_TRUE(ok.has_value());
  ASSERT_EQ(ok->code, 0) << ok->message;
  ucp_rkey_h rkey = nullptr;
  ucp_ep_h ep = t->loop().RunSync([&] { return t->EndpointOf(*conn); });
  ASSERT_EQ(t->loop().RunSync([&] { return ucp_ep_rkey_unpack(ep, legit.region.data() + sizeof(uint64_t), &rkey); }),
            UCS_OK);
  uint64_t base = 0;
  std::memcpy(&base, legit.region.data(), sizeof(base));
  auto read_back = [&] {
    std::vector<char> all;
    for (int32_t b : legit.blocks) {
      std::vector<char> got(pattern.size(), 0);
      ucp_request_param_t p{};
      ucs_status_ptr_t q = t->loop().RunSync([&] {
        return ucp_get_nbx(ep, got.data(), got.size(), base + static_cast<uint64_t>(b) * block_bytes, rkey, &p);
      });
      ucs_status_t s = UCS_PTR_IS_ERR(q) ? UCS_PTR_STATUS(q) : (q == nullptr ? UCS_OK : UCS_INPROGRESS);
      const absl::Time until = absl::Now() + absl::Seconds(10);
      while (s == UCS_INPROGRESS && absl::Now() < until) {
        s = t->loop().RunSync([&] {
          ucp_worker_progress(t->worker());
          return ucp_request_check_status(q);
        });
      }
      if (q != nullptr && !UCS_PTR_IS_ERR(q)) t->loop().RunSync([&] { ucp_request_free(q); });
      EXPECT_EQ(s, UCS_OK) << ucs_status_string(s);
      all.insert(all.end(), got.begin(), got.end());
    }
    return all;
  };
  const std::vector<char> before = read_back();
  ASSERT_EQ(before.size(), pattern.size() * legit.blocks.size());
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.end(), before.begin())) << "the handoff did not land";

  r = reserve(2, grant("req-1", 1, absl::Seconds(-1)));
  EXPECT_EQ(r.code, denied);
  EXPECT_NE(r.message.find("expired"), std::string::npos) << r.message;
  r = reserve(3, grant("req-1", 1, absl::Seconds(60), "10.9.9.9"));
  EXPECT_EQ(r.code, denied);
  EXPECT_NE(r.message.find("10.9.9.9"), std::string::npos) << r.message;
  r = reserve(4, grant("req-1", 1, absl::Seconds(60), "127.0.0.1", &other));
  EXPECT_EQ(r.code, denied);
  // The router's grant: honoured once.
  const std::string good = grant("req-1", 1, absl::Seconds(60));
  kv::ReserveReply granted = reserve(5, good);
  ASSERT_EQ(granted.code, 0) << granted.message;
  r = reserve(6, good);
  EXPECT_EQ(r.code, denied);
  EXPECT_NE(r.message.find("used before"), std::string::npos) << r.message;

  // Its commit from another connection, then naming another request.
  kv::Commit commit = FourPositionCommit(granted.id, "req-1");
  Raw other_raw;
  absl::StatusOr<kv::Connection*> intruder = (*transport)->Connect("127.0.0.1", kv_port, &other_raw);
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  send(*intruder, commit);
  std::optional<kv::CommitReply> cr = other_raw.Await<kv::CommitReply>();
  ASSERT_TRUE(cr.has_value());
  EXPECT_EQ(cr->code, static_cast<int32_t>(absl::StatusCode::kNotFound)) << cr->message;
  commit.request_id = "req-2";
  send(*conn, commit);
  cr = raw.Await<kv::CommitReply>();
  ASSERT_TRUE(cr.has_value());
  EXPECT_EQ(cr->code, denied) << cr->message;
  send(*conn, kv::Abort{granted.id, static_cast<int32_t>(absl::StatusCode::kCancelled), "test done"});

  EXPECT_EQ(read_back(), before) << "a refused handoff changed another request's KV";
  t->loop().RunSync([&] { ucp_rkey_destroy(rkey); });
  region->reset();

  auto refusals = [&](const std::string& reason) { return decode.Refusals(reason); };
  EXPECT_EQ(refusals("missing"), 1);
  EXPECT_EQ(refusals("expired"), 1);
  EXPECT_EQ(refusals("wrong_sender"), 1);
  EXPECT_EQ(refusals("bad_mac"), 1);
  EXPECT_EQ(refusals("reused"), 1);
  EXPECT_EQ(refusals("commit_other_connection"), 1);
  EXPECT_EQ(refusals("commit_other_request"), 1);
  EXPECT_EQ(refusals("wrong_receiver"), 0);
  transport->reset();
  decode.process.Kill();
}

// Over TCP the receiver fetches each put's bytes itself, so it writes only
// into the blocks an active reservation of the same connection is to
// receive: a put into another block, and one after the lease expired, are
// dropped and counted (put_outside_reservation); a put into its own
// reserved block is not.
TEST(GrantClusterTest, OverTcpAPutOutsideALiveReservationIsDropped) {
  DecodeUnderTest decode;
  // As for a peer on another host: no direct writes, every put a frame.
  ASSERT_TRUE(decode.Start({"--kv_lease_s", "1", "--kv_direct_writes=false"}).ok()) << decode.process.LogTail();
  const std::string kv_address = decode.kv_address;
  const kv::GrantKey key = *kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");

  RawPeer peer;
  ASSERT_NO_FATAL_FAILURE(peer.Start(decode, "grant-tcp-test"));
  std::optional<kv::ReserveReply> r = peer.Reserve(
      2, kv::EncodeGrant(TestGrant(key, "req-tcp", 1, "127.0.0.1", kv_address, absl::Now() + absl::Seconds(60))));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  kv::Transport* transport = peer.transport.get();
  kv::Connection* conn = peer.conn;
  Raw& raw = peer.raw;
  ASSERT_FALSE(r->blocks.empty());
  const int64_t block_bytes = r->receiver.ToSpec(r->num_blocks).LayerBlockBytes();
  absl::StatusOr<std::shared_ptr<kv::RemoteRegion>> region =
      transport->loop().RunSync([&] { return conn->ImportRegion(r->region); });
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<char> bytes(static_cast<size_t>(block_bytes), 7);
  auto put = [&](int32_t block) {
    transport->loop().RunSync([&] {
      conn->Put(bytes.data(), block_bytes, **region, static_cast<int64_t>(block) * block_bytes, nullptr);
    });
  };
  auto dropped = [&] {
    return decode.Refusals("put_outside_reservation");
  };
  int32_t foreign = 0;
  while (std::find(r->blocks.begin(), r->blocks.end(), foreign) != r->blocks.end()) ++foreign;
  put(r->blocks[0]);  // Its own block: written.
  put(foreign);       // Another block: dropped.
  absl::Time until = absl::Now() + absl::Seconds(10);
  while (dropped() < 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(dropped(), 1);
  // The lease (1 s) runs out: the receiver aborts; a put now is dropped too.
  std::optional<kv::Abort> abort = raw.Await<kv::Abort>();
  ASSERT_TRUE(abort.has_value());
  put(r->blocks[0]);
  until = absl::Now() + absl::Seconds(10);
  while (dropped() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(dropped(), 2);
  region->reset();  // Its remote key goes before the worker it was unpacked on.
  peer.transport.reset();
  decode.process.Kill();
}

// With --kv_transport=ucx the remote key of the decode worker's pool goes
// only to a peer on its machine with shared memory between them (one-sided
// puts). Over UCX's tcp transport a reservation's answer carries the base
// address alone: with the key a peer could read and write the whole pool
// with plain UCX get/put (software RMA served inside the target's
// progress, around the receiver's write check).
TEST(GrantClusterTest, OverUcxTcpNoRemoteKeyIsHandedOut) {
  DecodeUnderTest decode;
  ASSERT_TRUE(decode.Start({"--kv_transport", "ucx"}, {{"UCX_TLS", "tcp"}}).ok()) << decode.process.LogTail();
  const std::string kv_address = decode.kv_address;
  const kv::GrantKey key = *kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");
  RawPeer peer;
  ASSERT_NO_FATAL_FAILURE(peer.Start(decode, "rkey-test", PeerTransport::kUcxTcpOnly));  // No shared-memory puts.
  std::optional<kv::ReserveReply> r = peer.Reserve(
      2, kv::EncodeGrant(TestGrant(key, "req-rkey", 1, "127.0.0.1", kv_address, absl::Now() + absl::Seconds(60))));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  kv::Transport* transport = peer.transport.get();
  kv::Connection* conn = peer.conn;
  Raw& raw = peer.raw;
  auto send = [&](const Message& m) { peer.Send(m); };
  EXPECT_EQ(r->region.size(), sizeof(uint64_t)) << "a remote key went to a peer that writes by message";
  // The handoff still works by message: a put into its own block is
  // written (not counted as refused), and the commit is taken.
  absl::StatusOr<std::shared_ptr<kv::RemoteRegion>> region =
      transport->loop().RunSync([&] { return conn->ImportRegion(r->region); });
  ASSERT_TRUE(region.ok()) << region.status();
  const int64_t block_bytes = r->receiver.ToSpec(r->num_blocks).LayerBlockBytes();
  std::vector<char> bytes(static_cast<size_t>(block_bytes), 3);
  std::promise<absl::Status> put_done;
  transport->loop().RunSync([&] {
    conn->Put(bytes.data(), block_bytes, **region, static_cast<int64_t>(r->blocks[0]) * block_bytes,
                 [&](absl::Status s) { put_done.set_value(s); });
  });
  auto fut = put_done.get_future();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_TRUE(fut.get().ok());
  send(FourPositionCommit(r->id, "req-rkey"));
  std::optional<kv::CommitReply> cr = raw.Await<kv::CommitReply>();
  ASSERT_TRUE(cr.has_value());
  EXPECT_EQ(cr->code, 0) << cr->message;
  EXPECT_EQ(decode.Refusals("put_outside_reservation"), 0);
  region->reset();
  peer.transport.reset();
  decode.process.Kill();
}

// A TLS decode worker without a grant key does not start.
// A prefill worker's pull receiver (where other prefill workers send the
// prefixes it pulls) takes a reservation only under a grant the router
// minted for it: none, or one for another receiver, is refused and
// counted; the right one reserves.
TEST(GrantClusterTest, APrefillWorkersPullReceiverRefusesAPullWithoutItsGrant) {
  Cluster c;
  const std::string dir = TempDir();
  ASSERT_TRUE(c.Start(dir, false).ok()) << c.Logs();
  const int grpc_port = ReadyPort(dir + "/prefill0.ready", "grpc_port");
  auto stub = worker::v1::PrefillWorker::NewStub(TestChannel(absl::StrCat("127.0.0.1:", grpc_port), "prefill"));
  grpc::ClientContext ctx;
  worker::v1::WorkerInfo info;
  ASSERT_TRUE(stub->Status(&ctx, {}, &info).ok());
  const std::string pull_address = info.kv_address();
  ASSERT_FALSE(pull_address.empty()) << "no pull receiver";
  const int pull_port = std::stoi(pull_address.substr(pull_address.rfind(':') + 1));
  const int metrics = MetricsPort(dir + "/prefill0.ready");
  auto refusals = [&](const std::string& reason) {
    return MetricValue(HttpGet(metrics, "/metrics"), absl::StrCat("pdserve_handoff_refusals_total{reason=\"", reason,
                                                                  "\"}"));
  };
  const kv::GrantKey key = *kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");

  RawPeer peer;
  ASSERT_NO_FATAL_FAILURE(peer.Start(pull_port, "pull-grant-test"));  // Its first reservation has no grant.
  EXPECT_EQ(refusals("missing"), 1);
  std::optional<kv::ReserveReply> r = peer.Reserve(
      2, kv::EncodeGrant(TestGrant(key, "pull-1", 1, "127.0.0.1", "127.0.0.1:1", absl::Now() + absl::Seconds(60))));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied)) << r->message;
  EXPECT_EQ(refusals("wrong_receiver"), 1);
  r = peer.Reserve(
      3, kv::EncodeGrant(TestGrant(key, "pull-2", 1, "127.0.0.1", pull_address, absl::Now() + absl::Seconds(60))));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, 0) << r->message;
  peer.Send(kv::Abort{r->id, 0, "test done"});
  ASSERT_TRUE(peer.raw.Await<kv::AbortAck>().has_value());
  peer.transport.reset();
}

TEST(GrantClusterTest, ATlsDecodeWorkerWithoutAGrantKeyDoesNotStart) {
  const std::string dir = TempDir();
  const TlsFiles f = TestTls("decode");
  Subprocess decode;
  ASSERT_TRUE(decode
                  .Start({kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel, "--tls_cert", f.cert,
                          "--tls_key", f.key, "--tls_ca", f.ca},
                         dir + "/decode.log")
                  .ok());
  EXPECT_EQ(decode.Wait(absl::Seconds(60)), 2);
  EXPECT_NE(decode.LogTail().find("--kv_grant_key"), std::string::npos) << decode.LogTail();
}

}  // namespace
}  // namespace pdserve
