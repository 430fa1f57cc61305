// Transport over plain TCP sockets, for KV planes that cross machines.
//
// Why not UCX over tcp: UCX 1.13's tcp transport executes PUT requests from
// anyone who reaches its port, before any handshake, at any address the
// peer names (no UCX option turns that off). Here every byte that lands in
// registered memory was read by this transport from the connection's
// stream into a destination it checked: allowed by the connection's
// handler (ConnectionHandler::MayWrite, asked about every data frame), and
// inside one registered region. There is no read operation: a peer learns
// nothing of this side's memory beyond what its handler sends.
//
// Wire (one stream per connection, little-endian, in order):
//   control frame: u32 type, u32 length, then `length` bytes
//                  (Message, at most kMaxMessageBytes; Bye, ByeAck, Flush,
//                  FlushAck with length 0)
//   data frame:    u32 type (Data), u32 0, u64 address, u64 length, then
//                  `length` bytes, read straight into `address`
// A Flush is answered by a FlushAck once every frame before it was read,
// so every earlier Put's bytes are in the peer's memory: the ordering
// contract of transport.h. A data frame that the handler refuses, or that
// lies outside every registered region, is read and dropped (the connection
// stays up); one longer than any region could hold (and than
// kMaxMessageBytes), an unknown type or an oversized message fails the
// connection.
//
// Puts are zero-copy on both sides: the sender's bytes go from the caller's
// memory to the socket (sendmsg of header + payload), the receiver's from
// the socket into the destination. A Put's `done` completes once its bytes
// are handed to the kernel.
//
// Registered memory: with direct writes on (the default), each region is
// a memory file of its own (memfd) mapped shared; otherwise ordinary
// page-aligned host memory (HostKvRegionAllocator). The transport tracks
// both.
//
// Same host: a connection accepted from this host's own network stack (a
// loopback address, or the very address it reached: the kernel's view of
// the socket, never the peer's word) PeerMayMapMemory(), and the receiver
// hands it the full PackRegion descriptor: base, size, this process's pid,
// where a random nonce lies in it, and the region's memory file. The peer
// first reads the nonce back with process_vm_readv (so the pid names this
// process in its own pid namespace too), then opens /proc/PID/fd/N, checks
// the inode, maps the file and writes its Puts with one non-temporal copy
// each (a background thread readies the mapping's pages first: a page's
// first write through a fresh mapping faults, ~10x the copy in a VM);
// where it cannot open the file, with process_vm_writev (slower:
// the kernel pins every page). The kernel allows either only to a process
// of the same user, which may read and write this one's memory anyway, so
// it opens nothing new; where it is not allowed the Puts go as data
// frames. Such writes cannot be refused (as any shared-memory transport's).
// Any other peer gets the base address alone (WithoutRemoteKey) and writes
// by data frames.
//
// Close: Bye / ByeAck; the peer's handler sees OnDisconnected(OK), this
// side's none (as the other transports). Connect to a peer that is not
// there: OnDisconnected(UNAVAILABLE naming host:port) shortly after.
//
// Lifetime: an accepted Connection is freed once it is over, so a peer that
// connects and disconnects forever costs the listening side nothing that
// stays: its Connection* is valid until its OnDisconnected returns, or, for
// one this side Close()d (or whose handler was Detach()ed), until its close
// handshake ends; call nothing on it after Close(). A Connection this side
// made with Connect stays valid, failed and inert, until its handler is
// Detach()ed (or the transport destroyed), as transport.h promises: the
// side that connects hands its pointers to other threads (a sender's
// handoffs), and it connects only to the receivers it is sent to, so what
// it keeps is bounded by its reconnects (a few hundred bytes each).
//
// Thread safety: as transport.h. Regions from region_allocator() must be
// freed before the transport is destroyed.
#ifndef PDSERVE_KV_TRANSFER_TCP_TRANSPORT_H_
#define PDSERVE_KV_TRANSFER_TCP_TRANSPORT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

class TcpTransport final : public Transport {
 public:
  struct Options {
    std::string name = "kv-tcp";
    // The transport loop in SCHED_FIFO when permitted (EventLoop's "Scheduling").
    bool realtime_loop = false;
    // Same-host peers may write this side's regions directly (see "Same
    // host"); false: every peer writes by data frames.
    bool direct_writes = true;
  };
  // The largest control message either side accepts.
  static constexpr uint32_t kMaxMessageBytes = 64u << 20;

  static absl::StatusOr<std::unique_ptr<TcpTransport>> Create(const Options& options);
  ~TcpTransport() override;

  EventLoop& loop() override { return loop_; }
  KvRegionAllocator& region_allocator() override;
  absl::StatusOr<std::string> PackRegion(KvRegion& region) override;
  // The base address alone: what a peer that is not on this host gets.
  std::string WithoutRemoteKey(const std::string& packed) const override { return packed.substr(0, 8); }
  // Host is an IPv4 or IPv6 literal ("127.0.0.1", "::1", "[::1]").
  absl::StatusOr<int> Listen(const std::string& host, int port, ConnectionHandler* handler) override;
  absl::StatusOr<Connection*> Connect(const std::string& host, int port, ConnectionHandler* handler) override;
  void Detach(ConnectionHandler* handler) override;

  // Connections not yet freed, accepted and connected (tests: none leak).
  int64_t live_connections() const { return live_.load(); }

 private:
  class Conn;
  class Region;
  class Allocator;
  struct Listener {
    int fd = -1;
    ConnectionHandler* handler = nullptr;
  };
  TcpTransport() = default;

  // Loop thread: handles the ready events without blocking; true if any.
  bool Progress();
  void Accept(Listener& l);
  Conn* AddConn(int fd, ConnectionHandler* handler, std::string name, std::string peer_host, bool connected,
                bool outbound, bool same_host = false);
  // Frees a connection that is over, after the tasks already posted.
  void Retire(uint64_t id);
  // The registered region holding [address, address + bytes), by base.
  bool Registered(uint64_t address, uint64_t bytes) const;
  uint64_t LargestRegion() const;

  std::string name_;
  bool direct_writes_ = true;
  int epoll_fd_ = -1;
  EventLoop loop_;
  std::unique_ptr<Allocator> allocator_;
  std::atomic<int64_t> live_{0};
  // Loop thread only. Ids are epoll's keys: listeners have the top bit.
  uint64_t next_id_ = 1;
  absl::flat_hash_map<uint64_t, Listener> listeners_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Conn>> conns_;
  // Outbound connections that are over, kept until their handler is
  // Detach()ed (see Lifetime above).
  std::vector<std::unique_ptr<Conn>> husks_;
  std::vector<char> scratch_;  // Where dropped payloads are read.
  // Random: a same-host peer reads it from this process to know the pid it
  // was given is this process's (see "Same host").
  char nonce_[16] = {};
  // Registered regions (allocated and freed on any thread).
  mutable absl::Mutex regions_mu_;
  std::vector<Region*> regions_ ABSL_GUARDED_BY(regions_mu_);
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_TCP_TRANSPORT_H_
