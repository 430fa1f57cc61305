// Attack: bytes that are not UTF-8 in a log line. Every server logs
// strings that come from outside (a worker's error message, a line of the
// API key file, a DNS name), and a log line that throws out of LogEvent on
// a gRPC or HTTP thread ends the process. Dumped as JSON unchecked, each
// line below throws (nlohmann's type_error 316, "invalid UTF-8 byte"); each
// test checks that LogEvent writes it instead.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "base/server_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// Runs `log` with stderr sent to a file, and returns what it wrote. A
// throw is the attack succeeding: it is reported, and stderr restored.
template <typename F>
std::string CaptureStderr(F log) {
  char path[] = "/tmp/pdserve-log-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  std::fflush(stderr);
  const int saved = dup(STDERR_FILENO);
  dup2(fd, STDERR_FILENO);
  try {
    log();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "LogEvent threw: " << e.what();
  }
  std::fflush(stderr);
  dup2(saved, STDERR_FILENO);
  close(saved);
  close(fd);
  std::ifstream f(path);
  std::string out((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  unlink(path);
  return out;
}

nlohmann::json OneLine(const std::string& out) {
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  EXPECT_EQ(lines.size(), 1u) << out;
  if (lines.empty()) return nullptr;
  // parse() is strict: it refuses invalid UTF-8, so a line it reads is one
  // every log reader can read.
  return nlohmann::json::parse(lines[0], nullptr, /*allow_exceptions=*/false);
}

TEST(FrontLogTest, InvalidUtf8InAValueIsWrittenAsReplacementCharacters) {
  const std::string out = CaptureStderr([] {
    LogEvent("warning", "api_keys_not_reloaded",
             {{"file", "/etc/keys"}, {"error", "keys:3: 'rate=\xff\xfe': expected rate=R"}});
  });
  const nlohmann::json j = OneLine(out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["event"], "api_keys_not_reloaded");
  EXPECT_EQ(j["file"], "/etc/keys");
  EXPECT_EQ(j["error"], std::string("keys:3: 'rate=") + kReplacement + kReplacement + "': expected rate=R");
}

TEST(FrontLogTest, InvalidUtf8InAKeyIsWrittenAsReplacementCharacters) {
  const std::vector<std::pair<std::string, std::string>> fields = {{"peer\xc3", "10.0.0.1"}};
  const std::string out = CaptureStderr([&] { LogEvent("warning", "x", fields); });
  const nlohmann::json j = OneLine(out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j[std::string("peer") + kReplacement], "10.0.0.1") << out;
}

// Truncated sequences, overlong forms, surrogates and bytes past U+10FFFF:
// each is replaced, the valid text around it kept.
TEST(FrontLogTest, EveryKindOfInvalidSequenceIsReplaced) {
  const std::vector<std::string> bad = {"\x80", "\xc3", "\xe2\x82", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                                        "\xff"};
  for (const std::string& b : bad) {
    const std::string out = CaptureStderr([&] {
      LogEvent("error", "decode_failed", {{"error", "before " + b + " after"}});
    });
    const nlohmann::json j = OneLine(out);
    ASSERT_TRUE(j.is_object()) << out;
    const std::string error = j["error"];
    EXPECT_TRUE(absl::StartsWith(error, "before ")) << error;
    EXPECT_TRUE(absl::EndsWith(error, " after")) << error;
    EXPECT_TRUE(absl::StrContains(error, kReplacement)) << error;
  }
}

TEST(FrontLogTest, ValidUtf8IsUnchanged) {
  const std::string out = CaptureStderr([] {
    LogEvent("info", "x", {{"text", "In the beginning \xe2\x80\x94 \xf0\x9f\x99\x82"}});
  });
  const nlohmann::json j = OneLine(out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["text"], "In the beginning \xe2\x80\x94 \xf0\x9f\x99\x82");
}

}  // namespace
}  // namespace pdserve
