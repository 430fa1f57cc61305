// Small pieces every pdserve server binary shares: structured log lines,
// the ready file, loopback address checks and signal handling.
#ifndef PDSERVE_BASE_SERVER_UTIL_H_
#define PDSERVE_BASE_SERVER_UTIL_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace pdserve {

// One JSON object per line on stderr: {"ts":..,"level":..,"event":..,k:v..}.
// Lines below the minimum level (debug < info < warning < error; default
// info) are dropped. Keys and values may hold any bytes: what is not UTF-8
// is written as U+FFFD, so every line is valid JSON and logging never
// throws.
void LogEvent(const char* level, const char* event,
              std::initializer_list<std::pair<const char*, std::string>> fields = {});
void LogEvent(const char* level, const char* event, const std::vector<std::pair<std::string, std::string>>& fields);

// Process-wide settings every server binary starts with, called once right
// after its flags are parsed. In optimized builds (NDEBUG) it turns off
// abseil's mutex deadlock detection: the distribution's abseil may be built
// with it on, and then every lock and unlock of every absl::Mutex updates a
// global lock-order graph under one spin lock; with thousands of request
// threads (a burst queued in the router) that graph was a visible share of
// the router's CPU. Debug builds keep it.
void ConfigureServerProcess();

// INVALID_ARGUMENT for a name other than debug, info, warning or error.
absl::Status SetMinLogLevel(const std::string& level);
// Whether a line at `level` would be written (check before building
// expensive fields).
bool LogLevelEnabled(const char* level);

// Writes `json` to `path` atomically (temp file + rename), for supervisors
// and tests that wait for a server to be ready and need its ports.
absl::Status WriteReadyFile(const std::string& path, const std::string& json);

// Blocks SIGINT and SIGTERM in the calling thread (call first in main, so
// every thread inherits the mask), ignores SIGPIPE, and returns;
// WaitForShutdownSignal then waits for one of them and returns its number.
void BlockShutdownSignals();
int WaitForShutdownSignal();

// A random number drawn once per process: tells a restarted server from
// the one that ran at the same address before.
uint64_t ProcessInstanceId();

}  // namespace pdserve

#endif  // PDSERVE_BASE_SERVER_UTIL_H_
