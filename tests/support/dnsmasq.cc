#include "tests/support/dnsmasq.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::testing_support {
namespace {

constexpr char kDnsmasqPath[] = "/usr/sbin/dnsmasq";
constexpr absl::Duration kWait = absl::Seconds(10);

// Binds `type` on 127.0.0.1:`port` (0: any) and returns the socket, or -1.
int BindLoopback(int type, int port) {
  const int fd = socket(AF_INET, type, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A loopback port free for both UDP and TCP (dnsmasq takes both) right now.
int FreeDnsPort() {
  for (int attempt = 0; attempt < 20; ++attempt) {
    const int udp = BindLoopback(SOCK_DGRAM, 0);
    if (udp < 0) continue;
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    getsockname(udp, reinterpret_cast<sockaddr*>(&addr), &len);
    const int port = ntohs(addr.sin_port);
    const int tcp = BindLoopback(SOCK_STREAM, port);
    close(udp);
    if (tcp >= 0) {
      close(tcp);
      return port;
    }
  }
  return 0;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << contents;
    if (!f.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::InternalError(absl::StrCat("cannot rename to ", path));
  return absl::OkStatus();
}

}  // namespace

bool DnsmasqAvailable() { return access(kDnsmasqPath, X_OK) == 0; }

absl::Status Dnsmasq::Start(const std::string& dir) {
  hosts_path_ = absl::StrCat(dir, "/dnsmasq.hosts");
  log_path_ = absl::StrCat(dir, "/dnsmasq.log");
  if (absl::Status s = WriteFileAtomically(hosts_path_, ""); !s.ok()) return s;
  // The port is free when picked, not reserved: another process may take it
  // before dnsmasq binds, so a bind failure picks again.
  absl::Status started = absl::UnavailableError("no free port");
  for (int attempt = 0; attempt < 3; ++attempt) {
    port_ = FreeDnsPort();
    if (port_ == 0) continue;
    // Only the hosts file answers (--local=/#/ makes every other name
    // NXDOMAIN, not REFUSED for want of an upstream); nothing is cached, so
    // a reload shows at once.
    started = process_.Start(
        {kDnsmasqPath, "--keep-in-foreground", "--no-resolv", "--no-hosts", "--no-poll", "--bind-interfaces",
         "--listen-address=127.0.0.1", absl::StrCat("--port=", port_), absl::StrCat("--addn-hosts=", hosts_path_),
         "--local=/#/", "--local-ttl=0", "--cache-size=0", "--user=root", "--pid-file=", "--log-facility=-"},
        log_path_);
    if (!started.ok()) return started;
    hosts_reads_ = 0;
    started = WaitForHostsRead(1);
    if (started.ok()) return absl::OkStatus();
    process_.Kill();
  }
  return started;
}

absl::Status Dnsmasq::SetHosts(const std::map<std::string, std::vector<std::string>>& name_to_ips) {
  std::string contents;
  for (const auto& [name, ips] : name_to_ips) {
    for (const std::string& ip : ips) absl::StrAppend(&contents, ip, " ", name, "\n");
  }
  if (absl::Status s = WriteFileAtomically(hosts_path_, contents); !s.ok()) return s;
  process_.Signal(SIGHUP);
  return WaitForHostsRead(hosts_reads_ + 1);
}

std::string Dnsmasq::server() const { return absl::StrCat("127.0.0.1:", port_); }

absl::Status Dnsmasq::WaitForHostsRead(int reads) {
  // dnsmasq logs "read FILE - N names" after loading FILE, and loads it
  // before it answers anything else.
  const std::string marker = absl::StrCat("read ", hosts_path_, " - ");
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    std::ifstream f(log_path_);
    std::stringstream log;
    log << f.rdbuf();
    int seen = 0;
    for (absl::string_view line : absl::StrSplit(log.str(), '\n')) {
      if (absl::StrContains(line, marker)) ++seen;
    }
    hosts_reads_ = seen;
    if (seen >= reads) return absl::OkStatus();
    if (process_.Wait(absl::Milliseconds(10)) != -1) {
      return absl::UnavailableError(absl::StrCat("dnsmasq exited:\n", process_.LogTail()));
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("dnsmasq did not read ", hosts_path_, " within ",
                                                  absl::FormatDuration(kWait), ":\n", process_.LogTail()));
}

}  // namespace pdserve::testing_support
