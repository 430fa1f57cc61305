#include "kv_transfer/loopback_transport.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {

class LoopbackRemote final : public RemoteRegion {
 public:
  explicit LoopbackRemote(char* base) : base(base) {}
  char* base;
};

}  // namespace

class LoopbackTransport::Conn final : public Connection {
 public:
  Conn(LoopbackTransport* owner, ConnectionHandler* handler, std::string name, std::string peer_host = "")
      : owner_(owner), handler_(handler), name_(std::move(name)), peer_host_(std::move(peer_host)) {}

  std::string peer_host() const override { return peer_host_; }

  void Send(std::string message) override {
    std::shared_ptr<Conn> peer = peer_.lock();
    if (failed_ || peer == nullptr) return;
    peer->owner_->loop_.Post([peer, m = std::move(message)]() mutable {
      if (!peer->failed_ && !peer->closed_ && peer->handler_ != nullptr) peer->handler_->OnMessage(*peer, std::move(m));
    });
  }
  absl::StatusOr<std::shared_ptr<RemoteRegion>> ImportRegion(absl::string_view packed) override {
    if (packed.size() != sizeof(char*)) return absl::InvalidArgumentError("loopback: bad region descriptor");
    char* base;
    std::memcpy(&base, packed.data(), sizeof(base));
    return std::shared_ptr<RemoteRegion>(new LoopbackRemote(base));
  }
  void Put(const void* local, int64_t bytes, RemoteRegion& remote, int64_t remote_offset,
           DoneCallback done) override {
    if (failed_) {
      owner_->Complete(std::move(done), absl::UnavailableError(absl::StrCat("loopback: ", name_, " is down")));
      return;
    }
    std::memcpy(static_cast<LoopbackRemote&>(remote).base + remote_offset, local, bytes);
    owner_->Complete(std::move(done), absl::OkStatus());
  }
  void Flush(DoneCallback done) override {
    owner_->Complete(std::move(done), failed_ ? absl::UnavailableError("loopback: connection is down")
                                              : absl::OkStatus());
  }
  void Close() override {
    if (closed_ || failed_) return;
    closed_ = true;
    if (std::shared_ptr<Conn> peer = peer_.lock()) {
      peer->owner_->loop_.Post([peer] { peer->Disconnect(absl::OkStatus()); });
    }
  }
  bool failed() const override { return failed_; }
  const std::string& name() const override { return name_; }
  void Fail(absl::Status why) override {
    if (failed_) return;
    Disconnect(why.ok() ? absl::UnavailableError("failed") : why);
    failed_ = true;
    if (std::shared_ptr<Conn> peer = peer_.lock()) {
      peer->owner_->loop_.Post([peer] { peer->Disconnect(absl::UnavailableError("connection reset by peer")); });
    }
  }

  // On the owner's loop.
  void Disconnect(absl::Status why) {
    if (failed_ || disconnected_) return;
    disconnected_ = true;
    if (!why.ok()) failed_ = true;
    if (handler_ != nullptr) handler_->OnDisconnected(*this, why);
  }

  LoopbackTransport* owner_;
  ConnectionHandler* handler_;
  std::string name_;
  std::string peer_host_;
  std::weak_ptr<Conn> peer_;
  std::atomic<bool> failed_{false};
  bool closed_ = false;
  bool disconnected_ = false;
};

LoopbackTransport::LoopbackTransport(LoopbackNetwork* network, std::string name)
    : network_(network), name_(std::move(name)) {
  loop_.Start(name_);
}

LoopbackTransport::~LoopbackTransport() {
  {
    absl::MutexLock lock(&network_->mu_);
    for (auto it = network_->listeners_.begin(); it != network_->listeners_.end();) {
      auto cur = it++;
      if (cur->second.first == this) network_->listeners_.erase(cur);
    }
  }
  loop_.Stop();
}

absl::StatusOr<std::string> LoopbackTransport::PackRegion(KvRegion& region) {
  char* base = static_cast<char*>(region.data());
  return std::string(reinterpret_cast<const char*>(&base), sizeof(base));
}

absl::StatusOr<int> LoopbackTransport::Listen(const std::string& host, int port, ConnectionHandler* handler) {
  absl::MutexLock lock(&network_->mu_);
  if (port == 0) port = network_->next_port_++;
  if (network_->listeners_.contains(port)) {
    return absl::AlreadyExistsError(absl::StrCat("loopback: port ", port, " is taken"));
  }
  network_->listeners_[port] = {this, handler};
  return port;
}

absl::StatusOr<Connection*> LoopbackTransport::Connect(const std::string& host, int port,
                                                       ConnectionHandler* handler) {
  LoopbackTransport* server;
  ConnectionHandler* server_handler;
  {
    absl::MutexLock lock(&network_->mu_);
    auto it = network_->listeners_.find(port);
    if (it == network_->listeners_.end()) {
      return absl::UnavailableError(absl::StrCat("loopback: nothing listens on ", host, ":", port));
    }
    std::tie(server, server_handler) = it->second;
  }
  auto client = std::make_shared<Conn>(this, handler, absl::StrCat(name_, "->", host, ":", port));
  auto accepted = std::make_shared<Conn>(server, server_handler, absl::StrCat(server->name_, "<-", name_), name_);
  client->peer_ = accepted;
  accepted->peer_ = client;
  {
    absl::MutexLock lock(&server->mu_);
    server->conns_.push_back(accepted);
  }
  absl::MutexLock lock(&mu_);
  conns_.push_back(client);
  return client.get();
}

void LoopbackTransport::Break() {
  std::vector<std::shared_ptr<Conn>> conns;
  {
    absl::MutexLock lock(&mu_);
    conns = conns_;
  }
  for (auto& c : conns) {
    c->failed_ = true;
    if (std::shared_ptr<Conn> peer = c->peer_.lock()) {
      peer->owner_->loop_.Post([peer] {
        peer->Disconnect(absl::UnavailableError(absl::StrCat("loopback: peer of ", peer->name_, " died")));
      });
    }
  }
}

void LoopbackTransport::Detach(ConnectionHandler* handler) {
  {
    absl::MutexLock lock(&network_->mu_);
    for (auto it = network_->listeners_.begin(); it != network_->listeners_.end();) {
      auto cur = it++;
      if (cur->second.second == handler) network_->listeners_.erase(cur);
    }
  }
  std::vector<std::shared_ptr<Conn>> conns;
  {
    absl::MutexLock lock(&mu_);
    conns = conns_;
  }
  loop_.RunSync([&] {
    for (auto& c : conns) {
      if (c->handler_ != handler) continue;
      c->handler_ = nullptr;
      c->Close();
    }
  });
}

void LoopbackTransport::Complete(DoneCallback done, absl::Status s) {
  if (!done) return;
  {
    absl::MutexLock lock(&mu_);
    if (hold_) {
      held_.emplace_back(std::move(done), std::move(s));
      return;
    }
  }
  loop_.Post([done = std::move(done), s = std::move(s)] { done(s); });
}

void LoopbackTransport::HoldPutCompletions() {
  absl::MutexLock lock(&mu_);
  hold_ = true;
}

void LoopbackTransport::ReleasePutCompletions() {
  std::vector<std::pair<DoneCallback, absl::Status>> held;
  {
    absl::MutexLock lock(&mu_);
    hold_ = false;
    held.swap(held_);
  }
  for (auto& [done, s] : held) {
    loop_.Post([done = std::move(done), s = std::move(s)] { done(s); });
  }
}

}  // namespace pdserve::kv
