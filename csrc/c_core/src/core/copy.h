/*
 * copy.h - the core's bulk copies of user data between host buffers
 * (staging spans, rings, outputs): memcpy, except where memcpy is slow.
 *
 * glibc copies from 2-3 KiB up to about half a megabyte with `rep movsb`.
 * On AMD Zen CPUs (EPYC among them) that instruction runs 10-17x slower
 * when the destination lies 1 to 31 bytes after the source modulo 4096
 * (32 KiB at 2.8 GB/s instead of 46 on this project's test machine): a
 * 1 MiB all_reduce of a tensor at 4 or 16 bytes past a page boundary took
 * 4.5x as long as one at the boundary. Torch aligns tensors to 64 bytes,
 * so only views at odd element offsets meet that distance, but nothing
 * rules them out. Those copies run a plain vector loop instead, which no
 * distance slows down; every other copy is memcpy's.
 */
#ifndef TCC_CORE_COPY_H
#define TCC_CORE_COPY_H

#include <stdint.h>
#include <string.h>

/* Below this memcpy does not use rep movsb (nor is much time at stake). */
#define TCC_COPY_ALIAS_MIN_BYTES 1024
/* Distances (modulo 4096) that are slow: up to 31 measured, a margin on top. */
#define TCC_COPY_ALIAS_MAX_DIST 63

/* The vector loop (copy.c): a forward copy of non-overlapping buffers. */
void tcc__copy_by_vectors(void *dst, const void *src, size_t n);

/* Whether copying to dst from src would meet rep movsb's slow distances. */
static inline int tcc__copy_aliased(const void *dst, const void *src, size_t n) {
  const uintptr_t dist = ((uintptr_t)dst - (uintptr_t)src) & 4095u;
  return n >= TCC_COPY_ALIAS_MIN_BYTES && dist != 0 && dist <= TCC_COPY_ALIAS_MAX_DIST;
}

/* memcpy: dst and src do not overlap. */
static inline void tcc__copy(void *dst, const void *src, size_t n) {
  if (tcc__copy_aliased(dst, src, n)) tcc__copy_by_vectors(dst, src, n);
  else memcpy(dst, src, n);
}

/* memmove that skips a copy onto itself: dst and src may overlap. */
static inline void tcc__move(void *dst, const void *src, size_t n) {
  if (n == 0 || dst == src) return;
  const uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  const int overlap = d < s ? s - d < n : d - s < n;
  if (overlap) memmove(dst, src, n);
  else tcc__copy(dst, src, n);
}

#endif /* TCC_CORE_COPY_H */
