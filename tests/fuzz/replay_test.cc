// Replays the committed fuzz corpora through the fuzz targets in every build
// (no clang or libFuzzer needed), and checks what the seed file names promise:
//   valid_*  accepted by the parser,
//   bad_*    refused by the parser,
//   gen_*    (config corpus) accepted by ApplyGenerationConfig,
//   anything else (e.g. crash-* inputs a fuzzer found): only "does not crash".
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "text/tokenizer.h"
#include "gtest/gtest.h"
#include "router/tool_calls.h"
#include "grammar/json_schema.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/wire.h"
#include "pdserve/v1/worker.pb.h"
#include "proto/received.h"
#include "router/openai/request.h"
#include "tools/pdctl/bench_trace.h"

// The fuzz targets, compiled under these names for this test (see
// CMakeLists.txt).
extern "C" int FuzzSafetensors(const uint8_t* data, size_t size);
extern "C" int FuzzConfig(const uint8_t* data, size_t size);
extern "C" int FuzzTokenizerJson(const uint8_t* data, size_t size);
extern "C" int FuzzTokenize(const uint8_t* data, size_t size);
extern "C" int FuzzWire(const uint8_t* data, size_t size);
extern "C" int FuzzGrant(const uint8_t* data, size_t size);
extern "C" int FuzzBenchTrace(const uint8_t* data, size_t size);
extern "C" int FuzzReceived(const uint8_t* data, size_t size);
extern "C" int FuzzOpenAiRequest(const uint8_t* data, size_t size);
extern "C" int FuzzJsonSchema(const uint8_t* data, size_t size);
extern "C" int FuzzToolCalls(const uint8_t* data, size_t size);

namespace pdserve {
namespace {

namespace fs = std::filesystem;

struct Seed {
  std::string name;
  std::string bytes;
};

std::vector<Seed> ReadCorpus(const std::string& corpus) {
  const fs::path dir = fs::path(PDSERVE_SOURCE_DIR) / "tests/fuzz/corpus" / corpus;
  std::vector<Seed> seeds;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    seeds.push_back({e.path().filename().string(), std::string(std::istreambuf_iterator<char>(f),
                                                               std::istreambuf_iterator<char>())});
  }
  EXPECT_FALSE(ec) << dir << ": " << ec.message();
  std::sort(seeds.begin(), seeds.end(),
            [](const Seed& a, const Seed& b) { return a.name < b.name; });
  return seeds;
}

const uint8_t* Data(const Seed& s) { return reinterpret_cast<const uint8_t*>(s.bytes.data()); }

// Runs `target` over every seed of `corpus` (named first on stderr: a broken
// promise inside a target aborts the process), then checks what each seed's
// name says with `accepts` (the parser's verdict): valid_* accepted, bad_*
// refused. `extra` sees every seed for corpus-specific names.
void Replay(const std::string& corpus, size_t min_seeds, int (*target)(const uint8_t*, size_t),
            const std::function<bool(const Seed&)>& accepts,
            const std::function<void(const Seed&)>& extra = nullptr) {
  const std::vector<Seed> seeds = ReadCorpus(corpus);
  ASSERT_GE(seeds.size(), min_seeds);
  int valid = 0, bad = 0;
  for (const Seed& s : seeds) {
    SCOPED_TRACE(s.name);
    std::fprintf(stderr, "replaying %s/%s\n", corpus.c_str(), s.name.c_str());
    EXPECT_EQ(target(Data(s), s.bytes.size()), 0);
    if (absl::StartsWith(s.name, "valid_")) {
      ++valid;
      EXPECT_TRUE(accepts(s));
    } else if (absl::StartsWith(s.name, "bad_")) {
      ++bad;
      EXPECT_FALSE(accepts(s));
    }
    if (extra) extra(s);
  }
  EXPECT_GT(valid, 0);
  EXPECT_GT(bad, 0);
}

TEST(FuzzCorpusReplayTest, Safetensors) {
  Replay("safetensors", 10, FuzzSafetensors, [](const Seed& s) {
    const absl::Status parsed = SafetensorsFile::Parse(s.bytes, s.name).status();
    return parsed.ok();
  });
}

TEST(FuzzCorpusReplayTest, Config) {
  Replay(
      "config", 10, FuzzConfig,
      [](const Seed& s) { return ParseModelConfig(s.bytes, s.name).ok(); },
      [](const Seed& s) {
        if (!absl::StartsWith(s.name, "gen_")) return;
        ModelConfig c;
        const absl::Status applied = ApplyGenerationConfig(s.bytes, s.name, c);
        EXPECT_TRUE(applied.ok()) << applied;
      });
}

TEST(FuzzCorpusReplayTest, TokenizerJson) {
  Replay("tokenizer_json", 8, FuzzTokenizerJson,
         [](const Seed& s) { return tok::Tokenizer::FromJson(s.bytes, "", "seed").ok(); });
}

TEST(FuzzCorpusReplayTest, KvHandoffGrant) {
  const kv::GrantKey key = *kv::GrantKey::FromBytes(std::string(32, 'k'));
  Replay("grant", 4, FuzzGrant, [&](const Seed& s) {
    absl::StatusOr<kv::Grant> g = kv::DecodeGrant(s.bytes);
    kv::GrantRefusal why;
    return g.ok() && kv::VerifyGrant(key, *g, g->receiver, absl::FromUnixSeconds(0), &why).ok();
  });
}

TEST(FuzzCorpusReplayTest, KvHandoffWire) {
  Replay("wire", 8, FuzzWire, [](const Seed& s) { return kv::Decode(s.bytes).ok(); });
}

TEST(FuzzCorpusReplayTest, BenchTraceJsonl) {
  Replay("bench_trace", 8, FuzzBenchTrace,
         [](const Seed& s) { return pdctl::ParseTraceJsonl(s.bytes, s.name).ok(); });
}

// The first byte picks the type, as in the target.
TEST(FuzzCorpusReplayTest, ReceivedWorkerMessages) {
  Replay("received", 6, FuzzReceived, [](const Seed& s) {
    if (s.bytes.empty()) return false;
    const std::string body = s.bytes.substr(1);
    switch (static_cast<uint8_t>(s.bytes[0]) % 3) {
      case 0: {
        worker::v1::DecodeEvent m;
        return rpc::ParseReceived(body, &m).ok();
      }
      case 1: {
        worker::v1::PrefillEvent m;
        return rpc::ParseReceived(body, &m).ok();
      }
      default: {
        worker::v1::WorkerInfo m;
        return rpc::ParseReceived(body, &m).ok();
      }
    }
  });
}

// Every tokenize seed is valid input; the target itself checks its promises.
TEST(FuzzCorpusReplayTest, OpenAiRequestBodies) {
  Replay("openai", 10, FuzzOpenAiRequest, [](const Seed& s) {
    if (s.bytes.empty()) return false;
    const auto endpoint = s.bytes[0] % 2 == 0 ? router::openai::Endpoint::kCompletions
                                              : router::openai::Endpoint::kChatCompletions;
    return router::openai::DecodeRequest(endpoint, absl::string_view(s.bytes).substr(1)).ok();
  });
}

TEST(FuzzCorpusReplayTest, JsonSchemas) {
  Replay("json_schema", 10, FuzzJsonSchema,
         [](const Seed& s) { return grammar::CompileJsonSchema(s.bytes, {}).ok(); });
}

// valid_: text with at least one call; bad_: text with none.
TEST(FuzzCorpusReplayTest, ToolCalls) {
  Replay("tool_calls", 8, FuzzToolCalls, [](const Seed& s) {
    router::ToolCallParser p("call", !s.bytes.empty() && (s.bytes[0] & 16) != 0 ? router::ToolSyntax::kLlama31
                                                                                 : router::ToolSyntax::kQwen);
    p.Feed(absl::string_view(s.bytes).substr(s.bytes.empty() ? 0 : 1));
    p.Finish();
    return !p.calls().empty();
  });
}

TEST(FuzzCorpusReplayTest, Tokenize) {
  const std::vector<Seed> seeds = ReadCorpus("tokenize");
  ASSERT_GE(seeds.size(), 8u);
  for (const Seed& s : seeds) {
    SCOPED_TRACE(s.name);
    EXPECT_EQ(FuzzTokenize(Data(s), s.bytes.size()), 0);
  }
}

}  // namespace
}  // namespace pdserve
