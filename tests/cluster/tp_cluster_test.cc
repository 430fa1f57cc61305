// Tensor-parallel workers in a real cluster (router, prefill and decode
// processes on loopback, KV over UCX), every pairing of prefill TP 1, 2, 4
// with decode TP 1, 2, 4 head-sharded or 2, 4 request-sharded: every stream equals an in-process engine that prefills on a model
// of the prefill worker's TP, converts the KV to the decode worker's layout
// as the handoff does (kv_transfer/layout_copy.h) and decodes on a model of
// the decode worker's TP. The shipped model has 2 KV heads, so TP 4
// replicates each on 2 ranks.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/generation.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kv_transfer/layout_copy.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

// A model over `tp` ranks of one thread each, on the F32 matrix path (the
// path the harness pins for the servers).
struct TpModel {
  std::vector<std::unique_ptr<kernels::cpu::CpuBackend>> backends;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvManager> kv;

  static TpModel Load(int tp, TpKvLayout layout = TpKvLayout::kHeadSharded) {
    TpModel m;
    ModelOptions o;
    o.tp = tp;
    for (int r = 0; r < tp; ++r) {
      m.backends.push_back(*kernels::cpu::CpuBackend::Create(
          {.num_threads = 1, .isa = std::nullopt, .matrix_path = kernels::cpu::MatrixPath::kF32}));
      if (r > 0) o.rank_backends.push_back(m.backends.back().get());
    }
    m.model = *Model::Load(kModel, o, m.backends[0].get());
    m.kv = *KvManager::Create(m.model->MakeKvSpec(m.model->weight_dtype(), 16, 64, layout));
    return m;
  }
};

struct RefOutput {
  std::vector<int32_t> tokens;
  std::string text;
};

class TpClusterTest : public ::testing::TestWithParam<std::pair<int, int>> {
 public:
  static void SetUpTestSuite() {
    setenv("PDSERVE_MATRIX_PATH", "f32", 1);
    tokenizer_ = tok::Tokenizer::Load(kModel)->release();
  }

  static v1::GenerateRequest Request(const std::string& text, int max_tokens, float temperature, uint64_t seed) {
    v1::GenerateRequest r;
    r.set_text(text);
    r.set_max_tokens(max_tokens);
    r.mutable_sampling()->set_temperature(temperature);
    r.mutable_sampling()->set_seed(seed);
    return r;
  }

  // Prefill on `prefill`, the KV converted into `decode`'s layout, decode
  // on `decode`; with `moved_to`, once `move_at` tokens are generated the
  // KV is converted again, into its layout, and decoding goes on there (a
  // sequence moved between decode workers).
  static RefOutput Reference(const v1::GenerateRequest& req, TpModel& prefill, TpModel& decode,
                             TpModel* moved_to = nullptr, int move_at = 0) {
    GenerationRequest r;
    r.prompt = *tokenizer_->Encode(req.text(), false);
    r.params.temperature = req.sampling().temperature();
    r.params.seed = req.sampling().seed();
    r.params.max_tokens = req.max_tokens();
    r.eos_ids = prefill.model->config().eos_token_ids;
    Generation gen(r, tokenizer_);
    RefOutput out;
    const int32_t n = static_cast<int32_t>(r.prompt.size());
    SequenceKv src = prefill.kv->NewSequence();
    ForwardSequence fs{&src, r.prompt, LogitsMode::kLast};
    auto first = ForwardGrowing(*prefill.model, *prefill.kv, {&fs, 1});
    EXPECT_TRUE(first.ok()) << first.status();
    auto ev = gen.Accept(first->Last(0));
    out.tokens.push_back(ev->token);
    out.text += ev->text;

    SequenceKv dst = decode.kv->NewSequence(decode.kv->PickRank());
    EXPECT_TRUE(decode.kv->Grow(dst, n).ok());
    const KvCacheSpec& ss = prefill.kv->spec();
    const KvCacheSpec& ds = decode.kv->spec();
    std::vector<char> packed(kv::PackedLayerBytes(ds, 0, n));
    for (int32_t l = 0; l < ss.num_layers; ++l) {
      kv::PackLayer(ss, prefill.kv->storage().base, src.block_table(), ds, l, 0, n, packed.data());
      for (const kv::CopyRun& run : kv::PlanPacked(ds, dst.block_table(), l, 0, n, 0)) {
        std::memcpy(decode.kv->storage().base + run.dst_offset, packed.data() + run.src_offset, run.bytes);
      }
    }
    dst.SetNumPositions(n);
    src.Release();
    std::vector<int32_t> feed = {ev->token};
    TpModel* on = &decode;
    while (!gen.finished()) {
      if (moved_to != nullptr && static_cast<int>(gen.generated().size()) == move_at && on == &decode) {
        // Every position but the last token's has its KV: those move.
        const int32_t m = static_cast<int32_t>(r.prompt.size() + gen.generated().size()) - 1;
        SequenceKv to = moved_to->kv->NewSequence(moved_to->kv->PickRank());
        EXPECT_TRUE(moved_to->kv->Grow(to, m).ok());
        const KvCacheSpec& ms = moved_to->kv->spec();
        std::vector<char> moved(kv::PackedLayerBytes(ms, 0, m));
        for (int32_t l = 0; l < ds.num_layers; ++l) {
          kv::PackLayer(ds, decode.kv->storage().base, dst.block_table(), ms, l, 0, m, moved.data());
          for (const kv::CopyRun& run : kv::PlanPacked(ms, to.block_table(), l, 0, m, 0)) {
            std::memcpy(moved_to->kv->storage().base + run.dst_offset, moved.data() + run.src_offset, run.bytes);
          }
        }
        to.SetNumPositions(m);
        dst.Release();
        dst = std::move(to);
        on = moved_to;
      }
      ForwardSequence step{&dst, feed, LogitsMode::kLast};
      auto res = ForwardGrowing(*on->model, *on->kv, {&step, 1});
      EXPECT_TRUE(res.ok()) << res.status();
      ev = gen.Accept(res->Last(0));
      out.tokens.push_back(ev->token);
      out.text += ev->text;
      feed.assign(1, ev->token);
    }
    dst.Release();
    return out;
  }

  static tok::Tokenizer* tokenizer_;
};

tok::Tokenizer* TpClusterTest::tokenizer_ = nullptr;

// Every request on its own client thread at once.
std::vector<Output> GenerateConcurrently(Cluster& c, const std::vector<v1::GenerateRequest>& requests) {
  std::vector<Output> got(requests.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < requests.size(); ++i) {
    clients.emplace_back([&, i] { got[i] = c.Generate(requests[i]); });
  }
  for (std::thread& t : clients) t.join();
  return got;
}

TEST_P(TpClusterTest, StreamsEqualTheInProcessEngineWithTheSameTpSizes) {
  const auto [prefill_tp, decode_tp] = GetParam();
  TpModel prefill = TpModel::Load(prefill_tp), decode = TpModel::Load(decode_tp);
  Cluster c;
  c.tls = false;
  const std::string dir = TempDir() + absl::StrCat("/tp", prefill_tp, "to", decode_tp);
  absl::Status s = c.Start(dir, false, {"--tp", absl::StrCat(decode_tp)}, {}, 1, {"--tp", absl::StrCat(prefill_tp)});
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<v1::GenerateRequest> requests = {
      Request("In the beginning God created", 24, 0.0f, 42),
      // Longer than a prefill chunk (32 tokens) and a KV block (16).
      Request("And it came to pass, when men began to multiply on the face of the earth, and daughters were born "
              "unto them, that the sons of God saw the daughters of men",
              20, 0.8f, 7),
  };
  for (const v1::GenerateRequest& req : requests) {
    const auto got = c.Generate(req);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    const RefOutput want = Reference(req, prefill, decode);
    EXPECT_EQ(got.tokens, want.tokens) << "prefill tp " << prefill_tp << ", decode tp " << decode_tp << ": "
                                       << req.text();
    EXPECT_EQ(got.text, want.text);
  }
  // Each worker reports its TP size and its KV bytes per position per
  // rank, as `pdctl plan` counts them per chip: c_kv / min(N, N_kv), with
  // c_kv = 2 * layers * KV heads * head dim * 2 bytes (BF16).
  const ModelConfig& mc = prefill.model->config();
  const int64_t c_kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2;
  const v1::ClusterStatusResponse st = c.Status();
  ASSERT_EQ(st.prefill_size(), 1);
  ASSERT_EQ(st.decode_size(), 1);
  EXPECT_EQ(st.prefill(0).tp(), prefill_tp);
  EXPECT_EQ(st.decode(0).tp(), decode_tp);
  EXPECT_EQ(st.prefill(0).kv_bytes_per_position_per_rank(), c_kv / std::min<int64_t>(prefill_tp, mc.num_kv_heads));
  EXPECT_EQ(st.decode(0).kv_bytes_per_position_per_rank(), c_kv / std::min<int64_t>(decode_tp, mc.num_kv_heads));
  // And the same on its metrics page.
  const std::string page = HttpGet(c.decode_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(page, "pdserve_tp_ranks"), decode_tp) << page;
  EXPECT_EQ(MetricValue(page, "pdserve_kv_bytes_per_position_per_rank"),
            c_kv / std::min<int64_t>(decode_tp, mc.num_kv_heads));
}

// Decode with request-sharded KV: each rank holds and attends for whole
// requests (placement: ShardedForwardTest.RequestShardedDecode...). Each
// stream equals the in-process engine with the same layout, and the worker
// reports rows per rank.
TEST_F(TpClusterTest, RequestShardedDecodeStreamsEqualTheInProcessEngine) {
  for (const auto& [prefill_tp, decode_tp] : {std::make_pair(1, 2), std::make_pair(2, 2), std::make_pair(4, 2),
                                               std::make_pair(1, 4), std::make_pair(2, 4), std::make_pair(4, 4)}) {
    TpModel prefill = TpModel::Load(prefill_tp), decode = TpModel::Load(decode_tp, TpKvLayout::kRequestSharded);
    Cluster c;
    c.tls = false;
    const std::string dir = TempDir() + absl::StrCat("/tp", prefill_tp, "to", decode_tp, "r");
    absl::Status s = c.Start(dir, false, {"--tp", absl::StrCat(decode_tp), "--tp_kv_layout", "request"}, {}, 1,
                             {"--tp", absl::StrCat(prefill_tp)});
    ASSERT_TRUE(s.ok()) << s;
    std::vector<v1::GenerateRequest> requests;
    for (int i = 0; i < 6; ++i) requests.push_back(Request("And God said, Let there be light", 24, 0.7f, 300 + i));
    const std::vector<Output> got = GenerateConcurrently(c, requests);
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message();
      EXPECT_EQ(got[i].tokens, Reference(requests[i], prefill, decode).tokens)
          << "prefill tp " << prefill_tp << ", decode tp " << decode_tp << " request-sharded, stream " << i;
    }
    const v1::ClusterStatusResponse st = c.Status();
    ASSERT_EQ(st.decode_size(), 1);
    EXPECT_EQ(st.decode(0).rank_rows_size(), decode_tp);
    // Every head on the rank that holds a request: c_kv per rank, as `pdctl plan` counts request-sharded chips.
    const ModelConfig& mc = prefill.model->config();
    EXPECT_EQ(st.decode(0).kv_bytes_per_position_per_rank(), 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2);
  }
}

TEST_F(TpClusterTest, ADecodeWorkerWhoseCollectiveFailsStopsServingAndItsStreamsMigrate) {
  // Two decode workers of TP 2; the first one's ranks fail their 200th
  // collective (a few decode steps into the first streams it takes).
  TpModel prefill = TpModel::Load(2), decode = TpModel::Load(2);
  Cluster c;
  c.tls = false;
  c.extra_decode_flags[0] = {"--fault_tp_collective_after", "200"};
  absl::Status s = c.Start(TempDir() + "/tp_fault", false, {"--tp", "2"}, {}, 1, {"--tp", "2"}, 2);
  ASSERT_TRUE(s.ok()) << s;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) requests.push_back(Request("In the beginning God created", 24, 0.7f, 100 + i));
  const std::vector<Output> got = GenerateConcurrently(c, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << "stream " << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, Reference(requests[i], prefill, decode).tokens) << "stream " << i;
  }
  const v1::ClusterStatusResponse st = c.Status();
  ASSERT_EQ(st.decode_size(), 2);
  int broken = 0;
  for (const v1::WorkerStatus& w : st.decode()) {
    if (!w.healthy()) {
      ++broken;
      EXPECT_NE(w.unhealthy_reason().find("injected fault: a tensor-parallel rank's link failed"), std::string::npos)
          << w.unhealthy_reason();
    }
  }
  EXPECT_EQ(broken, 1) << st.ShortDebugString();
  // Its health check says why too (for alerts): the engine stopped.
  const std::string series = "pdserve_worker_unhealthy{reason=\"engine_failed\"}";
  double engine_failed = 0;
  for (int i = 0; i < 200 && engine_failed != 1; ++i) {
    engine_failed = MetricValue(HttpGet(c.decode_metrics(), "/metrics"), series);
    if (engine_failed != 1) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(engine_failed, 1);
}

// A sequence moved between decode workers of different TP sizes: the
// source's KV goes through the same layout conversion as a handoff's, and
// the stream equals the in-process engine that decodes on a model of the
// source's TP until the move, then on one of the target's. Only the first
// decode worker pauses its sequences (--fault_move_at_token); a request
// placed on the second decodes there throughout.
class TpMoveTest : public TpClusterTest {};

TEST_P(TpMoveTest, ASequenceMovedBetweenTpSizesEqualsTheInProcessEngine) {
  const auto [from_tp, to_tp] = GetParam();
  constexpr int kMoveAt = 12;
  TpModel prefill = TpModel::Load(1), from = TpModel::Load(from_tp), to = TpModel::Load(to_tp);
  Cluster c;
  c.tls = false;
  c.extra_decode_flags[0] = {"--tp", absl::StrCat(from_tp), "--fault_move_at_token", absl::StrCat(kMoveAt)};
  c.extra_decode_flags[1] = {"--tp", absl::StrCat(to_tp)};
  c.extra_router_flags = {"--decode_policy", "round_robin", "--rebalance=false"};
  ASSERT_TRUE(c.Start(TempDir() + absl::StrCat("/move", from_tp, "to", to_tp), false, {}, {}, 1, {}, 2).ok());
  const std::string moved_series = "pdserve_decode_moves_out_total{outcome=\"moved\"}";
  int moved = 0;
  for (const v1::GenerateRequest& req : {Request("In the beginning God created", 32, 0.0f, 42),
                                         Request("And God said, Let there be light", 32, 0.8f, 7),
                                         Request("The LORD is my shepherd", 32, 0.9f, 8)}) {
    const double before = MetricValue(HttpGet(c.decode_metrics(0), "/metrics"), moved_series);
    const Output got = c.Generate(req);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    const bool was_moved = MetricValue(HttpGet(c.decode_metrics(0), "/metrics"), moved_series) > before;
    const RefOutput want = was_moved ? Reference(req, prefill, from, &to, kMoveAt) : Reference(req, prefill, to);
    EXPECT_EQ(got.tokens, want.tokens) << "tp " << from_tp << " to " << to_tp << (was_moved ? " (moved): " : ": ")
                                       << req.text();
    EXPECT_EQ(got.text, want.text);
    moved += was_moved ? 1 : 0;
  }
  EXPECT_GE(moved, 1) << c.Logs();
}

INSTANTIATE_TEST_SUITE_P(Sizes, TpMoveTest, ::testing::Values(std::make_pair(2, 1), std::make_pair(1, 2)),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& i) {
                           return absl::StrCat("Tp", i.param.first, "ToTp", i.param.second);
                         });

INSTANTIATE_TEST_SUITE_P(Pairings, TpClusterTest,
                         ::testing::Values(std::make_pair(1, 1), std::make_pair(1, 2), std::make_pair(1, 4),
                                           std::make_pair(2, 1), std::make_pair(2, 2), std::make_pair(2, 4),
                                           std::make_pair(4, 1), std::make_pair(4, 2), std::make_pair(4, 4)),
                         [](const auto& info) {
                           return absl::StrCat("Prefill", info.param.first, "Decode", info.param.second);
                         });

// The GPU paths through the real workers, without a GPU: `--backend=cpu-device`
// runs the CPU kernels behind a GPU's memory contract, so the forward copies
// its logits out, the pool is outside the transport's registered memory,
// and the handoff copies through the backend (prefill: out of the pool;
// decode: landing blocks, then into the pool). Streams equal the
// in-process CPU engine's for device->CPU, CPU->device and device->device.
class DevicePathClusterTest : public TpClusterTest {};

TEST_F(DevicePathClusterTest, HandoffsFromAndIntoDevicePoolsKeepStreamsExact) {
  TpModel prefill = TpModel::Load(1), decode = TpModel::Load(1);
  const std::vector<v1::GenerateRequest> requests = {
      Request("In the beginning God created", 20, 0.0f, 42),
      Request("And it came to pass, when men began to multiply on the face of the earth, and daughters were born "
              "unto them, that the sons of God saw the daughters of men",
              16, 0.8f, 7),
  };
  const std::vector<std::string> device = {"--backend", "cpu-device"};
  struct Pairing {
    const char* name;
    std::vector<std::string> prefill_flags, decode_flags;
  };
  for (const Pairing& p : {Pairing{"device-to-cpu", device, {}}, Pairing{"cpu-to-device", {}, device},
                           Pairing{"device-to-device", device, device}}) {
    SCOPED_TRACE(p.name);
    Cluster c;
    c.tls = false;
    absl::Status s = c.Start(TempDir() + "/" + p.name, false, p.decode_flags, {}, 1, p.prefill_flags);
    ASSERT_TRUE(s.ok()) << s;
    for (const v1::GenerateRequest& req : requests) {
      const auto got = c.Generate(req);
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      const RefOutput want = Reference(req, prefill, decode);
      EXPECT_EQ(got.tokens, want.tokens) << req.text();
      EXPECT_EQ(got.text, want.text);
    }
    // Both requests went through the handoff (no fallback to a local
    // prefill on the decode worker).
    EXPECT_EQ(MetricValue(HttpGet(c.decode_metrics(), "/metrics"), "pdserve_handoff_transfers_total"), 2);
    EXPECT_EQ(MetricValue(HttpGet(c.prefill_metrics(), "/metrics"), "pdserve_handoff_transfers_total"), 2);
    // The workers say which kernels they run.
    const v1::ClusterStatusResponse st = c.Status();
    ASSERT_EQ(st.prefill_size(), 1);
    ASSERT_EQ(st.decode_size(), 1);
    EXPECT_EQ(st.prefill(0).kernels().rfind("cpu-device/", 0) == 0, !p.prefill_flags.empty()) << st.prefill(0).kernels();
    EXPECT_EQ(st.decode(0).kernels().rfind("cpu-device/", 0) == 0, !p.decode_flags.empty()) << st.decode(0).kernels();
  }
}

}  // namespace
}  // namespace pdserve
