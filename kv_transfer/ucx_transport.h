// Transport over UCX (ucp): one worker, owned by one progress thread that
// sleeps on the worker's event fd when idle (UCP_FEATURE_WAKEUP,
// ucp_worker_arm), so an idle process costs a wake-up per lease-check tick.
//
// Data: from the sender's pool into the receiver's pool, both allocated by
// ucp_mem_map(UCP_MEM_MAP_ALLOCATE) through region_allocator(): the pool
// *is* the registered memory, no staging copy (block-size conversion
// aside), and the receiver's packed rkey travels in the reserve answer.
//
// Control: UCX active messages, not a gRPC KvHandoff service, because
// (1) ordering: the commit is sent only after ucp_ep_flush_nbx on the data
// path completed, i.e. after the data is in the receiver's memory, and UCX
// orders it on the endpoint without a second protocol stack to reconcile;
// (2) a dead peer is seen once, by the control endpoint's error handler
// (UCP_ERR_HANDLING_MODE_PEER), for data and control alike; (3) the library
// needs no gRPC, and over TCP the receiver's worker must be progressed
// anyway (emulated RMA, rendezvous), by the same thread. Control messages
// are forced eager (UCP_AM_SEND_FLAG_EAGER) so the receive callback always
// has the whole message.
//
// Puts or rendezvous sends, per transport: measured on a 2-vCPU VM
// (UCX 1.13, 2 MiB messages, ucx_perftest -t ucp_put_bw / ucp_am_bw, 200
// iterations, MB/s as ucx_perftest reports):
//     transport            put        AM (rendezvous)
//     sm (UCX_TLS=sm,self) 12,981     7,016
//     tcp (UCX_TLS=tcp)     1,396     4,815
// so over shared memory the data moves by one-sided puts (cma into the
// mem_map'd pool), and without shared memory (tcp) a Put is an active
// message whose payload the receiver fetches by rendezvous straight into
// its registered pool (SendData / OnData below); `pdctl bench-kv` shows
// both beside the same connection's raw rate.
//
// Two endpoints per connection when the peer is on this machine and
// UCX_TLS allows shared memory: control (active messages, sockaddr
// client-server, UCP_ERR_HANDLING_MODE_PEER: a dead peer is reported) and
// data (puts and flush, created from the server's worker address sent in a
// Hello message, no peer error handling) -- UCX 1.13 drops shared-memory
// lanes from endpoints with peer error handling, which put the data on tcp
// at ~0.5 GB/s between two local processes. Otherwise (another host, or
// UCX_TLS=tcp) the control endpoint carries the data too. Ordering holds
// across the two: the commit is sent only after the data endpoint's flush
// has completed.
//
// Connection setup: a sockaddr listener (needs `tcp` in UCX_TLS even when
// the data goes over shared memory); port 0 picks a free port (Listen
// returns it). Close runs a shutdown handshake (Bye / ByeAck active
// messages, then a flushing ep close) so the peer never sees a reset.
//
// Configuration is UCX's own: UCX_TLS, UCX_NET_DEVICES, etc.
//
// UCX's own log: errors UCX only logs (a connection request it refuses, a
// device list it could not read) are kept, process-wide, for
// RecentErrors(); UCX still prints them too.
//
// Thread safety: as transport.h. Regions from region_allocator() must be
// freed before the transport is destroyed.
#ifndef PDSERVE_KV_TRANSFER_UCX_TRANSPORT_H_
#define PDSERVE_KV_TRANSFER_UCX_TRANSPORT_H_

#include <ucp/api/ucp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "kv_transfer/pages.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {


class UcxTransport final : public Transport {
 public:
  struct Options {
    std::string name = "kv-ucx";
    // The transport loop in SCHED_FIFO when permitted (EventLoop's "Scheduling").
    bool realtime_loop = false;
  };
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const Options& options);
  ~UcxTransport() override;

  EventLoop& loop() override { return loop_; }
  KvRegionAllocator& region_allocator() override;
  absl::StatusOr<std::string> PackRegion(KvRegion& region) override;
  // The base address alone (the first 8 bytes of PackRegion's descriptor).
  std::string WithoutRemoteKey(const std::string& packed) const override { return packed.substr(0, 8); }
  absl::StatusOr<int> Listen(const std::string& host, int port, ConnectionHandler* handler) override;
  absl::StatusOr<Connection*> Connect(const std::string& host, int port, ConnectionHandler* handler) override;
  void Detach(ConnectionHandler* handler) override;
  // The last few errors UCX logged in this process (any transport), oldest
  // first, each "UCX: <message>", joined by "; ".
  std::string RecentErrors() const override;
  // An IPv4 address of a network device UCX can set up connections over
  // (tcp/DEVICE in its resources; loopback first), for a process that only
  // connects out to run a self-check on (kv_transfer/self_check.h).
  // FAILED_PRECONDITION, with UCX's recent errors, when it found none.
  absl::StatusOr<std::string> ConnectableHost() const;

  // UCX's description of a connection's lanes (ucp_ep_print_info), for
  // benchmarks and debugging. REQUIRES: `c` came from this transport.
  std::string Describe(Connection* c);
  // For tools: UCX's handles (use on the loop thread only).
  // A connection's control endpoint (tests pin what a peer can do with UCX
  // directly). REQUIRES: `c` came from this transport.
  ucp_ep_h EndpointOf(Connection* c);
  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // The memory handle of a registered region containing [p, p + n), if any.
  ucp_mem_h FindMemh(const void* p, size_t n) const;
  // Pages of peers' regions readied for writes so far (PrepareWrites), and
  // a wait until every PrepareWrites so far is done (tests).
  int64_t pages_prepared() const;
  void WaitForPreparedWrites();

 private:
  class Conn;
  class Region;
  class Allocator;
  class PageWarmer;
  struct Listener {
    ucp_listener_h listener = nullptr;
    ConnectionHandler* handler = nullptr;
    UcxTransport* owner = nullptr;
  };
  UcxTransport() = default;
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param);
  static void OnConnRequest(ucp_conn_request_h request, void* arg);
  ucs_status_t OnData(const void* header, size_t header_length, void* data, size_t length,
                      const ucp_am_recv_param_t* param);
  // A rendezvous receive into the pool, until its bytes have landed.
  struct Landing {
    Conn* conn;
    void* dst;
    size_t bytes;
  };
  static void OnDataLanded(void* request, ucs_status_t status, size_t length, void* user);
  Conn* AddConn(ConnectionHandler* handler, std::string name);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string worker_address_;
  std::string host_id_;
  std::string context_info_;  // ucp_context_print_info: its transports and devices.
  bool has_shm_ = false;
  EventLoop loop_;
  std::unique_ptr<Allocator> allocator_;
  std::unique_ptr<PageWarmer> warmer_;
  // Loop thread only.
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::vector<std::unique_ptr<Conn>> conns_;
  absl::flat_hash_map<ucp_ep_h, Conn*> by_ep_;
  // Registered regions (any thread, for FindMemh).
  mutable absl::Mutex regions_mu_;
  std::vector<Region*> regions_ ABSL_GUARDED_BY(regions_mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_UCX_TRANSPORT_H_
