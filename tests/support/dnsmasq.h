// A real dnsmasq for discovery tests: it listens on 127.0.0.1 at a free port
// (UDP and TCP) and answers only from a hosts file the test rewrites; every
// other name under it is NXDOMAIN. Killed (SIGKILL) with the object.
//
// Thread safety: not thread-safe; one test thread drives it.
#ifndef PDSERVE_TESTS_SUPPORT_DNSMASQ_H_
#define PDSERVE_TESTS_SUPPORT_DNSMASQ_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/support/subprocess.h"

namespace pdserve::testing_support {

// Whether the dnsmasq binary (Debian dnsmasq-base) is installed.
bool DnsmasqAvailable();

class Dnsmasq {
 public:
  Dnsmasq() = default;
  Dnsmasq(const Dnsmasq&) = delete;
  Dnsmasq& operator=(const Dnsmasq&) = delete;

  // Starts dnsmasq with an empty hosts file and returns once it has read it
  // (its sockets are bound by then). `dir` holds the hosts file and the log.
  // REQUIRES: not started yet.
  absl::Status Start(const std::string& dir);
  // Replaces every name's addresses (IPv4 or IPv6 literals) and returns once
  // dnsmasq has re-read them: queries from then on see exactly these.
  // REQUIRES: Start succeeded.
  absl::Status SetHosts(const std::map<std::string, std::vector<std::string>>& name_to_ips);
  // "127.0.0.1:PORT".
  std::string server() const;
  std::string LogTail() const { return process_.LogTail(); }

 private:
  // Waits until the log shows the hosts file read `reads` times in all.
  absl::Status WaitForHostsRead(int reads);

  Subprocess process_;
  std::string hosts_path_;
  std::string log_path_;
  int port_ = 0;
  int hosts_reads_ = 0;  // Of hosts_path_, by dnsmasq, so far.
};

}  // namespace pdserve::testing_support

#endif  // PDSERVE_TESTS_SUPPORT_DNSMASQ_H_
