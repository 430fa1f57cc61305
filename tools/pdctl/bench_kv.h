// `pdctl bench-kv`: moves the KV of one request between two processes
// (this process sends; a child `pdctl bench-kv --kv-role=receive`
// receives) over --kv-transport (tcp, the workers' default, or ucx) and
// prints the handoff's GB/s and per-request time next to raw puts of the
// same message sizes (one per layer) on the same connection, measured in
// the same run, a cross-process memcpy of the same bytes (the machine's
// limit for moving them between processes), and, for ucx, UCX's own
// ucx_perftest (ucp_am_bw, the same UCX_* environment, inherited by the
// child, and message size), run by this command.
//
// Shape: --model DIR, else --kv-layers/--kv-heads/--head-dim (default: the
// 125M benchmark shape, 12 x 4 x 64), --kv DTYPE, --block-size,
// --prompt-len. Bytes moved = whole blocks of every layer (scales included).
//
// --with-prefill loads the model (--model, else a random 125M model written
// to a temp dir), runs a real prefill forward on the sending side with the
// KV streamed layer by layer as each layer's K/V are written (a backend
// decorator observes WriteKv), and reports
//   unhidden = t(commit acknowledged) - t(last layer computed)
// (the forward's end: the first token needs the logits) beside one layer's
// raw transfer time (the target: unhidden <= one layer), and the time from
// the last layer's K/V being written to the ack.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_KV_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_KV_H_

#include <string>

#include "absl/status/status.h"

namespace pdserve::pdctl {

// The options pdctl shares with other commands; the rest are bench-kv's own
// flags (--prompt-len, --iters, --kv-layers, --kv-heads, --head-dim,
// --with-prefill, --show-lanes, --kv-role).
struct BenchKvCommon {
  std::string model_dir;  // Empty: shape flags (or a random 125M model with --with-prefill).
  std::string kv = "bf16";
  int block_size = 16;
  int threads = 1;
  bool json = false;
};

absl::Status RunBenchKv(const BenchKvCommon& common);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_KV_H_
