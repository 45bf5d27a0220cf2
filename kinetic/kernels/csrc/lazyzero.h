// Zeroing a large buffer without touching it: the KV cache is allocated whole at start (as
// llama-server allocates its -c), but the memory it takes from the system grows with the
// pages actually written, as calloc's does, instead of all of it at once.
#pragma once

#include <cstddef>

namespace kn {

// Make the `bytes` bytes at p read as zeros. The whole system pages inside the range are
// handed back to the kernel (madvise MADV_DONTNEED: on private anonymous memory, which is
// what malloc gives, they read as zeros and take no memory until written); the partial pages
// at either end, and the whole range wherever madvise is refused or a page it dropped does
// not read back as zero (memory that is not private and anonymous), are memset. Returns the
// bytes handed back (0: all of it was memset). Never fails: the result always reads as zeros.
size_t lazy_zero(void* p, size_t bytes);

// Hand the whole system pages inside the `bytes` bytes at p back to the kernel (madvise
// MADV_DONTNEED), for rows whose values nobody will read again (a sliding-window layer's
// cache rows every sequence has passed): they then take no memory until written. The bytes
// of the partial pages at either end are left as they are, and nothing changes wherever
// madvise is refused. Only for private anonymous memory (what malloc gives), where a page
// handed back reads as zeros. Returns the bytes handed back.
size_t release_pages(void* p, size_t bytes);

}  // namespace kn
