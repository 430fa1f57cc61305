// Real server processes for integration tests: started with fork/exec, their
// stderr in a log file, found through the ready file they write, and killed
// (SIGKILL, then reaped) when the handle goes away.
#ifndef PDSERVE_TESTS_SUPPORT_SUBPROCESS_H_
#define PDSERVE_TESTS_SUPPORT_SUBPROCESS_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::testing_support {

class Subprocess {
 public:
  Subprocess() = default;
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Starts argv (argv[0] a path) with extra environment variables; stderr
  // goes to `log_path`.
  absl::Status Start(const std::vector<std::string>& argv, const std::string& log_path,
                     const std::map<std::string, std::string>& env = {});
  // Waits for `ready_file` (JSON) and returns its "grpc_port". Fails early
  // if the process exits, with the tail of its log.
  absl::StatusOr<int> WaitReady(const std::string& ready_file, absl::Duration timeout);
  void Signal(int sig);
  void Kill();
  // Exit status after waiting up to `timeout` (-1 if still running).
  int Wait(absl::Duration timeout);
  pid_t pid() const { return pid_; }
  std::string LogTail() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
};

}  // namespace pdserve::testing_support

#endif  // PDSERVE_TESTS_SUPPORT_SUBPROCESS_H_
