/*
 * copy.c - see copy.h.
 */
#include "core/copy.h"

#if defined(__x86_64__)
#include <emmintrin.h>

/* 128 bytes per round: all loaded before any is stored, so a load is held
 * up by a store of the same address modulo 4096 (the distances this loop
 * serves) at most once a round. Named registers, not an array: gcc -O2
 * kept an array on the stack, at half the speed. SSE2 is every x86-64's:
 * no dispatch; 32-byte moves measured no faster. */
void tcc__copy_by_vectors(void *dst, const void *src, size_t n) {
  char *d = dst;
  const char *s = src;
  for (; n >= 128; d += 128, s += 128, n -= 128) {
    const __m128i r0 = _mm_loadu_si128((const __m128i *)s), r1 = _mm_loadu_si128((const __m128i *)(s + 16)),
                  r2 = _mm_loadu_si128((const __m128i *)(s + 32)), r3 = _mm_loadu_si128((const __m128i *)(s + 48)),
                  r4 = _mm_loadu_si128((const __m128i *)(s + 64)), r5 = _mm_loadu_si128((const __m128i *)(s + 80)),
                  r6 = _mm_loadu_si128((const __m128i *)(s + 96)), r7 = _mm_loadu_si128((const __m128i *)(s + 112));
    _mm_storeu_si128((__m128i *)d, r0);
    _mm_storeu_si128((__m128i *)(d + 16), r1);
    _mm_storeu_si128((__m128i *)(d + 32), r2);
    _mm_storeu_si128((__m128i *)(d + 48), r3);
    _mm_storeu_si128((__m128i *)(d + 64), r4);
    _mm_storeu_si128((__m128i *)(d + 80), r5);
    _mm_storeu_si128((__m128i *)(d + 96), r6);
    _mm_storeu_si128((__m128i *)(d + 112), r7);
  }
  memcpy(d, s, n); /* under 128 bytes: no rep movsb */
}

#else /* other CPUs have no such rep movsb: memcpy it is */

void tcc__copy_by_vectors(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }

#endif
