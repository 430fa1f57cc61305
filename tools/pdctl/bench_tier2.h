// `pdctl bench-tier2`: the prefix cache's second tier (kv/tier2_store.h) on
// a directory's disk, beside that disk's own sequential read rate measured
// in the same run.
//
// It fills a pool of --tier2-blocks blocks of the bench-kv shape
// (--kv-layers, --kv-heads, --head-dim, --kv, --block-size) with random
// bytes, writes every block to a store in --tier2-dir (default: a new
// directory under /var/tmp, removed after), and then, rounds in turn:
//   - drops the store's files from the page cache (fdatasync, then
//     POSIX_FADV_DONTNEED), and reads every block back and checks it, in
//     restores of --tier2-restore-blocks blocks (a prefix's worth), as the
//     engine does;
//   - drops a plain file of the same bytes from the cache and reads it
//     front to back in pieces of one block's file: the disk's sequential
//     read rate, the limit for the restores.
// It prints the write rate, the restore rate (and per restore), the disk's
// read rate and their ratio, medians over --iters rounds. Where the disk is
// a virtual machine's, the host may cache it: both reads see the same.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_TIER2_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_TIER2_H_

#include "absl/status/status.h"

namespace pdserve::pdctl {

// `json`: one JSON object instead of the table.
absl::Status RunBenchTier2(bool json);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_TIER2_H_
