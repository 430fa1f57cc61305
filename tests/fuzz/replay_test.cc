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
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"

// The fuzz targets, compiled under these names for this test (see
// CMakeLists.txt).
extern "C" int FuzzSafetensors(const uint8_t* data, size_t size);
extern "C" int FuzzConfig(const uint8_t* data, size_t size);
extern "C" int FuzzTokenizerJson(const uint8_t* data, size_t size);
extern "C" int FuzzTokenize(const uint8_t* data, size_t size);

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

TEST(FuzzCorpusReplayTest, Safetensors) {
  const std::vector<Seed> seeds = ReadCorpus("safetensors");
  ASSERT_GE(seeds.size(), 10u);
  int valid = 0, bad = 0;
  for (const Seed& s : seeds) {
    SCOPED_TRACE(s.name);
    // Named first: a failed check inside the target aborts the process.
    std::fprintf(stderr, "replaying safetensors/%s\n", s.name.c_str());
    EXPECT_EQ(FuzzSafetensors(Data(s), s.bytes.size()), 0);
    const absl::Status parsed = SafetensorsFile::Parse(s.bytes, s.name).status();
    if (absl::StartsWith(s.name, "valid_")) {
      ++valid;
      EXPECT_TRUE(parsed.ok()) << parsed;
    } else if (absl::StartsWith(s.name, "bad_")) {
      ++bad;
      EXPECT_FALSE(parsed.ok());
    }
  }
  EXPECT_GT(valid, 0);
  EXPECT_GT(bad, 0);
}

TEST(FuzzCorpusReplayTest, Config) {
  const std::vector<Seed> seeds = ReadCorpus("config");
  ASSERT_GE(seeds.size(), 10u);
  int valid = 0, bad = 0;
  for (const Seed& s : seeds) {
    SCOPED_TRACE(s.name);
    // Named first: a failed check inside the target aborts the process.
    std::fprintf(stderr, "replaying config/%s\n", s.name.c_str());
    EXPECT_EQ(FuzzConfig(Data(s), s.bytes.size()), 0);
    const absl::Status parsed = ParseModelConfig(s.bytes, s.name).status();
    if (absl::StartsWith(s.name, "valid_")) {
      ++valid;
      EXPECT_TRUE(parsed.ok()) << parsed;
    } else if (absl::StartsWith(s.name, "bad_")) {
      ++bad;
      EXPECT_FALSE(parsed.ok());
    } else if (absl::StartsWith(s.name, "gen_")) {
      ModelConfig c;
      const absl::Status applied = ApplyGenerationConfig(s.bytes, s.name, c);
      EXPECT_TRUE(applied.ok()) << applied;
    }
  }
  EXPECT_GT(valid, 0);
  EXPECT_GT(bad, 0);
}

// The tokenizer targets abort on any broken promise, so replaying is the check.
TEST(FuzzCorpusReplayTest, TokenizerJson) {
  const std::vector<Seed> seeds = ReadCorpus("tokenizer_json");
  ASSERT_GE(seeds.size(), 8u);
  for (const Seed& s : seeds) {
    SCOPED_TRACE(s.name);
    FuzzTokenizerJson(Data(s), s.bytes.size());
    const bool loads = tok::Tokenizer::FromJson(s.bytes, "", "seed").ok();
    if (absl::StartsWith(s.name, "valid_")) EXPECT_TRUE(loads);
    if (absl::StartsWith(s.name, "bad_")) EXPECT_FALSE(loads);
  }
}

TEST(FuzzCorpusReplayTest, Tokenize) {
  const std::vector<Seed> seeds = ReadCorpus("tokenize");
  ASSERT_GE(seeds.size(), 8u);
  for (const Seed& s : seeds) {
    SCOPED_TRACE(s.name);
    FuzzTokenize(Data(s), s.bytes.size());
  }
}

}  // namespace
}  // namespace pdserve
