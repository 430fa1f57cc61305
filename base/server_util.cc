#include "base/server_util.h"

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace pdserve {

namespace {

int LevelRank(const std::string& level) {
  if (level == "debug") return 0;
  if (level == "info") return 1;
  if (level == "warning") return 2;
  if (level == "error") return 3;
  return -1;
}

std::atomic<int> min_level{1};

}  // namespace

absl::Status SetMinLogLevel(const std::string& level) {
  const int r = LevelRank(level);
  if (r < 0) return absl::InvalidArgumentError("log level: debug, info, warning or error, not '" + level + "'");
  min_level = r;
  return absl::OkStatus();
}

bool LogLevelEnabled(const char* level) { return LevelRank(level) >= min_level.load(); }

void LogEvent(const char* level, const char* event,
              std::initializer_list<std::pair<const char*, std::string>> fields) {
  std::vector<std::pair<std::string, std::string>> v;
  for (const auto& [k, val] : fields) v.emplace_back(k, val);
  LogEvent(level, event, v);
}

void LogEvent(const char* level, const char* event, const std::vector<std::pair<std::string, std::string>>& fields) {
  if (!LogLevelEnabled(level)) return;
  nlohmann::ordered_json j;
  j["ts"] = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  j["level"] = level;
  j["event"] = event;
  for (const auto& [k, v] : fields) j[k] = v;
  // Fields carry strings from outside (a worker's error, a key file's line,
  // a DNS name): bytes that are not UTF-8 become U+FFFD, as a strict dump
  // would throw, and a throw here ends the process.
  const std::string line = j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

absl::Status WriteReadyFile(const std::string& path, const std::string& json) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    f << json << "\n";
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

void BlockShutdownSignals() {
  // A write to a peer that has gone (a client reset mid-stream) must be an
  // EPIPE error, not the end of the process: OpenSSL's and libevent's
  // socket writes do not pass MSG_NOSIGNAL.
  signal(SIGPIPE, SIG_IGN);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

uint64_t ProcessInstanceId() {
  static const uint64_t id = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return id;
}

void ConfigureServerProcess() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

}  // namespace pdserve
