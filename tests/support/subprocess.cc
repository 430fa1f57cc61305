#include "tests/support/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace pdserve::testing_support {

Subprocess::~Subprocess() { Kill(); }

absl::Status Subprocess::Start(const std::vector<std::string>& argv, const std::string& log_path,
                               const std::map<std::string, std::string>& env) {
  log_path_ = log_path;
  pid_ = fork();
  if (pid_ < 0) return absl::InternalError("fork failed");
  if (pid_ == 0) {
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
      close(fd);
    }
    // The test's own blocked signals must not leak into the server.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    // Default dispositions, as a shell or container runtime gives: a
    // server must not rely on the test ignoring SIGPIPE for it.
    signal(SIGPIPE, SIG_DFL);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return absl::OkStatus();
}

std::string Subprocess::LogTail() const {
  std::ifstream f(log_path_);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  return s.size() > 3000 ? s.substr(s.size() - 3000) : s;
}

absl::StatusOr<int> Subprocess::WaitReady(const std::string& ready_file, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream f(ready_file);
    if (f) {
      nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
      if (j.is_object() && j.contains("grpc_port")) return j["grpc_port"].get<int>();
    }
    int status = 0;
    if (pid_ > 0 && waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::UnavailableError(absl::StrCat("process exited (status ", status, "):\n", LogTail()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("not ready within ", absl::FormatDuration(timeout), ":\n", LogTail()));
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

void Subprocess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (pid_ > 0) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return -1;
}

}  // namespace pdserve::testing_support
