// Readying another process's memory for this process's writes: what a
// sender does to a same-host receiver's pool mapped into it (UCX's shared
// memory, the TCP transport's direct writes), and what bench-kv times.
#ifndef PDSERVE_KV_TRANSFER_PAGES_H_
#define PDSERVE_KV_TRANSFER_PAGES_H_

#include <cstddef>

namespace pdserve::kv {

// Readies `pages` pages from `first_page` (page-aligned, mapped writable)
// for this process's writes without changing a byte, even while others
// write them: one madvise(MADV_POPULATE_WRITE) (kernels before 5.14 refuse
// it), then an atomic add of zero to a word of each page. What the page
// warmers (UCX's PrepareWrites, the TCP transport's mapping) do to a
// same-host receiver's pool; bench-kv times it.
void ReadyPagesForWrites(char* first_page, size_t pages);
size_t PageBytes();

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_PAGES_H_
