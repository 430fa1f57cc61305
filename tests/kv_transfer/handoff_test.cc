// The handoff protocol over the in-process loopback transport: data lands
// byte-identical, layouts are checked and converted, prefixes are not
// re-sent, leases expire into quarantine, and errors carry the right codes.
#include <chrono>
#include <cstring>
#include <atomic>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "kv/block_hash.h"
#include "kv/kv_checksum.h"
#include "kv/kv_manager.h"
#include "gtest/gtest.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/layout_copy.h"
#include "kv_transfer/loopback_transport.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/sender.h"
#include "kv_transfer/wire.h"

namespace pdserve::kv {
namespace {

const ModelIdentity kModel = HashBytes("handoff-test-model");

KvCacheSpec Spec(DType dtype, int32_t block_size, int32_t num_blocks, int32_t head_dim = 8) {
  return {.num_layers = 3, .num_kv_heads = 2, .head_dim = head_dim, .block_size = block_size,
          .dtype = dtype, .num_blocks = num_blocks};
}

void FillRandom(KvRegion& region, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* p = static_cast<uint64_t*>(region.data());
  for (size_t i = 0; i < region.size() / 8; ++i) p[i] = rng();
}

std::vector<int32_t> Tokens(int32_t n, int32_t offset = 0) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = 1 + (i + offset) % 50;
  return t;
}

// Polls `pred` for up to 5 s (for effects of messages between threads).
template <typename P>
bool Eventually(P pred) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return pred();
}

class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

// Speaks the raw protocol to the receiver.
class RawClient : public ConnectionHandler {
 public:
  void OnMessage(Connection&, std::string message) override {
    absl::MutexLock lock(&mu_);
    messages_.push_back(*Decode(message));
  }
  void OnDisconnected(Connection&, absl::Status) override {}
  template <typename T>
  T Await() {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](std::vector<Message>* m) {
                               for (auto& x : *m) if (std::holds_alternative<T>(x)) return true;
                               return false;
                             },
                             &messages_),
                         absl::Seconds(5));
    for (auto it = messages_.begin(); it != messages_.end(); ++it) {
      if (std::holds_alternative<T>(*it)) {
        T t = std::get<T>(*it);
        messages_.erase(it);
        return t;
      }
    }
    ADD_FAILURE() << "no answer";
    return T{};
  }

 private:
  absl::Mutex mu_;
  std::vector<Message> messages_ ABSL_GUARDED_BY(mu_);
};

struct Side {
  std::unique_ptr<LoopbackTransport> transport;
  std::unique_ptr<KvManager> kv;  // Destroyed before the transport its region came from.
};

class HandoffTest : public ::testing::Test {
 protected:
  void SetUp(const KvCacheSpec& sender_spec, const KvCacheSpec& receiver_spec,
             absl::Duration lease = absl::Seconds(30)) {
    sender_.transport = std::make_unique<LoopbackTransport>(&net_, "prefill");
    receiver_.transport = std::make_unique<LoopbackTransport>(&net_, "decode");
    sender_.kv = *KvManager::Create(sender_spec, &sender_.transport->region_allocator());
    receiver_.kv = *KvManager::Create(receiver_spec, &receiver_.transport->region_allocator());
    FillRandom(sender_.kv->region(), 7);
    ReceiverOptions ro{.model = kModel, .lease = lease,
                       .clock = [this] { return clock_.Now(); }};
    ro.grant_key = grant_key_;
    ro.verify_fraction = verify_fraction_;
    receiver_obj_ = *KvReceiver::Create(receiver_.transport.get(), receiver_.kv.get(), ro,
                                        [this](CommittedSequence s) {
                                          absl::MutexLock lock(&committed_mu_);
                                          committed_.push_back(std::move(s));
                                        });
    port_ = *receiver_obj_->Listen("127.0.0.1", 0);
    receiver_obj_->SetAddress(kReceiverAddress);
    sender_obj_ = std::make_unique<KvSender>(sender_.transport.get(), sender_.kv->storage(),
                                             SenderOptions{.model = kModel, .timeout = absl::Seconds(5)});
    conn_ = *sender_obj_->Connect("127.0.0.1", port_);
  }

  void TearDown() override {
    {
      absl::MutexLock lock(&committed_mu_);
      for (auto& c : committed_) c.kv.Release();
      committed_.clear();
    }
    sender_obj_.reset();
    receiver_obj_.reset();
  }

  // A sender sequence of n positions.
  SequenceKv SenderSequence(int32_t n) {
    SequenceKv s = sender_.kv->NewSequence();
    EXPECT_TRUE(sender_.kv->Grow(s, n).ok());
    s.SetNumPositions(n);
    return s;
  }

  kv::Commit CommitState(const std::vector<int32_t>& tokens) {
    kv::Commit c;
    c.num_positions = static_cast<int32_t>(tokens.size());
    c.tokens = tokens;
    c.first_token = 42;
    c.first_logprob = -0.5f;
    c.top_logprobs = {{42, -0.5f}, {7, -1.25f}};
    c.sampling.temperature = 0.7f;
    c.sampling.top_k = 20;
    c.sampling.seed = 1234;
    c.sampling.presence_penalty = 0.25f;
    c.sampling.frequency_penalty = -0.75f;
    c.sampling.stop_token_ids = {2, 3};
    c.seed = 1234;
    c.generated = 1;
    return c;
  }

  // Moves n positions; returns the committed sequence's checksums beside
  // the sender's (grouped by 4 positions).
  void MoveAndCheck(int32_t n, int32_t expected_held = 0) {
    SequenceKv seq = SenderSequence(n);
    const std::vector<int32_t> tokens = Tokens(n);
    auto h = sender_obj_->Reserve(conn_, {.num_positions = n, .margin_positions = 3, .prompt_tokens = tokens});
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ((*h)->held_positions(), expected_held);
    for (int32_t l = 0; l < sender_.kv->spec().num_layers; ++l) {
      ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
    }
    ASSERT_TRUE((*h)->Commit(CommitState(tokens)).ok());
    absl::MutexLock lock(&committed_mu_);
    ASSERT_EQ(committed_.size(), 1u);
    const CommittedSequence& got = committed_.back();
    EXPECT_EQ(got.kv.num_positions(), n);
    EXPECT_GE(got.kv.capacity(receiver_.kv->spec().block_size), n + 3);
    EXPECT_EQ(got.state.tokens, tokens);
    EXPECT_EQ(got.state.first_token, 42);
    EXPECT_EQ(got.state.top_logprobs.size(), 2u);
    EXPECT_EQ(got.state.sampling.top_k, 20);
    EXPECT_EQ(got.state.sampling.seed, std::optional<uint64_t>(1234));
    EXPECT_EQ(got.state.sampling.presence_penalty, 0.25f);
    EXPECT_EQ(got.state.sampling.frequency_penalty, -0.75f);
    EXPECT_EQ(got.state.sampling.stop_token_ids, (std::vector<int32_t>{2, 3}));
    const auto want = PositionChecksums(sender_.kv->spec(), sender_.kv->storage().base, seq.block_table(),
                                        expected_held, n, 4);
    const auto have = PositionChecksums(receiver_.kv->spec(), receiver_.kv->storage().base, got.kv.block_table(),
                                        expected_held, n, 4);
    EXPECT_EQ(want, have);
    seq.Release();
  }

  // A verified handoff of n positions: the commit carries one checksum per
  // layer, the receiver's blocks hash to them, and the blocks stay out of
  // the prefix cache until their consumer has checked them.
  void MoveAndCheckVerified(int32_t n) {
    SequenceKv seq = SenderSequence(n);
    const std::vector<int32_t> tokens = Tokens(n);
    auto h = sender_obj_->Reserve(conn_, {.num_positions = n, .prompt_tokens = tokens});
    ASSERT_TRUE(h.ok()) << h.status();
    for (int32_t l = 0; l < sender_.kv->spec().num_layers; ++l) {
      ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
    }
    ASSERT_TRUE((*h)->Commit(CommitState(tokens)).ok());
    seq.Release();
    absl::MutexLock lock(&committed_mu_);
    ASSERT_EQ(committed_.size(), 1u);
    const CommittedSequence& got = committed_.back();
    ASSERT_TRUE(got.verify);
    const KvStorage pool = receiver_.kv->storage();
    const int32_t bs = pool.spec.block_size;
    EXPECT_EQ(got.first_block, 0);
    EXPECT_EQ(got.end_block, (n + bs - 1) / bs);
    EXPECT_EQ(got.producer, "prefill");  // The loopback transport's name for the sending side.
    ASSERT_EQ(got.state.layer_checksums.size(), static_cast<size_t>(pool.spec.num_layers));
    for (int32_t l = 0; l < pool.spec.num_layers; ++l) {
      EXPECT_EQ(LayerChecksum(pool, l, got.kv.block_table(), got.first_block, got.end_block),
                got.state.layer_checksums[l])
          << "layer " << l;
    }
    // A byte changed in a block changes its layer's checksum.
    char* byte = static_cast<char*>(pool.BlockData(1, BlockId{got.kv.block_table()[0]})) + 3;
    *byte = static_cast<char>(*byte ^ 0x10);
    EXPECT_NE(LayerChecksum(pool, 1, got.kv.block_table(), got.first_block, got.end_block),
              got.state.layer_checksums[1]);
    for (int32_t b : got.kv.block_table()) EXPECT_FALSE(receiver_.kv->IsCached(BlockId{b})) << "block " << b;
  }

  static constexpr const char* kReceiverAddress = "10.0.0.2:7300";
  double verify_fraction_ = 0;  // Set before SetUp: the receiver's share of verified handoffs.
  std::shared_ptr<const GrantKey> grant_key_;  // Set before SetUp: grants required.
  LoopbackNetwork net_;
  FakeClock clock_;
  RawClient raw_;  // Outlives the transports: their connections may call it.
  Side sender_, receiver_;
  absl::Mutex committed_mu_;
  std::vector<CommittedSequence> committed_;
  std::unique_ptr<KvReceiver> receiver_obj_;
  std::unique_ptr<KvSender> sender_obj_;
  Connection* conn_ = nullptr;
  int port_ = 0;
};

class HandoffDTypeTest : public HandoffTest, public ::testing::WithParamInterface<DType> {};

TEST_P(HandoffDTypeTest, SameBlockSizeLandsByteIdentical) {
  SetUp(Spec(GetParam(), 4, 32), Spec(GetParam(), 4, 40));
  MoveAndCheck(23);
  EXPECT_EQ(receiver_obj_->metrics().transfers, 1);
  EXPECT_EQ(sender_obj_->metrics().bytes, 6 * 3 * sender_.kv->spec().LayerBlockBytes());
}

TEST_P(HandoffDTypeTest, SmallerReceiverBlocksAreConverted) {
  SetUp(Spec(GetParam(), 8, 16), Spec(GetParam(), 4, 40));
  MoveAndCheck(21);
}

TEST_P(HandoffDTypeTest, LargerReceiverBlocksAreConverted) {
  SetUp(Spec(GetParam(), 4, 32), Spec(GetParam(), 16, 8));
  MoveAndCheck(37);
}

TEST_P(HandoffDTypeTest, AVerifiedHandoffOfTheSameLayoutCarriesChecksumsTheReceiversBlocksMatch) {
  verify_fraction_ = 1;
  SetUp(Spec(GetParam(), 4, 32), Spec(GetParam(), 4, 40));
  MoveAndCheckVerified(23);
}

TEST_P(HandoffDTypeTest, AVerifiedHandoffIntoSmallerBlocksCarriesChecksumsTheReceiversBlocksMatch) {
  verify_fraction_ = 1;
  SetUp(Spec(GetParam(), 8, 16), Spec(GetParam(), 4, 40));
  MoveAndCheckVerified(21);
}

TEST_P(HandoffDTypeTest, AVerifiedHandoffIntoLargerBlocksCarriesChecksumsTheReceiversBlocksMatch) {
  verify_fraction_ = 1;
  SetUp(Spec(GetParam(), 4, 32), Spec(GetParam(), 16, 8));
  MoveAndCheckVerified(37);
}

// A commit's blocks are published under the request's salted chain: a
// request under another salt (another API key, or the shared scope) finds
// none of them.
TEST_F(HandoffTest, ACommitPublishesItsBlocksUnderItsCacheSalt) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 40));
  const int32_t n = 17;
  SequenceKv seq = SenderSequence(n);
  const std::vector<int32_t> tokens = Tokens(n);
  auto h = sender_obj_->Reserve(
      conn_, {.num_positions = n, .prompt_tokens = tokens, .cache_salt = CacheSaltForKey("alice")});
  ASSERT_TRUE(h.ok()) << h.status();
  for (int32_t l = 0; l < sender_.kv->spec().num_layers; ++l) {
    ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
  }
  kv::Commit state = CommitState(tokens);
  state.cache_salt = CacheSaltForKey("alice");
  ASSERT_TRUE((*h)->Commit(state).ok());
  seq.Release();
  const BlockHasher hasher(kModel, DType::kF32, 4);
  auto hits = [&](const CacheSalt& salt) {
    SequenceKv probe = receiver_.kv->NewSequence();
    const int32_t blocks = receiver_.kv->AttachCachedPrefix(probe, hasher.FullBlockHashes(tokens, salt));
    probe.Release();
    return blocks;
  };
  EXPECT_EQ(hits(CacheSaltForKey("alice")), 4);
  EXPECT_EQ(hits(CacheSalt{}), 0);
  EXPECT_EQ(hits(CacheSaltForKey("bob")), 0);
}

INSTANTIATE_TEST_SUITE_P(KvDTypes, HandoffDTypeTest, ::testing::Values(DType::kF32, DType::kBF16, DType::kI8),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Tensor-parallel layouts (KvCacheSpec::num_ranks): 2 model KV heads on
// `ranks` ranks, split, or replicated past 2 ranks.
KvCacheSpec TpSpec(DType dtype, int32_t block_size, int32_t num_blocks, int32_t ranks) {
  KvCacheSpec s = Spec(dtype, block_size, num_blocks);
  s.num_ranks = ranks;
  s.model_kv_heads = 2;
  s.num_kv_heads = ranks <= 2 ? 2 / ranks : 1;
  return s;
}

// One position's bytes of one local head in one rank's pool: K [dim], V
// [dim], then the int8 scales.
std::string HeadBytes(const KvStorage& kv, absl::Span<const int32_t> table, int32_t layer, int32_t pos,
                      int32_t rank, int32_t local_head) {
  const KvCacheSpec& s = kv.spec;
  const int64_t elem = DTypeSize(s.dtype), slots = s.block_size, dim = s.head_dim, heads = s.num_kv_heads;
  const char* blk = static_cast<const char*>(kv.BlockData(layer, BlockId{table[pos / slots]}, rank));
  const int64_t slot = pos % slots;
  std::string out;
  for (int64_t d = 0; d < dim; ++d) out.append(blk + ((local_head * dim + d) * slots + slot) * elem, elem);
  out.append(blk + heads * dim * slots * elem + ((local_head * slots + slot) * dim) * elem, dim * elem);
  if (s.dtype == DType::kI8) {
    for (int64_t which = 0; which < 2; ++which) {
      out.append(blk + 2 * heads * dim * slots * elem + ((which * heads + local_head) * slots + slot) * 4, 4);
    }
  }
  return out;
}

struct TpPair {
  int32_t sender_ranks, receiver_ranks, sender_block, receiver_block;
};

std::string TpPairName(const ::testing::TestParamInfo<TpPair>& info) {
  const TpPair& p = info.param;
  return "Tp" + std::to_string(p.sender_ranks) + "To" + std::to_string(p.receiver_ranks) + "Blocks" +
         std::to_string(p.sender_block) + "To" + std::to_string(p.receiver_block);
}

// A sender's replicas of a head hold the same bytes (its ranks compute
// them alike): makes the random fill of `kv`'s pool so.
void MatchReplicas(KvManager& kv) {
  const KvCacheSpec& ss = kv.spec();
  for (int32_t r = 1; r < ss.num_ranks; ++r) {
    if (ss.FirstKvHead(r) == ss.FirstKvHead(r - 1)) {
      std::memcpy(kv.storage().base + r * ss.RankBytes(), kv.storage().base + (r - 1) * ss.RankBytes(),
                  ss.RankBytes());
    }
  }
}

class HandoffTpTest : public HandoffTest, public ::testing::WithParamInterface<TpPair> {};

TEST_P(HandoffTpTest, EveryReceiverRankGetsItsHeadsFromARankThatHoldsThem) {
  const TpPair p = GetParam();
  SetUp(TpSpec(DType::kBF16, p.sender_block, 32, p.sender_ranks),
        TpSpec(DType::kBF16, p.receiver_block, 48, p.receiver_ranks));
  MatchReplicas(*sender_.kv);
  const KvCacheSpec& ss = sender_.kv->spec();
  const KvStorage src = sender_.kv->storage();
  constexpr int32_t kPositions = 23;
  MoveAndCheck(kPositions);  // Layout-independent checksums agree.
  absl::MutexLock lock(&committed_mu_);
  const CommittedSequence& got = committed_.back();
  SequenceKv sent = sender_.kv->NewSequence();
  // The sequence MoveAndCheck sent was the pool's first blocks in order.
  ASSERT_TRUE(sender_.kv->Grow(sent, kPositions).ok());
  const KvCacheSpec& rs = receiver_.kv->spec();
  for (int32_t l = 0; l < rs.num_layers; ++l) {
    for (int32_t pos = 0; pos < kPositions; ++pos) {
      for (int32_t r = 0; r < rs.num_ranks; ++r) {
        for (int32_t h = 0; h < rs.num_kv_heads; ++h) {
          const int32_t model_head = rs.FirstKvHead(r) + h;
          // The sender's first rank holding it.
          int32_t sr = 0;
          while (!(ss.FirstKvHead(sr) <= model_head && model_head < ss.FirstKvHead(sr) + ss.num_kv_heads)) ++sr;
          ASSERT_EQ(HeadBytes(receiver_.kv->storage(), got.kv.block_table(), l, pos, r, h),
                    HeadBytes(src, sent.block_table(), l, pos, sr, model_head - ss.FirstKvHead(sr)))
              << "layer " << l << " position " << pos << " receiver rank " << r << " head " << h;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, HandoffTpTest,
    ::testing::Values(TpPair{2, 1, 4, 4}, TpPair{1, 2, 4, 4}, TpPair{2, 4, 4, 4}, TpPair{4, 2, 4, 4},
                      TpPair{4, 1, 4, 4}, TpPair{1, 4, 4, 4}, TpPair{2, 2, 4, 4}, TpPair{4, 4, 4, 4},
                      TpPair{2, 1, 8, 4}, TpPair{1, 4, 4, 16}),
    TpPairName);

// A pool in device memory (a GPU's), played by host memory the sender
// must not read: the sender's pool base is a region of 0xAB bytes, and
// CopyToHost reads the real bytes at the same offset of the true pool (what
// a device copy does). A sender that read its pool directly would send 0xAB.
// A backend the handoff asks only for memory operations: compute aborts.
class NoComputeBackend : public kernels::Backend {
 public:
  absl::StatusOr<std::unique_ptr<kernels::LinearWeight>> PackLinear(absl::Span<const kernels::MatrixPart>, int64_t,
                                                                    DType) override {
    return absl::UnimplementedError("no compute here");
  }
  void Linear(const kernels::LinearWeight&, const float*, int64_t, const float*, float*, bool) override { Never(); }
  void RmsNorm(const float*, const float*, int64_t, int64_t, float, float*) override { Never(); }
  void Rope(float*, int64_t, int32_t, int32_t, const int32_t*, const float*, const float*) override { Never(); }
  void SiluMul(const float*, int64_t, int64_t, float*) override { Never(); }
  void WriteKv(const kernels::KvLayerView&, int32_t, int32_t, const float*, const float*, int64_t, const int32_t*,
               const int32_t*) override {
    Never();
  }
  void Attention(const kernels::AttentionBatch&) override { Never(); }

 private:
  static void Never() { std::abort(); }
};

class FakeDevicePool final : public NoComputeBackend {
 public:
  FakeDevicePool(const char* device, const char* truth, size_t size) : device_(device), truth_(truth), size_(size) {}
  std::string Name() const override { return "fake-device"; }
  bool HostAddressable() const override { return false; }
  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    const char* s = static_cast<const char*>(src);
    if (s < device_ || s + bytes > device_ + size_) {
      outside_ = true;
      return;
    }
    std::memcpy(dst, truth_ + (s - device_), bytes);
    bytes_ += static_cast<int64_t>(bytes);
  }
  bool outside() const { return outside_; }
  int64_t bytes() const { return bytes_; }

 private:
  const char* device_;
  const char* truth_;
  size_t size_;
  bool outside_ = false;
  int64_t bytes_ = 0;
};

class HandoffFromDeviceTest : public HandoffTest, public ::testing::WithParamInterface<TpPair> {};

// The sender's pool is a device's: every layer goes through the backend's
// copies into host memory, packed for the receiver (same or converted
// layout), and the receiver holds exactly the pool's bytes.
TEST_P(HandoffFromDeviceTest, TheReceiverGetsTheDevicePoolsBytesNeverTheHostAlias) {
  const TpPair p = GetParam();
  SetUp(TpSpec(DType::kBF16, p.sender_block, 32, p.sender_ranks),
        TpSpec(DType::kBF16, p.receiver_block, 48, p.receiver_ranks));
  MatchReplicas(*sender_.kv);
  const KvCacheSpec& ss = sender_.kv->spec();
  const size_t size = static_cast<size_t>(ss.TotalBytes());
  std::vector<char> alias(size, static_cast<char>(0xAB));
  FakeDevicePool device(alias.data(), sender_.kv->storage().base, size);
  sender_obj_ = std::make_unique<KvSender>(
      sender_.transport.get(), KvStorage{ss, alias.data()},
      SenderOptions{.model = kModel, .timeout = absl::Seconds(5), .pool_backend = &device});
  conn_ = *sender_obj_->Connect("127.0.0.1", port_);
  MoveAndCheck(23);  // The receiver's checksums are the true pool's.
  EXPECT_FALSE(device.outside());
  // Every block the 23 positions touch, every layer and rank, once.
  const int64_t blocks = (23 + ss.block_size - 1) / ss.block_size;
  EXPECT_EQ(device.bytes(), blocks * ss.num_layers * ss.num_ranks * ss.LayerBlockBytes());
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, HandoffFromDeviceTest,
    ::testing::Values(TpPair{1, 1, 4, 4}, TpPair{1, 1, 4, 16}, TpPair{1, 1, 8, 4}, TpPair{2, 1, 4, 4},
                      TpPair{1, 2, 4, 8}),
    TpPairName);

// A pool in device memory on the receiving side: senders put into
// registered landing blocks, and the commit copies them through the
// backend's uploader into the pool (counted here), before the sequence is
// handed on.
class UploadCounter final : public kernels::BackendUploader {
 public:
  UploadCounter(int64_t* bytes, const bool* fail) : bytes_(bytes), fail_(fail) {}
  absl::Status Upload(void* dst, const void* src, size_t bytes) override {
    if (*fail_) return absl::UnavailableError("test device: upload failed");
    std::memcpy(dst, src, bytes);
    *bytes_ += static_cast<int64_t>(bytes);
    return absl::OkStatus();
  }

 private:
  int64_t* bytes_;
  const bool* fail_;
};

class CountingDevice final : public NoComputeBackend {
 public:
  std::string Name() const override { return "counting-device"; }
  bool HostAddressable() const override { return false; }
  absl::StatusOr<std::unique_ptr<kernels::BackendUploader>> NewUploader() override {
    return std::make_unique<UploadCounter>(&uploaded, &fail_uploads);
  }

  int64_t uploaded = 0;
  bool fail_uploads = false;  // Every upload fails while set.
};

class HandoffToDeviceTest : public HandoffTest, public ::testing::WithParamInterface<TpPair> {
 protected:
  // The receiver again, its pool a device's with `landing` landing blocks.
  void UseDevicePool(int32_t landing) {
    receiver_obj_.reset();
    ReceiverOptions ro{.model = kModel, .lease = absl::Seconds(30),
                       .clock = [this] { return clock_.Now(); }, .pool_backend = &device_,
                       .landing_blocks = landing};
    receiver_obj_ = *KvReceiver::Create(receiver_.transport.get(), receiver_.kv.get(), ro,
                                        [this](CommittedSequence s) {
                                          absl::MutexLock lock(&committed_mu_);
                                          committed_.push_back(std::move(s));
                                        });
    port_ = *receiver_obj_->Listen("127.0.0.1", 0);
    conn_ = *sender_obj_->Connect("127.0.0.1", port_);
  }
  CountingDevice device_;
};

TEST_P(HandoffToDeviceTest, CommittedKvIsCopiedIntoTheDevicePoolFromTheLandingBlocks) {
  const TpPair p = GetParam();
  SetUp(TpSpec(DType::kBF16, p.sender_block, 32, p.sender_ranks),
        TpSpec(DType::kBF16, p.receiver_block, 48, p.receiver_ranks));
  MatchReplicas(*sender_.kv);
  const KvCacheSpec& ss = sender_.kv->spec();
  UseDevicePool(24);
  MoveAndCheck(23);  // The pool's checksums are the sender's: only the copies put them there.
  const KvCacheSpec& rs = receiver_.kv->spec();
  const int64_t blocks = (23 + rs.block_size - 1) / rs.block_size;
  EXPECT_EQ(device_.uploaded, blocks * rs.num_layers * rs.num_ranks * rs.LayerBlockBytes());
  EXPECT_EQ(receiver_obj_->stats().landing_blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, HandoffToDeviceTest,
    ::testing::Values(TpPair{1, 1, 4, 4}, TpPair{1, 1, 8, 4}, TpPair{2, 1, 4, 4}, TpPair{1, 2, 4, 8}),
    TpPairName);

// Landing blocks are a bounded resource: a reservation beyond them is
// refused without holding pool blocks, and an aborted handoff gives both
// back.
TEST_F(HandoffToDeviceTest, LandingBlocksAreBoundedAndAnAbortFreesThem) {
  SetUp(Spec(DType::kBF16, 4, 32), Spec(DType::kBF16, 4, 48));
  UseDevicePool(4);
  auto big = sender_obj_->Reserve(conn_, {.num_positions = 30});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(big.status().message().find("landing blocks"), std::string::npos) << big.status();
  EXPECT_EQ(receiver_.kv->Counts().used, 0);
  SequenceKv seq = SenderSequence(10);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 10});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(receiver_obj_->stats().landing_blocks_used, 3);
  ASSERT_TRUE((*h)->SendLayer(0, seq.block_table()).ok());
  ASSERT_TRUE((*h)->Abort(absl::CancelledError("test")).ok());
  EXPECT_EQ(receiver_obj_->stats().landing_blocks_used, 0);
  EXPECT_EQ(receiver_.kv->Counts().used, 0);
  EXPECT_EQ(device_.uploaded, 0);
  seq.Release();
}

// A commit whose copy into the device pool fails is refused, nothing is
// handed on, and its pool and landing blocks are free by the time the
// sender hears of it.
TEST_F(HandoffToDeviceTest, ACommitWhoseCopyIntoThePoolFailsIsRefusedAndFreesItsBlocks) {
  SetUp(Spec(DType::kBF16, 4, 32), Spec(DType::kBF16, 4, 48));
  UseDevicePool(8);
  device_.fail_uploads = true;
  SequenceKv seq = SenderSequence(10);
  const std::vector<int32_t> tokens = Tokens(10);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 10, .prompt_tokens = tokens});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(receiver_.kv->Counts().used, 3);
  for (int32_t l = 0; l < sender_.kv->spec().num_layers; ++l) {
    ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
  }
  const absl::Status s = (*h)->Commit(CommitState(tokens));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("failed copying into the pool"), std::string::npos) << s;
  EXPECT_EQ(receiver_.kv->Counts().used, 0);
  EXPECT_EQ(receiver_obj_->stats().landing_blocks_used, 0);
  {
    absl::MutexLock lock(&committed_mu_);
    EXPECT_TRUE(committed_.empty());
  }
  seq.Release();
}

TEST_F(HandoffTest, ATensorParallelLayoutThatCannotBeConvertedIsRefusedNamingBoth) {
  KvLayoutDescriptor a = KvLayoutDescriptor::FromSpec(TpSpec(DType::kBF16, 4, 1, 2), kModel);
  KvLayoutDescriptor b = a;
  b.tp = 3;  // 3 ranks of one head each cannot hold 2 heads evenly.
  b.kv_heads_per_rank = 1;
  const absl::Status s = CheckCompatible(a, b);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("receiver's tensor-parallel layout"), std::string::npos) << s;
  EXPECT_NE(s.message().find(a.DebugString()), std::string::npos) << s;
  EXPECT_NE(s.message().find(b.DebugString()), std::string::npos) << s;
  EXPECT_FALSE(SameBlockLayout(a, KvLayoutDescriptor::FromSpec(TpSpec(DType::kBF16, 4, 1, 1), kModel)));
  EXPECT_TRUE(SameBlockLayout(a, KvLayoutDescriptor::FromSpec(TpSpec(DType::kBF16, 4, 9, 2), kModel)));
}

TEST_F(HandoffTest, IncompatibleLayoutsAreRefusedBeforeAnyByteMoves) {
  SetUp(Spec(DType::kBF16, 4, 16, /*head_dim=*/8), Spec(DType::kBF16, 4, 16, /*head_dim=*/16));
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 5});
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(h.status().message().find("head dim differs (sender 8, receiver 16)"), std::string::npos)
      << h.status();
  EXPECT_EQ(receiver_.kv->Counts().free, 16);
  EXPECT_EQ(sender_obj_->metrics().bytes, 0);
}

TEST_F(HandoffTest, DifferentDTypeOrModelIsRefused) {
  SetUp(Spec(DType::kBF16, 4, 16), Spec(DType::kI8, 4, 16));
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 5});
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(h.status().message().find("KV dtype differs (sender bf16, receiver int8)"), std::string::npos);
  KvLayoutDescriptor a = KvLayoutDescriptor::FromSpec(Spec(DType::kF32, 4, 1), kModel);
  KvLayoutDescriptor b = a;
  b.model = HashBytes("other");
  EXPECT_NE(CheckCompatible(a, b).message().find("model identity differs"), std::string::npos);
  b = a;
  b.protocol_version = kKvProtocolVersion + 1;
  EXPECT_NE(CheckCompatible(a, b).message().find("protocol version differs"), std::string::npos);
  b = a;
  b.block_size = 32;
  EXPECT_TRUE(CheckCompatible(a, b).ok());
}

TEST_F(HandoffTest, PrefixTheReceiverHoldsIsNotSentAgain) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 32));
  const std::vector<int32_t> tokens = Tokens(14);
  // The receiver already holds the first two blocks of this prompt.
  std::vector<int32_t> held;
  {
    const BlockHasher hasher(kModel, DType::kF32, 4);
    const auto hashes = hasher.FullBlockHashes(tokens);
    SequenceKv warm = receiver_.kv->NewSequence();
    ASSERT_TRUE(receiver_.kv->Grow(warm, 8).ok());
    held = warm.block_table();
    ASSERT_EQ(held.size(), 2u);
    for (int i = 0; i < 2; ++i) {
      for (int l = 0; l < 3; ++l) {
        std::memset(receiver_.kv->storage().BlockData(l, BlockId{held[i]}), 0x5a,
                    receiver_.kv->spec().LayerBlockBytes());
      }
    }
    warm.SetNumPositions(8);
    receiver_.kv->Publish(warm, {hashes[0], hashes[1]});
  }  // Released: cached, unreferenced.
  ASSERT_EQ(receiver_.kv->Counts().used, 0);
  ASSERT_EQ(receiver_.kv->Counts().cached, 2);
  MoveAndCheck(14, /*expected_held=*/8);
  // Only blocks 2 and 3 of 3 layers moved; the held blocks kept their bytes.
  EXPECT_EQ(sender_obj_->metrics().bytes, 2 * 3 * receiver_.kv->spec().LayerBlockBytes());
  absl::MutexLock lock(&committed_mu_);
  EXPECT_EQ(committed_[0].kv.block_table()[0], held[0]);
  EXPECT_EQ(committed_[0].kv.block_table()[1], held[1]);
  EXPECT_EQ(static_cast<unsigned char*>(receiver_.kv->storage().BlockData(2, BlockId{held[1]}))[5], 0x5a);
}

TEST_F(HandoffTest, ReservationLargerThanTheFreePoolIsResourceExhausted) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 8));
  SequenceKv other = receiver_.kv->NewSequence();  // half the pool held by another sequence
  ASSERT_TRUE(receiver_.kv->Grow(other, 16).ok());
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 10, .margin_positions = 8});
  EXPECT_EQ(h.status().code(), absl::StatusCode::kResourceExhausted) << h.status();
  EXPECT_TRUE(absl::StartsWith(h.status().message(), "KV handoff: reservation of 5 blocks")) << h.status();
  EXPECT_EQ(receiver_.kv->Counts().free, 4);
  other.Release();
  EXPECT_TRUE(sender_obj_->Reserve(conn_, {.num_positions = 10, .margin_positions = 8}).ok());
}

// A sender refused for room is told when KV frees, once per refusal, so
// that it waits for an event rather than asking again on a timer. An
// out-of-range reservation, answered on the same ordered channel, shows
// that no RoomFreed was sent before it.
TEST_F(HandoffTest, ARefusalForRoomIsFollowedByOneRoomFreedOnceKvFrees) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 8));
  std::atomic<int> told{0};
  sender_obj_->SetRoomListener([&](Connection& c) {
    EXPECT_EQ(&c, conn_);
    told.fetch_add(1);
  });
  auto barrier = [&] {
    EXPECT_EQ(sender_obj_->Reserve(conn_, {.num_positions = 30, .margin_positions = 8}).status().code(),
              absl::StatusCode::kOutOfRange);
  };
  SequenceKv other = receiver_.kv->NewSequence();
  ASSERT_TRUE(receiver_.kv->Grow(other, 16).ok());
  SequenceKv more = receiver_.kv->NewSequence();
  ASSERT_TRUE(receiver_.kv->Grow(more, 8).ok());
  barrier();
  EXPECT_EQ(told.load(), 0) << "no refusal yet";
  auto refused = sender_obj_->Reserve(conn_, {.num_positions = 10, .margin_positions = 8});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  barrier();
  EXPECT_EQ(told.load(), 0) << "nothing freed yet";
  more.Release();
  EXPECT_TRUE(Eventually([&] { return told.load() == 1; }));
  other.Release();  // a second free, with no refusal since the first
  barrier();
  EXPECT_EQ(told.load(), 1);
  EXPECT_TRUE(sender_obj_->Reserve(conn_, {.num_positions = 10, .margin_positions = 8}).ok());
  sender_obj_->SetRoomListener(nullptr);
}

TEST_F(HandoffTest, ReservationLargerThanTheWholePoolIsOutOfRange) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 8));
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 30, .margin_positions = 8});
  EXPECT_EQ(h.status().code(), absl::StatusCode::kOutOfRange) << h.status();
  EXPECT_TRUE(absl::StrContains(h.status().message(), "can never fit: the pool holds 8 blocks")) << h.status();
  EXPECT_EQ(receiver_.kv->Counts().free, 8);
}

TEST_F(HandoffTest, ExpiredLeaseQuarantinesUntilTheSenderAcknowledges) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 10), absl::Seconds(2));
  SequenceKv seq = SenderSequence(20);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 20});
  ASSERT_TRUE(h.ok()) << h.status();
  sender_.transport->HoldPutCompletions();  // The sender is stuck mid-stream.
  ASSERT_TRUE((*h)->SendLayer(0, seq.block_table()).ok());
  clock_.Advance(absl::Seconds(3));
  receiver_obj_->CheckLeases();
  ASSERT_TRUE(Eventually([&] { return sender_obj_->metrics().aborts == 1; }));
  EXPECT_EQ(receiver_obj_->stats().quarantined, 1);
  EXPECT_EQ(receiver_obj_->stats().quarantined_blocks, 5);
  EXPECT_EQ(receiver_obj_->metrics().leases_expired, 1);
  // Not reused before the ack: a reservation that needs them is refused.
  EXPECT_EQ(receiver_.kv->Counts().free, 5);
  auto other = sender_obj_->Reserve(conn_, {.num_positions = 40});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*h)->SendLayer(1, seq.block_table()).code(), absl::StatusCode::kAborted);
  sender_.transport->ReleasePutCompletions();  // Writes drain, flush, ack.
  ASSERT_TRUE(Eventually([&] { return receiver_obj_->stats().quarantined == 0; }));
  EXPECT_EQ(receiver_.kv->Counts().free, 10);
  EXPECT_EQ((*h)->Commit(CommitState(Tokens(20))).code(), absl::StatusCode::kAborted);
  seq.Release();
}

// A reservation made ahead of its forward (the prompt queued behind other
// compute) is kept alive by the sender's renewals until its first layer
// goes, however long that takes.
TEST_F(HandoffTest, ASenderWaitingToComputeKeepsItsReservationLeased) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 10), absl::Milliseconds(300));
  SequenceKv seq = SenderSequence(20);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 20});
  ASSERT_TRUE(h.ok()) << h.status();
  // Four leases of the receiver's clock pass; the sender renews every
  // 100 ms of real time, twice per 50 ms the clock moves.
  for (int i = 0; i < 24; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    clock_.Advance(absl::Milliseconds(50));
    receiver_obj_->CheckLeases();
  }
  EXPECT_EQ(receiver_obj_->metrics().leases_expired, 0);
  for (int32_t l = 0; l < sender_.kv->spec().num_layers; ++l) ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
  EXPECT_TRUE((*h)->Commit(CommitState(Tokens(20))).ok());
  seq.Release();
}

// Nobody calls CheckLeases here: the receiver's loop runs the check when
// the lease's deadline comes, 50 ms of real time after the reservation (by
// then the receiver's clock has moved past it).
TEST_F(HandoffTest, ALeaseEndsAtItsDeadlineWithNoCheckCalled) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 10), absl::Milliseconds(50));
  SequenceKv seq = SenderSequence(20);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 20});
  ASSERT_TRUE(h.ok()) << h.status();
  sender_.transport->HoldPutCompletions();  // The sender is stuck mid-stream.
  ASSERT_TRUE((*h)->SendLayer(0, seq.block_table()).ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(Eventually([&] { return receiver_obj_->stats().quarantined == 1; }));
  EXPECT_EQ(receiver_obj_->metrics().leases_expired, 1);
  sender_.transport->ReleasePutCompletions();  // Writes drain, flush, ack.
  ASSERT_TRUE(Eventually([&] { return receiver_obj_->stats().quarantined == 0; }));
  EXPECT_EQ(receiver_.kv->Counts().free, 10);
  seq.Release();
}

TEST_F(HandoffTest, CommitForUnknownOrExpiredHandoffIsRefused) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 32), absl::Seconds(2));
  RawClient& raw = raw_;
  Connection* c = *sender_.transport->Connect("127.0.0.1", port_, &raw);
  auto send = [&](const Message& m) { sender_.transport->loop().RunSync([&] { c->Send(Encode(m)); }); };
  kv::Commit commit = CommitState(Tokens(4));
  commit.id = HandoffId{999};
  send(commit);
  CommitReply r = raw.Await<CommitReply>();
  EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kNotFound));
  EXPECT_NE(r.message.find("unknown handoff id 999"), std::string::npos);

  ReserveRequest req;
  req.tag = 1;
  req.sender = KvLayoutDescriptor::FromSpec(Spec(DType::kF32, 4, 32), kModel);
  req.num_positions = 4;
  send(req);
  ReserveReply rr = raw.Await<ReserveReply>();
  ASSERT_EQ(rr.code, 0) << rr.message;
  clock_.Advance(absl::Seconds(3));
  receiver_obj_->CheckLeases();
  Abort abort = raw.Await<Abort>();
  EXPECT_EQ(abort.code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  commit.id = rr.id;
  send(commit);
  r = raw.Await<CommitReply>();
  EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(receiver_obj_->stats().quarantined, 1);
  send(AbortAck{rr.id});
  ASSERT_TRUE(Eventually([&] { return receiver_obj_->stats().quarantined == 0; }));
  EXPECT_EQ(receiver_.kv->Counts().free, 32);
}

TEST_F(HandoffTest, DeadReceiverFailsTheSenderWithUnavailable) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 32));
  SequenceKv seq = SenderSequence(12);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 12});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE((*h)->SendLayer(0, seq.block_table()).ok());
  receiver_.transport->Break();
  EXPECT_EQ((*h)->Commit(CommitState(Tokens(12))).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*h)->SendLayer(1, seq.block_table()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(sender_obj_->Reserve(conn_, {.num_positions = 4}).status().code(), absl::StatusCode::kUnavailable);
  seq.Release();
}

TEST_F(HandoffTest, DeadSenderFreesItsReservation) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 32));
  SequenceKv seq = SenderSequence(12);
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 12});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE((*h)->SendLayer(0, seq.block_table()).ok());
  EXPECT_EQ(receiver_obj_->stats().active, 1);
  sender_.transport->Break();
  ASSERT_TRUE(Eventually([&] { return receiver_obj_->stats().active == 0; }));
  EXPECT_EQ(receiver_obj_->metrics().failures, 1);
  EXPECT_EQ(receiver_.kv->Counts().free, 32);
  seq.Release();
}

TEST_F(HandoffTest, SenderAbortFreesAtOnce) {
  SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 32));
  auto h = sender_obj_->Reserve(conn_, {.num_positions = 12});
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE((*h)->Abort(absl::CancelledError("client went away")).ok());
  EXPECT_EQ(receiver_obj_->stats().active, 0);
  EXPECT_EQ(receiver_.kv->Counts().free, 32);
}

// Grants (kv_transfer/grant.h): a receiver with a key honours only the
// router's grant for this receiver, unexpired, from the host it names, once
// per (request, attempt); the commit must come on the reserving connection
// and name the grant's request. Every refusal is counted, and a committed
// request's KV does not change, byte for byte, whatever the refused ones
// sent.
class HandoffGrantTest : public HandoffTest {
 protected:
  void SetUp() override {
    grant_key_ = std::make_shared<const GrantKey>(*GrantKey::FromBytes(std::string(32, 'k')));
    HandoffTest::SetUp(Spec(DType::kF32, 4, 32), Spec(DType::kF32, 4, 32), absl::Seconds(2));
  }
  // The loopback shows a connection's peer as its transport's name
  // ("prefill"), a name, so a grant naming it matches; an IP literal names
  // another host.
  // Grants bind a context (the tokens, 4 of them unless named) and at most
  // 64 positions beyond it.
  std::string Grant(const std::string& request, uint32_t attempt, absl::Duration ttl = absl::Seconds(60),
                    const std::string& receiver = kReceiverAddress, const std::string& sender = "prefill",
                    const GrantKey* key = nullptr, const std::vector<int32_t>& context = Tokens(4)) {
    return EncodeGrant(*MintGrant(key != nullptr ? *key : *grant_key_,
                                  {.request_id = request,
                                   .attempt = attempt,
                                   .sender = sender,
                                   .receiver = receiver,
                                   .expires = clock_.Now() + ttl,
                                   .positions = static_cast<int32_t>(context.size()) + 64,
                                   .tokens_digest = DigestTokens(context)}));
  }
  ReserveRequest Reserve(uint64_t tag, std::string grant) {
    ReserveRequest req;
    req.tag = tag;
    req.sender = KvLayoutDescriptor::FromSpec(Spec(DType::kF32, 4, 32), kModel);
    req.num_positions = 4;
    req.prompt_tokens = Tokens(4);
    req.grant = std::move(grant);
    return req;
  }
};

TEST_F(HandoffGrantTest, OnlyAValidUnusedGrantReservesAndOnlyItsConnectionCommits) {
  // A legitimate handoff through the sender, committed first: its blocks
  // must not change while the refused ones below try.
  SequenceKv seq = SenderSequence(8);
  const std::vector<int32_t> tokens = Tokens(8);
  auto h = sender_obj_->Reserve(
      conn_, {.num_positions = 8,
              .prompt_tokens = tokens,
              .grant = Grant("req-a", 1, absl::Seconds(60), kReceiverAddress, "prefill", nullptr, tokens)});
  ASSERT_TRUE(h.ok()) << h.status();
  for (int32_t l = 0; l < sender_.kv->spec().num_layers; ++l) ASSERT_TRUE((*h)->SendLayer(l, seq.block_table()).ok());
  kv::Commit state = CommitState(tokens);
  state.request_id = "req-a";
  ASSERT_TRUE((*h)->Commit(state).ok());
  std::vector<int32_t> committed_blocks;
  {
    absl::MutexLock lock(&committed_mu_);
    ASSERT_EQ(committed_.size(), 1u);
    committed_blocks = committed_[0].kv.block_table();
  }
  const auto before = PositionChecksums(receiver_.kv->spec(), receiver_.kv->storage().base, committed_blocks, 0, 8, 1);

  RawClient& raw = raw_;
  Connection* c = *sender_.transport->Connect("127.0.0.1", port_, &raw);
  auto send = [&](const Message& m) { sender_.transport->loop().RunSync([&] { c->Send(Encode(m)); }); };
  auto refused = [&](uint64_t tag, std::string grant, GrantRefusal why, const std::string& says) {
    send(Reserve(tag, std::move(grant)));
    ReserveReply r = raw.Await<ReserveReply>();
    EXPECT_EQ(r.tag, tag);
    EXPECT_EQ(r.code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied)) << GrantRefusalName(why);
    EXPECT_NE(r.message.find(says), std::string::npos) << r.message;
    EXPECT_EQ(receiver_obj_->refusals(why), 1) << GrantRefusalName(why);
  };
  const GrantKey other = *GrantKey::FromBytes(std::string(32, 'x'));
  refused(1, "", GrantRefusal::kMissing, "no grant");
  refused(2, "PDG2 garbage", GrantRefusal::kMalformed, "malformed");
  refused(3, Grant("req-b", 1, absl::Seconds(60), kReceiverAddress, "prefill", &other), GrantRefusal::kBadMac,
          "MAC");
  refused(4, Grant("req-b", 1, absl::Seconds(-1)), GrantRefusal::kExpired, "expired");
  refused(5, Grant("req-b", 1, absl::Seconds(60), "10.0.0.9:7300"), GrantRefusal::kWrongReceiver, "10.0.0.9:7300");
  refused(6, Grant("req-b", 1, absl::Seconds(60), kReceiverAddress, "10.0.0.1"), GrantRefusal::kWrongSender,
          "10.0.0.1");
  refused(7, Grant("req-a", 1), GrantRefusal::kReused, "used before");
  // A tampered grant: one byte of the request id changed.
  std::string tampered = Grant("req-c", 1);
  tampered[8] ^= 1;
  send(Reserve(8, tampered));
  EXPECT_EQ(raw.Await<ReserveReply>().code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(receiver_obj_->refusals(GrantRefusal::kBadMac), 2);

  // A fresh attempt of the same request is a new grant: honoured.
  send(Reserve(9, Grant("req-a", 2)));
  ReserveReply ok = raw.Await<ReserveReply>();
  ASSERT_EQ(ok.code, 0) << ok.message;
  // Its commit from another connection, or naming another request, is refused.
  kv::Commit commit = CommitState(Tokens(4));
  commit.id = ok.id;
  commit.request_id = "req-a";
  Connection* intruder = *sender_.transport->Connect("127.0.0.1", port_, &raw);
  sender_.transport->loop().RunSync([&] { intruder->Send(Encode(commit)); });
  EXPECT_EQ(raw.Await<CommitReply>().code, static_cast<int32_t>(absl::StatusCode::kNotFound));
  EXPECT_EQ(receiver_obj_->refusals(GrantRefusal::kCommitOtherConnection), 1);
  commit.request_id = "req-z";
  send(commit);
  EXPECT_EQ(raw.Await<CommitReply>().code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(receiver_obj_->refusals(GrantRefusal::kCommitOtherRequest), 1);
  commit.request_id = "req-a";
  send(commit);
  EXPECT_EQ(raw.Await<CommitReply>().code, 0);

  const auto after = PositionChecksums(receiver_.kv->spec(), receiver_.kv->storage().base, committed_blocks, 0, 8, 1);
  EXPECT_EQ(before, after);
  seq.Release();
}

// The lease still bounds a granted reservation, and a late commit for it is
// refused (over TCP a put outside a live reservation has nowhere to land).
// The prefill worker asks again, with the same grant, while the pool is full:
// a refusal for room leaves the grant unspent; the reservation it buys
// spends it.
TEST_F(HandoffGrantTest, AReservationRefusedForRoomLeavesItsGrantForTheRetry) {
  RawClient& raw = raw_;
  Connection* c = *sender_.transport->Connect("127.0.0.1", port_, &raw);
  auto send = [&](const Message& m) { sender_.transport->loop().RunSync([&] { c->Send(Encode(m)); }); };
  SequenceKv full = receiver_.kv->NewSequence();
  ASSERT_TRUE(receiver_.kv->Grow(full, 32 * 4).ok());
  const std::string grant = Grant("req-r", 1);
  send(Reserve(1, grant));
  ReserveReply refused = raw.Await<ReserveReply>();
  EXPECT_EQ(refused.code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted)) << refused.message;
  full.Release();
  send(Reserve(2, grant));
  ReserveReply granted = raw.Await<ReserveReply>();
  EXPECT_EQ(granted.code, 0) << granted.message;
  send(Reserve(3, grant));
  ReserveReply again = raw.Await<ReserveReply>();
  EXPECT_EQ(again.code, static_cast<int32_t>(absl::StatusCode::kPermissionDenied)) << again.message;
  EXPECT_EQ(receiver_obj_->refusals(GrantRefusal::kReused), 1);
  send(Abort{granted.id});
}

TEST_F(HandoffGrantTest, AGrantedReservationStillExpiresWithItsLease) {
  RawClient& raw = raw_;
  Connection* c = *sender_.transport->Connect("127.0.0.1", port_, &raw);
  auto send = [&](const Message& m) { sender_.transport->loop().RunSync([&] { c->Send(Encode(m)); }); };
  send(Reserve(1, Grant("req-l", 1)));
  ReserveReply rr = raw.Await<ReserveReply>();
  ASSERT_EQ(rr.code, 0) << rr.message;
  clock_.Advance(absl::Seconds(3));
  receiver_obj_->CheckLeases();
  EXPECT_EQ(raw.Await<Abort>().code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
  kv::Commit commit = CommitState(Tokens(4));
  commit.id = rr.id;
  commit.request_id = "req-l";
  send(commit);
  EXPECT_EQ(raw.Await<CommitReply>().code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  send(AbortAck{rr.id});
  ASSERT_TRUE(Eventually([&] { return receiver_obj_->stats().quarantined == 0; }));
  EXPECT_EQ(receiver_.kv->Counts().free, 32);
}

TEST(WireTest, RoundTripAndMalformed) {
  kv::Commit c;
  c.id = HandoffId{5};
  c.request_id = "req-7";
  c.num_positions = 2;
  c.tokens = {9, 8};
  c.sampling.seed = 77;
  c.sampling.top_p = 0.5f;
  c.cache_salt = CacheSalt{0x1122334455667788u, 0x99aabbccddeeff00u};
  c.layer_checksums = {0xfedcba9876543210u, 7};
  std::string bytes = Encode(c);
  auto back = Decode(bytes);
  ASSERT_TRUE(back.ok());
  const auto& d = std::get<kv::Commit>(*back);
  EXPECT_EQ(d.tokens, c.tokens);
  EXPECT_EQ(d.layer_checksums, c.layer_checksums);
  EXPECT_EQ(d.request_id, "req-7");
  EXPECT_EQ(d.sampling.seed, std::optional<uint64_t>(77));
  EXPECT_EQ(d.sampling.top_p, 0.5f);
  EXPECT_EQ(d.cache_salt, c.cache_salt);
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_FALSE(Decode(absl::string_view(bytes).substr(0, cut)).ok()) << cut;
  }
  EXPECT_FALSE(Decode(std::string("\x63", 1)).ok());
  bytes = Encode(RoomFreed{});
  EXPECT_EQ(bytes.size(), 1u);
  back = Decode(bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(std::holds_alternative<RoomFreed>(*back));

  ReserveRequest r;
  r.tag = 3;
  r.sender.protocol_version = kKvProtocolVersion;
  r.num_positions = 2;
  r.prompt_tokens = {9, 8};
  r.grant = "g";
  r.cache_salt = CacheSalt{0x0102030405060708u, 0x1112131415161718u};
  bytes = Encode(r);
  back = Decode(bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(std::get<ReserveRequest>(*back).cache_salt, r.cache_salt);
  EXPECT_EQ(std::get<ReserveRequest>(*back).grant, "g");
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_FALSE(Decode(absl::string_view(bytes).substr(0, cut)).ok()) << cut;
  }

  ReserveReply rr;
  rr.tag = 4;
  rr.receiver.protocol_version = kKvProtocolVersion;
  rr.blocks = {3, 1};
  rr.verify = 1;
  bytes = Encode(rr);
  back = Decode(bytes);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(std::get<ReserveReply>(*back).verify, 1);
  EXPECT_EQ(std::get<ReserveReply>(*back).blocks, rr.blocks);
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    EXPECT_FALSE(Decode(absl::string_view(bytes).substr(0, cut)).ok()) << cut;
  }
}

}  // namespace
}  // namespace pdserve::kv
