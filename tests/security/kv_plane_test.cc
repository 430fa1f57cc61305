// Attacks on the KV plane by a peer that holds a grant for one handoff (a
// compromised prefill worker) or none: against a real decode worker over
// its KV transport, except the landing-write check, which needs an abort to fall between
// a write's check and its last byte and so drives the receiver directly.
//
// Each attack below names the opening it would use, and must fail with a
// refusal counted in pdserve_handoff_refusals_total{reason}, leaving the
// victim's KV as it was.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kv/block_hash.h"
#include "kv/kv_manager.h"
#include "gtest/gtest.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/layout_copy.h"
#include "kv_transfer/loopback_transport.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/wire.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/kv_raw_peer.h"

namespace pdserve {
namespace {

// `n` token ids from `first` on.
std::vector<int32_t> Ids(int32_t n, int32_t first) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = first + i;
  return ids;
}

struct Attack {
  DecodeUnderTest decode;
  std::optional<kv::GrantKey> key;  // The cluster's, from Start.
  RawPeer peer;

  void Start(std::vector<std::string> flags) {
    ASSERT_TRUE(decode.Start(std::move(flags)).ok()) << decode.process.LogTail();
    absl::StatusOr<kv::GrantKey> k = kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");
    ASSERT_TRUE(k.ok()) << k.status();
    key.emplace(*std::move(k));
    ASSERT_NO_FATAL_FAILURE(peer.Start(decode, "kv-attack"));
  }
  // The router's grant for handing off `context` with `room` positions
  // beyond it.
  std::string Grant(const std::string& request, const std::vector<int32_t>& context, int32_t room = 16,
                    absl::Duration ttl = absl::Seconds(60)) {
    return kv::EncodeGrant(*kv::MintGrant(*key, {.request_id = request,
                                                .attempt = 1,
                                                .sender = "127.0.0.1",
                                                .receiver = decode.kv_address,
                                                .expires = absl::Now() + ttl,
                                                .positions = static_cast<int32_t>(context.size()) + room,
                                                .tokens_digest = kv::DigestTokens(context)}));
  }
  std::optional<kv::ReserveReply> Reserve(uint64_t tag, const std::vector<int32_t>& context, std::string grant,
                                          int32_t margin = 0) {
    peer.req.num_positions = static_cast<int32_t>(context.size());
    peer.req.margin_positions = margin;
    peer.req.prompt_tokens = context;
    return peer.Reserve(tag, std::move(grant));
  }
  std::optional<kv::CommitReply> Commit(kv::HandoffId id, const std::string& request,
                                        const std::vector<int32_t>& tokens) {
    kv::Commit c;
    c.id = id;
    c.request_id = request;
    c.num_positions = static_cast<int32_t>(tokens.size());
    c.tokens = tokens;
    c.first_token = 5;
    peer.Send(c);
    return peer.raw.Await<kv::CommitReply>();
  }
  ~Attack() {
    peer.transport.reset();
    decode.process.Kill();
  }
};

constexpr int32_t kDenied = static_cast<int32_t>(absl::StatusCode::kPermissionDenied);

// Remote memory access without a grant. UCX's tcp transport serves puts
// and gets at whatever address a peer names, checked only against a remote
// key the peer can forge: on a KV port that is UCX's, with UCX_TLS=tcp, a
// put outside any reservation lands in the pool, and a raw UCX client
// needs no grant at all. So the port speaks the TCP transport's frames
// (kv_transfer/tcp_transport.h): it has no read
// operation, a UCX client is dropped at its first bytes, and every data
// frame is judged by the receiver, which writes it only into blocks a live
// reservation of the same connection is to receive. The attack here, while
// a victim's request decodes from that pool (and its prompt's blocks sit
// in the prefix cache): a UCX client, then a peer holding a grant for one
// handoff of its own spraying every other block of every layer, and
// addresses outside the pool, from its granted connection and from one
// with no reservation. Every frame is refused and counted, and the
// victim's stream is the one the undisturbed cluster gave, token for token.
TEST(KvPlaneSecurityTest, NoPeerWritesTheDecodeWorkersPoolOutsideItsOwnReservation) {
  const std::string dir = TempDir() + "/cluster";
  Cluster c;
  // The attacker stands for a peer on another host, which never gets
  // direct writes; on this host it would (the same user may write the
  // worker's memory anyway), so the worker here offers them to no one.
  ASSERT_TRUE(c.Start(dir, /*colocated=*/false, {"--kv_direct_writes=false"}).ok()) << c.Logs();
  v1::GenerateRequest victim_request = SeededRequest(48);
  const Output want = c.Generate(victim_request);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message() << c.Logs();

  auto stub = worker::v1::DecodeWorker::NewStub(TestChannel(c.decode_address(), "decode"));
  grpc::ClientContext ctx;
  worker::v1::WorkerInfo info;
  ASSERT_TRUE(stub->Status(&ctx, {}, &info).ok());
  const std::string kv_address = info.kv_address();
  const int kv_port = std::stoi(kv_address.substr(kv_address.rfind(':') + 1));
  const int metrics_port = MetricsPort(dir + "/decode0.ready");
  auto refusals = [&] {
    return MetricValue(HttpGet(metrics_port, "/metrics"),
                       "pdserve_handoff_refusals_total{reason=\"put_outside_reservation\"}");
  };
  const double refused_before = refusals();

  // A UCX client over tcp: no answer, ever.
  {
    Raw ucx_raw;
    std::unique_ptr<kv::UcxTransport> ucx = TestUcxTransport("attacker-ucx", /*tcp_only=*/true);
    ASSERT_NE(ucx, nullptr);
    absl::StatusOr<kv::Connection*> uc = ucx->Connect("127.0.0.1", kv_port, &ucx_raw);
    ASSERT_TRUE(uc.ok()) << uc.status();
    kv::ReserveRequest probe;
    probe.num_positions = 4;
    probe.prompt_tokens = {1, 2, 3, 4};
    ucx->loop().RunSync([&] { (*uc)->Send(kv::Encode(probe)); });
    absl::SleepFor(absl::Seconds(2));
    EXPECT_FALSE(ucx_raw.Any()) << "a UCX client was answered";
    ucx.reset();
  }

  // An insider: a grant for a handoff of its own (which tells it the
  // pool's base address and layout), on the workers' transport.
  const kv::GrantKey key = *kv::GrantKey::FromFile(TestCertsDir() + "/kv_grant.key");
  DecodeUnderTest target;
  target.kv_port = kv_port;
  target.kv_address = kv_address;
  RawPeer peer;
  ASSERT_NO_FATAL_FAILURE(peer.Start(target, "attacker-tcp"));
  std::optional<kv::ReserveReply> own = peer.Reserve(
      2, kv::EncodeGrant(TestGrant(key, "attacker-own", 1, "127.0.0.1", kv_address, absl::Now() + absl::Seconds(60))));
  ASSERT_TRUE(own.has_value());
  ASSERT_EQ(own->code, 0) << own->message;
  ASSERT_EQ(own->region.size(), sizeof(uint64_t)) << "a remote key went to a peer that writes by message";
  Raw bare_raw;
  absl::StatusOr<kv::Connection*> bare = peer.transport->Connect("127.0.0.1", kv_port, &bare_raw);
  ASSERT_TRUE(bare.ok()) << bare.status();
  kv::Transport* t = peer.transport.get();
  auto granted_region = t->loop().RunSync([&] { return peer.conn->ImportRegion(own->region); });
  auto bare_region = t->loop().RunSync([&] { return (*bare)->ImportRegion(own->region); });
  ASSERT_TRUE(granted_region.ok() && bare_region.ok());
  const KvCacheSpec spec = own->receiver.ToSpec(own->num_blocks);
  const int64_t block_bytes = spec.LayerBlockBytes();
  std::vector<char> garbage(static_cast<size_t>(block_bytes), static_cast<char>(0x5a));

  // Spray while the victim's request runs (its prompt's blocks are in the
  // prefix cache from the first run; its new blocks are taken as it goes).
  std::atomic<bool> stop{false};
  std::atomic<int64_t> frames{0};
  std::thread spray([&] {
    while (!stop.load()) {
      for (int32_t l = 0; l < spec.num_layers && !stop.load(); ++l) {
        t->loop().RunSync([&] {
          for (int32_t b = 0; b < spec.num_blocks; ++b) {
            if (std::find(own->blocks.begin(), own->blocks.end(), b) != own->blocks.end()) continue;
            const int64_t at = kv::LayerBlockOffset(spec, l, b);
            peer.conn->Put(garbage.data(), block_bytes, **granted_region, at, nullptr);
            (*bare)->Put(garbage.data(), block_bytes, **bare_region, at, nullptr);
            frames += 2;
          }
          // Below the pool, and past its end.
          (*bare)->Put(garbage.data(), block_bytes, **bare_region, -(int64_t{1} << 20), nullptr);
          (*bare)->Put(garbage.data(), block_bytes, **bare_region, spec.TotalBytes(), nullptr);
          frames += 2;
        });
      }
      // Renews the attacker's own lease, so its connection stays a live reservation.
      peer.Send(kv::LayerSent{own->id, 0});
    }
  });
  const Output got = c.Generate(victim_request);
  stop = true;
  spray.join();
  {
    std::promise<void> flushed_granted, flushed_bare;
    t->loop().RunSync([&] {
      peer.conn->Flush([&](absl::Status) { flushed_granted.set_value(); });
      (*bare)->Flush([&](absl::Status) { flushed_bare.set_value(); });
    });
    flushed_granted.get_future().wait();
    flushed_bare.get_future().wait();
  }
  ASSERT_GT(frames.load(), 0);
  EXPECT_EQ(refusals() - refused_before, static_cast<double>(frames.load()))
      << "a frame outside the attacker's own blocks was not refused";
  ExpectUndisturbed(got, want, c);
  t->loop().RunSync([&] {
    granted_region->reset();
    bare_region->reset();
  });
  peer.transport.reset();
}

// Resident memory of process `pid` in KiB (VmRSS), -1 if unreadable.
int64_t RssKib(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    int64_t kib = 0;
    if (absl::StartsWith(line, "VmRSS:") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::StripSuffix(line.substr(6), "kB")), &kib)) {
      return kib;
    }
  }
  return -1;
}

// Connection objects that are never freed: if every connection to the KV
// port stays allocated for the worker's life, a peer that connects and
// disconnects in a loop grows the decode worker without bound. An accepted
// connection is freed once it is over:
// 10,000 connect/disconnect cycles (a tenth of them sending a frame first)
// leave its resident memory where it was after the first 1,000, within 5 %.
TEST(KvPlaneSecurityTest, ConnectDisconnectCyclesLeaveTheDecodeWorkersMemoryFlat) {
  DecodeUnderTest decode;
  ASSERT_TRUE(decode.Start({}).ok()) << decode.process.LogTail();
  auto cycles = [&](int n) {
    for (int i = 0; i < n; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      ASSERT_GE(fd, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(decode.kv_port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << "cycle " << i;
      if (i % 10 == 0) {
        // A control frame (type 1) of 4 bytes that are no handoff message.
        const char frame[12] = {1, 0, 0, 0, 4, 0, 0, 0, 'j', 'u', 'n', 'k'};
        (void)!write(fd, frame, sizeof(frame));
      }
      close(fd);
    }
  };
  ASSERT_NO_FATAL_FAILURE(cycles(1000));
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t before = RssKib(decode.process.pid());
  ASSERT_GT(before, 0);
  ASSERT_NO_FATAL_FAILURE(cycles(10000));
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t after = RssKib(decode.process.pid());
  EXPECT_LE(after, before + before / 20) << "RSS " << before << " KiB -> " << after << " KiB";
  // Still serving handoffs.
  RawPeer peer;
  ASSERT_NO_FATAL_FAILURE(peer.Start(decode, "after-cycles"));
  peer.transport.reset();
  decode.process.Kill();
}

// Prefix-cache poisoning: a sender granted a handoff of its own context
// commits it naming the token ids of another prompt (a popular system
// prompt), so that the decode worker publishes the sender's KV under that
// prompt's block hashes and serves it to every later request that starts
// with it. Were the commit taken, the next reservation of the popular
// prompt would find its first blocks held (held_positions > 0). The commit
// is refused (tokens_mismatch), nothing is published, and so is a
// reservation whose token ids are not the grant's.
TEST(KvPlaneSecurityTest, ACommitCannotPublishKvUnderTokensItsGrantDoesNotName) {
  Attack a;
  ASSERT_NO_FATAL_FAILURE(a.Start({}));
  const int32_t bs = a.peer.req.sender.block_size;
  const std::vector<int32_t> own = Ids(3 * bs + 1, 100);
  const std::vector<int32_t> popular = Ids(3 * bs + 1, 300);

  std::optional<kv::ReserveReply> r = a.Reserve(2, own, a.Grant("req-own", own));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  std::optional<kv::CommitReply> c = a.Commit(r->id, "req-own", popular);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->code, kDenied) << c->message;
  EXPECT_EQ(a.decode.Refusals("tokens_mismatch"), 1);

  // The popular prompt, reserved properly: nothing of it is held.
  std::optional<kv::ReserveReply> victim = a.Reserve(3, popular, a.Grant("req-victim", popular));
  ASSERT_TRUE(victim.has_value());
  ASSERT_EQ(victim->code, 0) << victim->message;
  EXPECT_EQ(victim->held_positions, 0) << "the refused commit's KV was published under the popular prompt";

  // A reservation presenting other ids than its grant's context.
  r = a.Reserve(4, popular, a.Grant("req-own-2", own));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, kDenied) << r->message;
  EXPECT_EQ(a.decode.Refusals("tokens_mismatch"), 2);

  // The grant's own context still commits.
  r = a.Reserve(5, own, a.Grant("req-own-3", own));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  c = a.Commit(r->id, "req-own-3", own);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->code, 0) << c->message;
}

// Cross-scope poisoning (--prefix_cache_scope=per_key): a sender granted
// a handoff for one key's request reserves, or commits, under another
// key's cache salt, so that its KV would be published into that key's
// cache. The grant's digest covers the salt with the tokens: a
// reservation naming another salt is refused, and so is a commit whose
// salt is not its reservation's (tokens_mismatch); nothing is published.
TEST(KvPlaneSecurityTest, ASenderCannotPublishIntoAnotherKeysCacheScope) {
  Attack a;
  ASSERT_NO_FATAL_FAILURE(a.Start({}));
  const int32_t bs = a.peer.req.sender.block_size;
  const std::vector<int32_t> context = Ids(3 * bs + 1, 700);
  const CacheSalt mine = CacheSaltForKey("bob"), theirs = CacheSaltForKey("alice");
  auto grant = [&](const std::string& request) {
    return kv::EncodeGrant(*kv::MintGrant(*a.key, {.request_id = request,
                                                  .attempt = 1,
                                                  .sender = "127.0.0.1",
                                                  .receiver = a.decode.kv_address,
                                                  .expires = absl::Now() + absl::Seconds(60),
                                                  .positions = static_cast<int32_t>(context.size()) + 16,
                                                  .tokens_digest = kv::DigestTokens(context, mine)}));
  };
  a.peer.req.cache_salt = theirs;
  std::optional<kv::ReserveReply> r = a.Reserve(2, context, grant("req-scope-1"));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, kDenied) << r->message;
  EXPECT_EQ(a.decode.Refusals("tokens_mismatch"), 1);

  a.peer.req.cache_salt = mine;
  r = a.Reserve(3, context, grant("req-scope-2"));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  kv::Commit c;
  c.id = r->id;
  c.request_id = "req-scope-2";
  c.num_positions = static_cast<int32_t>(context.size());
  c.tokens = context;
  c.first_token = 5;
  c.cache_salt = theirs;
  a.peer.Send(c);
  std::optional<kv::CommitReply> cr = a.peer.raw.Await<kv::CommitReply>();
  ASSERT_TRUE(cr.has_value());
  EXPECT_EQ(cr->code, kDenied) << cr->message;
  EXPECT_EQ(a.decode.Refusals("tokens_mismatch"), 2);
  // Nothing of it is held under the other key's scope.
  a.peer.req.cache_salt = theirs;
  std::optional<kv::ReserveReply> probe = a.Reserve(4, context, kv::EncodeGrant(*kv::MintGrant(
      *a.key, {.request_id = "req-scope-3", .attempt = 1, .sender = "127.0.0.1", .receiver = a.decode.kv_address,
               .expires = absl::Now() + absl::Seconds(60), .positions = static_cast<int32_t>(context.size()) + 16,
               .tokens_digest = kv::DigestTokens(context, theirs)})));
  ASSERT_TRUE(probe.has_value());
  ASSERT_EQ(probe->code, 0) << probe->message;
  EXPECT_EQ(probe->held_positions, 0) << "the refused commit's KV was published under another key's scope";
}

// A grant bounds its reservation: otherwise a sender granted a 4-position
// handoff reserves the whole pool (margin_positions as large as the pool),
// starving every other request. A reservation larger than the grant's
// positions is refused (too_many_positions).
TEST(KvPlaneSecurityTest, AReservationCannotExceedItsGrantsPositions) {
  Attack a;
  ASSERT_NO_FATAL_FAILURE(a.Start({}));
  const std::vector<int32_t> context = Ids(4, 1);
  std::optional<kv::ReserveReply> r = a.Reserve(2, context, a.Grant("req-big", context, /*room=*/16),
                                                /*margin=*/100000);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, kDenied) << r->message;
  EXPECT_EQ(a.decode.Refusals("too_many_positions"), 1);
  r = a.Reserve(3, context, a.Grant("req-fits", context, /*room=*/16), /*margin=*/16);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, 0) << r->message;
}

// Renewing another connection's lease: if a LayerSent naming a handoff
// renews it whichever connection sends it, and handoff ids are sequential,
// a second connection keeps another's reservation (and its blocks) alive
// forever by counting ids. So ids are random, a renewal from another
// connection is refused (lease_other_connection), and a
// lease never runs past its grant's expiry even when its own sender
// renews it.
TEST(KvPlaneSecurityTest, OnlyTheReservingConnectionRenewsALeaseAndNeverPastItsGrant) {
  Attack a;
  ASSERT_NO_FATAL_FAILURE(a.Start({"--kv_lease_s", "1"}));
  const std::vector<int32_t> context = Ids(4, 1);
  std::optional<kv::ReserveReply> first = a.Reserve(2, context, a.Grant("req-a", context));
  std::optional<kv::ReserveReply> second = a.Reserve(3, context, a.Grant("req-b", context));
  ASSERT_TRUE(first.has_value() && second.has_value());
  ASSERT_EQ(first->code, 0) << first->message;
  ASSERT_EQ(second->code, 0) << second->message;
  EXPECT_GT(std::max(first->id.value, second->id.value) - std::min(first->id.value, second->id.value), 1u << 16)
      << "handoff ids look sequential: " << first->id.value << ", " << second->id.value;
  // The grant's abort is not waited for: the peer acknowledges it below.
  a.peer.Send(kv::Abort{second->id, static_cast<int32_t>(absl::StatusCode::kCancelled), "not needed"});

  Raw other_raw;
  absl::StatusOr<kv::Connection*> other = a.peer.transport->Connect("127.0.0.1", a.decode.kv_port, &other_raw);
  ASSERT_TRUE(other.ok()) << other.status();
  // Renewals from the other connection for 2 s, twice the lease.
  const absl::Time until = absl::Now() + absl::Seconds(2);
  bool aborted = false;
  while (absl::Now() < until && !aborted) {
    a.peer.transport->loop().RunSync([&] { (*other)->Send(kv::Encode(kv::LayerSent{first->id, 0})); });
    absl::SleepFor(absl::Milliseconds(100));  // Paces the attack; nothing waits on it.
    aborted = a.peer.raw.Peek<kv::Abort>(first->id);
  }
  ASSERT_TRUE(aborted) << "another connection kept the lease alive past twice its length";
  std::optional<kv::Abort> abort = a.peer.raw.Await<kv::Abort>();
  ASSERT_TRUE(abort.has_value());
  EXPECT_EQ(abort->id, first->id);
  EXPECT_GE(a.decode.Refusals("lease_other_connection"), 1);
  a.peer.Send(kv::AbortAck{first->id});

  // The reserving connection renews every 100 ms, but its grant expires
  // after 1.5 s: the lease ends with it.
  std::optional<kv::ReserveReply> r = a.Reserve(4, context, a.Grant("req-c", context, 16, absl::Milliseconds(1500)));
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->code, 0) << r->message;
  const absl::Time start = absl::Now();
  while (absl::Now() - start < absl::Seconds(4) && !a.peer.raw.Peek<kv::Abort>(r->id)) {
    a.peer.Send(kv::LayerSent{r->id, 0});
    absl::SleepFor(absl::Milliseconds(100));  // Paces the renewals.
  }
  abort = a.peer.raw.Await<kv::Abort>();
  ASSERT_TRUE(abort.has_value()) << "renewals kept a lease past its grant";
  EXPECT_EQ(abort->id, r->id);
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
}

// A connection the tests drive by hand: keeps what the receiver sends.
class FakeConnection final : public kv::Connection {
 public:
  void Send(std::string message) override { sent.push_back(*kv::Decode(message)); }
  absl::StatusOr<std::shared_ptr<kv::RemoteRegion>> ImportRegion(absl::string_view) override {
    return absl::UnimplementedError("fake");
  }
  void Put(const void*, int64_t, kv::RemoteRegion&, int64_t, kv::DoneCallback) override {}
  void Flush(kv::DoneCallback) override {}
  void Close() override {}
  void Fail(absl::Status) override {}
  bool failed() const override { return false; }
  const std::string& name() const override { return name_; }
  bool PeerMayMapMemory() const override { return false; }
  std::vector<Message> sent;

 private:
  std::string name_ = "fake";
};

// A write checked on arrival and landing later: a rendezvous receive's
// bytes arrive turns of the loop after MayWrite allowed them. An abort in
// between that freed the reservation's blocks at once would let the
// write's remaining bytes land in blocks another request may already
// hold. So the blocks of an aborted handoff stay held until every write
// allowed into them has landed (WriteLanded), a commit waits for them, and
// the bounds check cannot be fooled by an address or length that wraps.
TEST(KvPlaneSecurityTest, BlocksAreNotFreedWhileAnAllowedWriteIsLanding) {
  kv::LoopbackNetwork net;
  kv::LoopbackTransport transport(&net, "decode");
  KvCacheSpec spec;
  spec.num_layers = 2;
  spec.num_kv_heads = 2;
  spec.head_dim = 8;
  spec.block_size = 4;
  spec.num_blocks = 16;
  spec.dtype = DType::kF32;
  std::unique_ptr<KvManager> kv = *KvManager::Create(spec, &transport.region_allocator());
  const ModelIdentity model = HashBytes("security-test-model");
  std::unique_ptr<kv::KvReceiver> receiver =
      *kv::KvReceiver::Create(&transport, kv.get(), {.model = model}, [](kv::CommittedSequence s) { s.kv.Release(); });
  FakeConnection c;
  kv::ReserveRequest req;
  req.tag = 1;
  req.sender = kv::KvLayoutDescriptor::FromSpec(spec, model);
  req.num_positions = 8;
  req.prompt_tokens = Ids(8, 1);
  receiver->OnMessage(c, kv::Encode(req));
  ASSERT_EQ(c.sent.size(), 1u);
  const kv::ReserveReply reply = std::get<kv::ReserveReply>(c.sent[0]);
  ASSERT_EQ(reply.code, 0) << reply.message;
  const int32_t held_blocks = static_cast<int32_t>(reply.blocks.size());
  const int32_t free_before = kv->Counts().free;

  char* base = static_cast<char*>(kv->storage().base);
  char* dst = base + static_cast<int64_t>(reply.blocks[0]) * spec.LayerBlockBytes();
  const size_t bytes = static_cast<size_t>(spec.LayerBlockBytes());
  ASSERT_TRUE(receiver->MayWrite(c, dst, bytes));
  receiver->OnMessage(c, kv::Encode(kv::Abort{reply.id, 1, "sender gave up"}));
  EXPECT_EQ(kv->Counts().free, free_before) << "an aborted handoff's blocks were freed while a write was landing";
  receiver->WriteLanded(c, dst, bytes);
  EXPECT_EQ(kv->Counts().free, free_before + held_blocks);

  // Wrap-around: an address below the pool with a length that reaches
  // into it modulo 2^64, and lengths near 2^64, are refused.
  EXPECT_FALSE(receiver->MayWrite(c, base - 4096, static_cast<size_t>(0) - 4096 + bytes));
  EXPECT_FALSE(receiver->MayWrite(c, base, ~static_cast<size_t>(0)));
  EXPECT_FALSE(receiver->MayWrite(c, base + spec.TotalBytes(), 1));

  // A commit that arrives while a write is landing is taken only after it.
  c.sent.clear();
  req.tag = 2;
  receiver->OnMessage(c, kv::Encode(req));
  const kv::ReserveReply second = std::get<kv::ReserveReply>(c.sent.at(0));
  ASSERT_EQ(second.code, 0) << second.message;
  char* dst2 = base + static_cast<int64_t>(second.blocks[0]) * spec.LayerBlockBytes();
  ASSERT_TRUE(receiver->MayWrite(c, dst2, bytes));
  kv::Commit commit;
  commit.id = second.id;
  commit.num_positions = 8;
  commit.tokens = Ids(8, 1);
  receiver->OnMessage(c, kv::Encode(commit));
  EXPECT_EQ(c.sent.size(), 1u) << "the commit was answered while a write was landing";
  receiver->WriteLanded(c, dst2, bytes);
  ASSERT_EQ(c.sent.size(), 2u);
  EXPECT_EQ(std::get<kv::CommitReply>(c.sent[1]).code, 0);
  receiver.reset();
}

}  // namespace
}  // namespace pdserve
