#include "lazyzero.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace kn {

namespace {

// Whether the page at q reads as zeros (after MADV_DONTNEED a private anonymous page is the
// shared zero page: reading it commits nothing).
bool page_is_zero(const unsigned char* q, size_t page) {
  for (size_t i = 0; i < page; i += sizeof(uint64_t)) {
    uint64_t w;
    std::memcpy(&w, q + i, sizeof w);
    if (w) return false;
  }
  return true;
}

}  // namespace

size_t lazy_zero(void* p, size_t bytes) {
  unsigned char* b = static_cast<unsigned char*>(p);
  const long ps = sysconf(_SC_PAGESIZE);
  const uintptr_t page = ps > 0 ? uintptr_t(ps) : 4096;
  const uintptr_t start = (reinterpret_cast<uintptr_t>(b) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(b) + bytes) / page * page;
  if (bytes < 4 * page || end <= start) {
    std::memset(b, 0, bytes);
    return 0;
  }
  unsigned char* first = reinterpret_cast<unsigned char*>(start);
  unsigned char* last = reinterpret_cast<unsigned char*>(end);
  if (madvise(first, end - start, MADV_DONTNEED) != 0 || !page_is_zero(first, page) ||
      !page_is_zero(last - page, page)) {
    std::memset(b, 0, bytes);
    return 0;
  }
  std::memset(b, 0, size_t(first - b));
  std::memset(last, 0, size_t(b + bytes - last));
  return end - start;
}

size_t release_pages(void* p, size_t bytes) {
  const long ps = sysconf(_SC_PAGESIZE);
  const uintptr_t page = ps > 0 ? uintptr_t(ps) : 4096;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  const uintptr_t start = (at + page - 1) / page * page;
  const uintptr_t end = (at + bytes) / page * page;
  if (end <= start) return 0;
  if (madvise(reinterpret_cast<void*>(start), end - start, MADV_DONTNEED) != 0) return 0;
  return end - start;
}

}  // namespace kn
