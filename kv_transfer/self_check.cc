#include "kv_transfer/self_check.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {

constexpr char kPing[] = "pdserve-kv-self-check";

// The listener's side: sends every message back.
class Echo final : public ConnectionHandler {
 public:
  void OnMessage(Connection& c, std::string message) override { c.Send(std::move(message)); }
  void OnDisconnected(Connection&, absl::Status) override {
    if (!closed_.HasBeenNotified()) closed_.Notify();
  }
  void WaitClosed(absl::Duration timeout) { closed_.WaitForNotificationWithTimeout(timeout); }

 private:
  absl::Notification closed_;
};

// The connecting side: the answer, or the connection's end, settles it.
class Probe final : public ConnectionHandler {
 public:
  void OnMessage(Connection&, std::string message) override {
    Settle(message == kPing ? absl::OkStatus() : absl::InternalError("the answer differs from the message sent"));
  }
  void OnDisconnected(Connection&, absl::Status why) override {
    Settle(why.ok() ? absl::UnavailableError("the connection was closed before the answer") : std::move(why));
  }
  absl::Status Wait(absl::Duration timeout) {
    if (!settled_.WaitForNotificationWithTimeout(timeout)) {
      return absl::DeadlineExceededError(absl::StrCat("no answer within ", absl::FormatDuration(timeout)));
    }
    absl::MutexLock lock(&mu_);
    return result_;
  }

 private:
  void Settle(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (settled_.HasBeenNotified()) return;
    result_ = std::move(s);
    settled_.Notify();
  }
  absl::Mutex mu_;
  absl::Status result_ ABSL_GUARDED_BY(mu_);
  absl::Notification settled_;
};

}  // namespace

absl::Status CheckTransport(Transport& transport, const std::string& host, absl::Duration timeout) {
  Echo echo;
  Probe probe;
  std::string where = host;
  absl::Status result;
  absl::StatusOr<int> port = transport.Listen(host, 0, &echo);
  if (!port.ok()) {
    result = port.status();
  } else {
    where = absl::StrCat(host, ":", *port);
    absl::StatusOr<Connection*> conn = transport.Connect(host, *port, &probe);
    if (!conn.ok()) {
      result = conn.status();
    } else {
      transport.loop().Post([c = *conn] { c->Send(kPing); });
      result = probe.Wait(timeout);
      if (!result.ok()) transport.loop().RunSync([c = *conn, &result] { c->Fail(result); });
    }
  }
  transport.Detach(&probe);
  // After an answer, this side's graceful close reaches the listener's side
  // first, so neither end is left waiting for the other's.
  if (result.ok()) echo.WaitClosed(timeout);
  transport.Detach(&echo);
  if (result.ok()) return result;
  std::string message = absl::StrCat("KV handoff self-check over ", where, " failed: ", result.message());
  if (const std::string log = transport.RecentErrors(); !log.empty()) {
    absl::StrAppend(&message, " (transport log: ", log, ")");
  }
  return absl::UnavailableError(message);
}

TransportSelfCheck::TransportSelfCheck(Transport* transport, SelfCheckOptions options)
    : transport_(transport), options_(std::move(options)) {
  const absl::Status first = CheckTransport(*transport_, options_.host, options_.timeout);
  if (first.ok()) return;
  {
    absl::MutexLock lock(&mu_);
    reason_ = std::string(first.message());
  }
  if (options_.recheck_period > absl::ZeroDuration()) recheck_ = std::thread([this] { Recheck(); });
}

TransportSelfCheck::TransportSelfCheck(absl::Status why) {
  absl::MutexLock lock(&mu_);
  reason_ = std::string(why.message());
}

TransportSelfCheck::~TransportSelfCheck() {
  stop_.Notify();
  if (recheck_.joinable()) recheck_.join();
}

std::string TransportSelfCheck::reason() const {
  absl::MutexLock lock(&mu_);
  return reason_;
}

void TransportSelfCheck::Recheck() {
  while (!stop_.WaitForNotificationWithTimeout(options_.recheck_period)) {
    const absl::Status s = CheckTransport(*transport_, options_.host, options_.timeout);
    absl::MutexLock lock(&mu_);
    reason_ = std::string(s.message());
    if (s.ok()) return;
  }
}

}  // namespace pdserve::kv
