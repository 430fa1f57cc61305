// One side of a real two-process KV handoff over UCX, for the tests.
//
//   kv_peer receive --dtype=bf16 --block-size=16 --blocks=64 [--lease-ms=5000]
//                   [--host=127.0.0.1]
//     Listens (port 0), prints {"port":P}, then one JSON line per commit
//     (position-group checksums) and answers commands on stdin:
//       stats                  -> {"active":..,"quarantined":..,"free":..,...}
//       prefix N               -> caches blocks for the first N prompt tokens
//                                 (filled with 0x5a), prints {"cached":K}
//       quit
//   kv_peer send --port=P --dtype=bf16 --block-size=16 --positions=N
//                [--host=127.0.0.1] [--pause-after-layer=L] [--layer-delay-ms=D]
//     Fills its pool with seeded random bytes, reserves, sends every layer,
//     commits, prints {"status":..,"held":..,"checksums":[[...]],"free":..}.
//     --pause-after-layer prints {"paused":L} and waits for a line on stdin.
//
// The model shape is fixed (4 layers, 2 KV heads, head dim 64).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "kv/block_hash.h"
#include "kv/kv_manager.h"
#include "kv_transfer/layout_copy.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/sender.h"
#include "kv_transfer/ucx_transport.h"

namespace pdserve::kv {
namespace {

const ModelIdentity kModel = HashBytes("kv-peer-model");
constexpr int kGroup = 4;

std::map<std::string, std::string> Flags(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    const size_t eq = a.find('=');
    f[a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2)] =
        eq == std::string::npos ? "1" : a.substr(eq + 1);
  }
  return f;
}

int Int(std::map<std::string, std::string>& f, const std::string& k, int def) {
  int v = def;
  if (f.contains(k)) (void)absl::SimpleAtoi(f[k], &v);
  return v;
}

KvCacheSpec Spec(std::map<std::string, std::string>& f) {
  return {.num_layers = 4, .num_kv_heads = 2, .head_dim = 64, .block_size = Int(f, "block-size", 16),
          .dtype = *ParseDType(f.contains("dtype") ? f["dtype"] : "bf16"), .num_blocks = Int(f, "blocks", 64)};
}

std::vector<int32_t> Tokens(int32_t n) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = 3 + (i * 7) % 90;
  return t;
}

std::string ChecksumJson(const KvCacheSpec& spec, const char* base, absl::Span<const int32_t> table, int32_t n) {
  const std::vector<uint64_t> sums = PositionChecksums(spec, base, table, 0, n, kGroup);
  const size_t groups = sums.size() / spec.num_layers;
  std::vector<std::string> layers;
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    std::vector<std::string> g;
    for (size_t i = 0; i < groups; ++i) g.push_back(absl::StrCat("\"", sums[l * groups + i], "\""));
    layers.push_back(absl::StrCat("[", absl::StrJoin(g, ","), "]"));
  }
  return absl::StrCat("[", absl::StrJoin(layers, ","), "]");
}

void Emit(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

int Receive(std::map<std::string, std::string> f) {
  auto transport = UcxTransport::Create({.name = "kv-peer-recv"});
  if (!transport.ok()) return Emit(absl::StrCat("{\"error\":\"", transport.status().message(), "\"}")), 1;
  const KvCacheSpec spec = Spec(f);
  auto manager = KvManager::Create(spec, &(*transport)->region_allocator());
  if (!manager.ok()) return 1;
  ReceiverOptions ro{.model = kModel, .lease = absl::Milliseconds(Int(f, "lease-ms", 5000))};
  KvManager* kv = manager->get();
  auto receiver = KvReceiver::Create(transport->get(), kv, ro, [&](CommittedSequence s) {
    const int32_t positions = s.kv.num_positions();
    const std::string sums = ChecksumJson(spec, kv->storage().base, s.kv.block_table(), s.kv.num_positions());
    s.kv.Release();
    Emit(absl::StrCat("{\"committed\":", s.id.value, ",\"positions\":", positions,
                      ",\"first_token\":", s.state.first_token, ",\"checksums\":", sums, "}"));
  });
  if (!receiver.ok()) return 1;
  auto port = (*receiver)->Listen(f.contains("host") ? f["host"] : "127.0.0.1", 0);
  if (!port.ok()) return Emit(absl::StrCat("{\"error\":\"", port.status().message(), "\"}")), 1;
  Emit(absl::StrCat("{\"port\":", *port, "}"));
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") break;
    if (line == "stats") {
      const KvReceiver::Stats s = (*receiver)->stats();
      const KvTransferStats m = (*receiver)->metrics();
      const int free = kv->Counts().free;
      Emit(absl::StrCat("{\"active\":", s.active, ",\"quarantined\":", s.quarantined, ",\"free\":", free,
                        ",\"transfers\":", m.transfers, ",\"failures\":", m.failures,
                        ",\"leases_expired\":", m.leases_expired, "}"));
    } else if (line.rfind("prefix ", 0) == 0) {
      int n = 0;
      (void)absl::SimpleAtoi(line.substr(7), &n);
      const auto hashes = BlockHasher(kModel, spec.dtype, spec.block_size).FullBlockHashes(Tokens(n));
      SequenceKv blocks = kv->NewSequence();
      if (kv->Grow(blocks, static_cast<int32_t>(hashes.size()) * spec.block_size).ok()) {
        for (int32_t b : blocks.block_table()) {
          for (int l = 0; l < spec.num_layers; ++l) {
            std::memset(kv->storage().BlockData(l, BlockId{b}), 0x5a, spec.LayerBlockBytes());
          }
        }
        blocks.SetNumPositions(static_cast<int32_t>(hashes.size()) * spec.block_size);
        kv->Publish(blocks, hashes);
      }
      blocks.Release();  // Cached, unreferenced.
      Emit(absl::StrCat("{\"cached\":", hashes.size(), "}"));
    }
  }
  receiver->reset();
  manager->reset();
  return 0;
}

int Send(std::map<std::string, std::string> f) {
  auto transport = UcxTransport::Create({.name = "kv-peer-send"});
  if (!transport.ok()) return 1;
  const KvCacheSpec spec = Spec(f);
  auto manager = KvManager::Create(spec, &(*transport)->region_allocator());
  if (!manager.ok()) return 1;
  KvManager& kv = **manager;
  std::mt19937_64 rng(Int(f, "seed", 11));
  auto* words = static_cast<uint64_t*>(kv.region().data());
  for (size_t i = 0; i < kv.region().size() / 8; ++i) words[i] = rng();
  const int32_t n = Int(f, "positions", 100);
  const int pause_after = Int(f, "pause-after-layer", -1);
  const int delay_ms = Int(f, "layer-delay-ms", 0);
  absl::Status status;
  int32_t held = 0;
  std::string sums = "[]";
  {
    SequenceKv seq = kv.NewSequence();
    KvSender sender(transport->get(), kv.storage(), {.model = kModel, .timeout = absl::Seconds(10)});
    auto conn = sender.Connect(f.contains("host") ? f["host"] : "127.0.0.1", Int(f, "port", 0));
    status = conn.status();
    if (status.ok()) status = kv.Grow(seq, n);
    seq.SetNumPositions(n);
    absl::StatusOr<std::unique_ptr<Handoff>> h = absl::UnknownError("not reserved");
    if (status.ok()) {
      h = sender.Reserve(*conn, {.num_positions = n, .margin_positions = 8, .prompt_tokens = Tokens(n)});
      status = h.status();
    }
    const absl::Time start = absl::Now();
    for (int l = 0; status.ok() && l < spec.num_layers; ++l) {
      status = (*h)->SendLayer(l, seq.block_table());
      if (l == pause_after) {
        Emit(absl::StrCat("{\"paused\":", l, "}"));
        std::string line;
        std::getline(std::cin, line);
      }
      if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    }
    if (status.ok()) {
      held = (*h)->held_positions();
      kv::Commit c;
      c.num_positions = n;
      c.tokens = Tokens(n);
      c.first_token = 77;
      c.seed = 5;
      c.generated = 1;
      status = (*h)->Commit(std::move(c));
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    sums = ChecksumJson(spec, kv.storage().base, seq.block_table(), n);
    seq.Release();
    Emit(absl::StrCat("{\"status\":\"", absl::StatusCodeToString(status.code()), "\",\"message\":\"",
                      absl::StrReplaceAll(status.message(), {{"\"", "'"}}), "\",\"held\":", held,
                      ",\"seconds\":", seconds, ",\"free\":", kv.Counts().free, ",\"checksums\":", sums, "}"));
    if (h.ok()) h->reset();
  }
  manager->reset();
  return status.ok() ? 0 : 3;
}

}  // namespace
}  // namespace pdserve::kv

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string mode = argv[1];
  auto flags = pdserve::kv::Flags(argc, argv);
  if (mode == "receive") return pdserve::kv::Receive(flags);
  if (mode == "send") return pdserve::kv::Send(flags);
  return 2;
}
