// In-process Transport for tests: a LoopbackNetwork joins LoopbackTransports
// (each with its own loop thread) by port. Put copies immediately, so the
// ordering contract of transport.h holds trivially; control messages are
// posted to the peer's loop in order.
//
// Fault hooks for tests: Break() fails both ends of a connection (a dead
// peer); HoldPutCompletions() delays put and flush completions (a sender
// stuck mid-stream) until ReleasePutCompletions().
//
// Thread safety: as transport.h. The network outlives its transports.
#ifndef PDSERVE_KV_TRANSFER_LOOPBACK_TRANSPORT_H_
#define PDSERVE_KV_TRANSFER_LOOPBACK_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

class LoopbackTransport;

class LoopbackNetwork {
 private:
  friend class LoopbackTransport;
  absl::Mutex mu_;
  absl::flat_hash_map<int, std::pair<LoopbackTransport*, ConnectionHandler*>> listeners_ ABSL_GUARDED_BY(mu_);
  int next_port_ ABSL_GUARDED_BY(mu_) = 40000;
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(LoopbackNetwork* network, std::string name);
  ~LoopbackTransport() override;

  EventLoop& loop() override { return loop_; }
  KvRegionAllocator& region_allocator() override { return allocator_; }
  absl::StatusOr<std::string> PackRegion(KvRegion& region) override;
  absl::StatusOr<int> Listen(const std::string& host, int port, ConnectionHandler* handler) override;
  absl::StatusOr<Connection*> Connect(const std::string& host, int port, ConnectionHandler* handler) override;
  void Detach(ConnectionHandler* handler) override;

  // Fails every connection of this transport, both ends (a crash).
  void Break();
  void HoldPutCompletions();
  void ReleasePutCompletions();

 private:
  class Conn;
  friend class LoopbackNetwork;
  void Complete(DoneCallback done, absl::Status s);

  LoopbackNetwork* network_;
  std::string name_;
  HostKvRegionAllocator allocator_;
  EventLoop loop_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  bool hold_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::pair<DoneCallback, absl::Status>> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_LOOPBACK_TRANSPORT_H_
