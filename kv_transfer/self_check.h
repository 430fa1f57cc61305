// Whether a transport can carry a KV handoff at all, tried for real: the
// process connects to a listener of its own on `host` and one control
// message goes each way. That exercises what a handoff needs before the
// first one arrives: the listener, the library's view of the network
// device a connection comes in on, endpoint creation on both sides and the
// control path. (UCX, for one, lists its network devices once, at start,
// from /sys/class/net; without /sys its listener still binds, but it
// refuses every connection request, and no status says so: the peer only
// sees no answer.)
//
// A worker reports a failed check as its health verdict (NOT_SERVING with
// the reason) and keeps serving its Status; the router ejects it.
//
// Thread safety: CheckTransport and TransportSelfCheck may be used from
// any thread except the transport's loop thread (they wait on it).
#ifndef PDSERVE_KV_TRANSFER_SELF_CHECK_H_
#define PDSERVE_KV_TRANSFER_SELF_CHECK_H_

#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

// OK once a message sent over a new connection to a fresh listener on
// host:0 has come back; else UNAVAILABLE (DEADLINE_EXCEEDED after
// `timeout` without an answer, or the Listen/Connect error) whose message
// starts "KV handoff self-check", names host:port, and ends with the
// transport's RecentErrors() when it has any. The listener is removed and
// the connections closed before it returns; they stay allocated in the
// transport (connections live as long as their transport).
absl::Status CheckTransport(Transport& transport, const std::string& host, absl::Duration timeout);

struct SelfCheckOptions {
  // An address on the network device handoffs use (the decode worker's KV
  // listen address; for a sender, UcxTransport::ConnectableHost()).
  std::string host = "127.0.0.1";
  // Over loopback the answer takes milliseconds; this leaves room for a
  // loaded machine, since a false failure keeps the worker out of service
  // until a re-check passes.
  absl::Duration timeout = absl::Seconds(5);
  // While the last check failed, it runs again this often (zero: never).
  // Once one passes there are no more: handoff traffic itself shows a
  // transport that breaks later. UCX fixes its device list at start, so
  // its usual failure (no /sys) lasts until the worker restarts; the
  // re-check is for failures that pass (a port or firewall rule).
  absl::Duration recheck_period = absl::Seconds(10);
};

// Runs CheckTransport at construction (before returning), then again every
// recheck_period on a thread of its own until one passes.
// REQUIRES: the transport outlives this object.
class TransportSelfCheck {
 public:
  TransportSelfCheck(Transport* transport, SelfCheckOptions options);
  // A check that cannot run (no address to check on): fails with `why` for
  // good.
  explicit TransportSelfCheck(absl::Status why);
  ~TransportSelfCheck();
  TransportSelfCheck(const TransportSelfCheck&) = delete;
  TransportSelfCheck& operator=(const TransportSelfCheck&) = delete;

  // "" while the last check passed, else its message.
  std::string reason() const;

 private:
  void Recheck();

  Transport* transport_ = nullptr;
  const SelfCheckOptions options_;
  mutable absl::Mutex mu_;
  std::string reason_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread recheck_;
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_SELF_CHECK_H_
