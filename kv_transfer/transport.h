// The seam between the handoff protocol and the bytes: a Transport owns one
// progress thread (kv_transfer/event_loop.h) and hands out Connections that
// carry ordered control messages and one-sided writes into a peer's
// registered KV pool. Three implementations: UCX
// (kv_transfer/ucx_transport.h), plain TCP sockets whose every written byte
// passes the handler's check (kv_transfer/tcp_transport.h), and an
// in-process loopback for tests (kv_transfer/loopback_transport.h).
//
// Ordering contract (what the protocol relies on): a control message sent
// after a Flush has completed is delivered after the data of every Put that
// Flush covered is visible in the peer's memory. UCX gives this for active
// messages on the same endpoint as the puts; the loopback copies at Put.
//
// Registered memory: the pool region itself (region_allocator()), so puts
// read and write the KV blocks in place. A pool in device memory, which
// the transport cannot write, keeps this interface: puts land in a pool of
// registered host memory and a commit copies them up (ReceiverOptions::
// pool_backend).
//
// Thread safety: Transport methods may be called from any thread.
// Connection methods and every callback (DoneCallback, ConnectionHandler)
// run on the transport's loop thread only. Connections live as long as
// their transport.
#ifndef PDSERVE_KV_TRANSFER_TRANSPORT_H_
#define PDSERVE_KV_TRANSFER_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kv/kv_cache.h"
#include "kv_transfer/event_loop.h"

namespace pdserve::kv {

using DoneCallback = std::function<void(absl::Status)>;

// A peer's registered region, resolved for writing through one connection.
class RemoteRegion {
 public:
  virtual ~RemoteRegion() = default;
};

class Connection {
 public:
  virtual ~Connection() = default;
  // Queues a control message. Failures surface as OnDisconnected.
  virtual void Send(std::string message) = 0;
  // Resolves the descriptor the peer made with Transport::PackRegion.
  virtual absl::StatusOr<std::shared_ptr<RemoteRegion>> ImportRegion(absl::string_view packed) = 0;
  // Writes `bytes` at `local` to `remote` + `remote_offset`. `local` should
  // lie in this transport's registered memory (else a slower path).
  // done (may be null: the next Flush covers the write): OK, or
  // UNAVAILABLE when the peer is gone.
  virtual void Put(const void* local, int64_t bytes, RemoteRegion& remote, int64_t remote_offset,
                   DoneCallback done) = 0;
  // Completes when every earlier Put is visible at the peer.
  virtual void Flush(DoneCallback done) = 0;
  // True where a message Sent after a Put reaches the peer's handler only
  // once that Put's bytes are in the peer's memory (one ordered stream, or
  // a Put that copies before it returns). Such a connection needs no Flush
  // round trip between a handoff's last Put and its commit.
  virtual bool MessagesFollowPuts() const { return false; }
  // Byte ranges (offset, length) of `remote` that Puts will write soon:
  // where this side writes the peer's memory through a mapping of its own
  // (UCX shared memory), the transport readies those pages in the
  // background, off the Puts' path (each page's first write through a
  // fresh mapping faults, and in a VM also traps to the hypervisor: ~10x
  // the copy). Never changes a byte; optional (a Put to a
  // page not yet readied pays on its own); a no-op elsewhere.
  virtual void PrepareWrites(const std::shared_ptr<RemoteRegion>& remote,
                             const std::vector<std::pair<int64_t, int64_t>>& ranges) {
    (void)remote;
    (void)ranges;
  }
  // Graceful close with a shutdown handshake; the peer sees OnDisconnected
  // with OK.
  virtual void Close() = 0;
  // Gives up on the peer at once (a peer that stopped answering): every
  // outstanding operation completes with an error, this side's handler
  // sees OnDisconnected(why), nothing more is delivered either way, and
  // failed() is true from here on.
  virtual void Fail(absl::Status why) = 0;
  virtual bool failed() const = 0;
  virtual const std::string& name() const = 0;
  // The peer's host as the transport saw it (an accepted connection's
  // client IP; the loopback: the connecting transport's name); "" when
  // the transport cannot tell. Handoff grants bind the sender to it.
  virtual std::string peer_host() const { return ""; }
  // Whether the peer can write this side's registered memory one-sidedly
  // (UCX: a process on this machine, with shared memory between them).
  // Only such a peer is given a region's remote key: any other writes by
  // message (which the receiver checks), and a key would let it read and
  // write the whole region (docs/security.md, "The KV plane").
  virtual bool PeerMayMapMemory() const { return true; }
};

class ConnectionHandler {
 public:
  virtual ~ConnectionHandler() = default;
  virtual void OnMessage(Connection& c, std::string message) = 0;
  // A transport whose writes arrive as messages (the receiver reads each
  // put's bytes itself) asks, on its loop thread, before it writes `bytes`
  // at `dst` for the peer of `c`; false drops the write. One-sided writes
  // (shared memory, RDMA) cannot be asked about.
  virtual bool MayWrite(Connection& c, const void* dst, size_t bytes) {
    (void)c;
    (void)dst;
    (void)bytes;
    return true;
  }
  // For every write MayWrite allowed, exactly once, on the loop thread:
  // its bytes are in place, or will never land (the connection failed).
  // The bytes of a large write land over many turns of the loop, so
  // memory a write was allowed into must not be handed to anyone else
  // before this (the receiver's blocks of an aborted handoff wait for it).
  // `c` is still alive here.
  virtual void WriteLanded(Connection& c, const void* dst, size_t bytes) {
    (void)c;
    (void)dst;
    (void)bytes;
  }
  // Once per connection: OK for a graceful close, else why it failed.
  virtual void OnDisconnected(Connection& c, absl::Status why) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual EventLoop& loop() = 0;
  // Allocates pool regions (and staging buffers) in registered memory.
  virtual KvRegionAllocator& region_allocator() = 0;
  // Remote-access descriptor of a region from region_allocator().
  virtual absl::StatusOr<std::string> PackRegion(KvRegion& region) = 0;
  // A PackRegion descriptor without its remote key (what a peer that does
  // not PeerMayMapMemory gets): enough to address writes by message.
  virtual std::string WithoutRemoteKey(const std::string& packed) const { return packed; }
  // Accepts connections on host:port (0 = any free port); returns the port.
  virtual absl::StatusOr<int> Listen(const std::string& host, int port, ConnectionHandler* handler) = 0;
  // Starts a connection; a peer that is not there shows as OnDisconnected
  // (or a failed Put) shortly after.
  virtual absl::StatusOr<Connection*> Connect(const std::string& host, int port,
                                              ConnectionHandler* handler) = 0;
  // Stops listening for `handler`, closes its connections gracefully, and
  // guarantees no callback reaches it after returning (call it before
  // destroying the handler).
  virtual void Detach(ConnectionHandler* handler) = 0;
  // What the transport's library reported lately without returning it as
  // a status (errors it only logs), to explain a failure; "" if nothing.
  virtual std::string RecentErrors() const { return ""; }
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_TRANSPORT_H_
