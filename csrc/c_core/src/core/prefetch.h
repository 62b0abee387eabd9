/*
 * prefetch.h - cache hints for lines another CPU passes to this one:
 * asked for ahead of the access, so that their trip between the CPUs
 * overlaps other work instead of stalling it. Hints only: they never
 * fault, never change memory, and a guess that misses costs a trip.
 */
#ifndef TCC_CORE_PREFETCH_H
#define TCC_CORE_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

#include "core/base.h"

/* The line at p in this CPU's cache, to be read. */
static inline void tcc__prefetch_read(const void *p) { __builtin_prefetch(p, 0, 3); }

/* The line at p in this CPU's cache, writable: the CPU that read it last
 * gives its copy up now, not when the write comes (a write to a line
 * another CPU holds waits for that, and so does every locked or
 * sequentially consistent store after it). */
static inline void tcc__prefetch_write(const void *p) {
#if defined(__x86_64__)
  __asm__ volatile("prefetchw %0" ::"m"(*(const char *)p)); /* a no-op on CPUs without it */
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

/* Every line that holds a byte of [p, p + bytes). */
static inline void tcc__prefetch_read_span(const void *p, size_t bytes) {
  const uintptr_t end = (uintptr_t)p + bytes;
  for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)(TCC_CACHELINE - 1); a < end; a += TCC_CACHELINE)
    tcc__prefetch_read((const void *)a);
}
static inline void tcc__prefetch_write_span(const void *p, size_t bytes) {
  const uintptr_t end = (uintptr_t)p + bytes;
  for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)(TCC_CACHELINE - 1); a < end; a += TCC_CACHELINE)
    tcc__prefetch_write((const void *)a);
}

#endif /* TCC_CORE_PREFETCH_H */
