#include "kv_transfer/pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace pdserve::kv {

size_t PageBytes() {
  static const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return kPage;
}

void ReadyPagesForWrites(char* first_page, size_t pages) {
  (void)madvise(first_page, pages * PageBytes(), MADV_POPULATE_WRITE);
  for (size_t i = 0; i < pages; ++i) {
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(first_page + i * PageBytes()), uint64_t{0}, __ATOMIC_RELAXED);
  }
}

}  // namespace pdserve::kv
