// A client that stops reading its Decode stream (its flow-control window
// stays full) must not keep a batch slot and KV: the decode worker cancels
// its request after the stall timeout (or at once when the stream's buffer
// passes its bound), and the batch falls to the streams that read.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

using worker::v1::DecodeEvent;
using worker::v1::DecodeWorker;

constexpr int kMaxTokens = 400;

// A decode worker on the shipped model, each engine step slowed to 5 ms so
// that a 400-token stream runs about 2 s.
struct Worker {
  Subprocess process;
  std::string address;
  int metrics_port = 0;

  absl::Status Start(const std::string& dir, std::vector<std::string> flags) {
    const std::string ready = dir + "/decode.ready";
    std::vector<std::string> argv = {kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel,
                                     "--ready_file", ready, "--fault_step_delay_ms", "5"};
    for (std::string& a : TlsArgs("decode")) argv.push_back(std::move(a));
    argv.insert(argv.end(), flags.begin(), flags.end());
    if (absl::Status s = process.Start(argv, dir + "/decode.log"); !s.ok()) return s;
    absl::StatusOr<int> port = process.WaitReady(ready, absl::Seconds(60));
    if (!port.ok()) return port.status();
    address = absl::StrCat("127.0.0.1:", *port);
    metrics_port = MetricsPort(ready);
    return absl::OkStatus();
  }

  v1::WorkerStatus Status() {
    auto stub = DecodeWorker::NewStub(TestChannel(address, "decode"));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    worker::v1::WorkerInfo info;
    EXPECT_TRUE(stub->Status(&ctx, {}, &info).ok());
    return info.status();
  }
};

// A colocated Decode call with the most logprobs (big chunks). Its channel
// is its own, with a small receive window and no window growth, so that a
// client that does not read fills it after a few tokens.
struct Stream {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<DecodeWorker::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<DecodeEvent>> reader;

  explicit Stream(const std::string& address, int seed) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
    args.SetInt("grpc.use_local_subchannel_pool", 1);  // Not shared with the other streams.
    channel = TestChannel(address, "decode", true, args);
    stub = DecodeWorker::NewStub(channel);
    worker::v1::DecodeRequest req;
    req.set_prefill_here(true);
    worker::v1::WorkRequest* w = req.mutable_request();
    w->set_request_id(absl::StrCat("stall-", seed));
    for (int id : {17, 230, 411, 9, 1200, 77}) w->add_prompt_ids(id);
    w->set_temperature(1.0f);
    w->set_top_p(1.0f);
    w->set_repetition_penalty(1.0f);
    w->set_seed(static_cast<uint64_t>(seed));
    w->set_max_tokens(kMaxTokens);
    w->set_ignore_eos(true);
    w->set_logprobs(20);
    reader = stub->Decode(&ctx, req);
  }

  // Reads to the end: the tokens and the RPC's status.
  std::pair<int, grpc::Status> Drain() {
    int tokens = 0;
    DecodeEvent ev;
    while (reader->Read(&ev)) {
      if (ev.has_chunk()) tokens += ev.chunk().token_ids_size();
    }
    return {tokens, reader->Finish()};
  }
};

// Waits until Status shows `running` sequences, or `limit` passes; returns
// when it did (limit if never).
absl::Duration WaitForRunning(Worker& w, int running, absl::Time since, absl::Duration limit) {
  while (absl::Now() - since < limit) {
    const v1::WorkerStatus st = w.Status();
    if (st.running() == running) return absl::Now() - since;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return limit;
}

void RunStalledClients(Worker& w, absl::Duration must_fall_within) {
  // Two readers and two clients that never read.
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(std::make_unique<Stream>(w.address, i + 1));
  const absl::Time start = absl::Now();
  std::vector<std::pair<int, grpc::Status>> read(2);
  std::vector<std::thread> readers;
  for (int i = 0; i < 2; ++i) readers.emplace_back([&, i] { read[i] = streams[i]->Drain(); });

  // All four start (the readers are still far from done).
  ASSERT_LT(WaitForRunning(w, 4, start, absl::Seconds(1)), absl::Seconds(1)) << w.process.LogTail();
  const absl::Duration fell = WaitForRunning(w, 2, start, must_fall_within + absl::Seconds(5));
  EXPECT_LT(fell, must_fall_within) << "the batch did not fall to the two reading streams in time\n"
                                    << w.process.LogTail();
  const v1::WorkerStatus during = w.Status();
  EXPECT_EQ(during.running(), 2);
  for (auto& t : readers) t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(read[i].second.ok()) << read[i].second.error_message();
    EXPECT_EQ(read[i].first, kMaxTokens) << "a reading stream was cut short";
  }
  // The stalled ones ended early, cancelled, and gave their KV back.
  for (int i = 2; i < 4; ++i) {
    const auto [tokens, status] = streams[i]->Drain();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    EXPECT_LT(tokens, kMaxTokens);
  }
  const v1::WorkerStatus after = w.Status();
  EXPECT_EQ(after.running(), 0);
  EXPECT_EQ(after.kv_blocks_used(), 0) << "the stalled streams' KV was not freed";
  const std::string metrics = HttpGet(w.metrics_port, "/metrics");
  EXPECT_EQ(MetricValue(metrics, "pdserve_stalled_streams_total"), 2) << metrics;
}

TEST(StalledClientTest, StreamsWhoseWriteStallsAreCancelledAfterTheStallTimeout) {
  const std::string dir = TempDir();
  Worker w;
  ASSERT_TRUE(w.Start(dir, {"--stall_timeout_s", "0.5", "--max_buffered_tokens", "100000",
                            "--prefix_cache=false"}).ok());
  // Within the stall timeout + 1 s.
  RunStalledClients(w, absl::Milliseconds(500) + absl::Seconds(1));
}

TEST(StalledClientTest, StreamsWhoseBufferFillsAreCancelledAtOnce) {
  const std::string dir = TempDir();
  Worker w;
  // A stall timeout far away: only the buffer bound can end them early.
  ASSERT_TRUE(w.Start(dir, {"--stall_timeout_s", "60", "--max_buffered_tokens", "16",
                            "--prefix_cache=false"}).ok());
  RunStalledClients(w, absl::Seconds(1));
}

}  // namespace
}  // namespace pdserve
