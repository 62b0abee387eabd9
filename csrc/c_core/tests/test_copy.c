/*
 * test_copy.c - the core's bulk copies (core/copy.h): every distance
 * between source and destination modulo 4096, the vector loop's and
 * memcpy's, sizes around the loop's round and the alias threshold, and
 * moves between overlapping buffers in both directions, each compared
 * byte for byte with a reference made by a plain byte loop.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/copy.h"

#define PAGE 4096u
#define MAX_BYTES (3u * PAGE + 77u)

static unsigned char pattern_at(size_t i) { return (unsigned char)(i * 131u + 7u + (i >> 8)); }

/* Copies n bytes to dst + dist from a page-aligned src and checks the copy
 * and the bytes either side of it (which must be untouched). */
static void check_copy(unsigned char *src, unsigned char *dst_page, size_t dist, size_t n) {
  unsigned char *dst = dst_page + dist;
  memset(dst_page, 0xEE, dist + n + 64);
  tcc__copy(dst, src, n);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += dst[i] != pattern_at(i);
  for (size_t i = 0; i < dist; i++) bad += dst_page[i] != 0xEE;
  for (size_t i = 0; i < 64; i++) bad += dst[n + i] != 0xEE;
  CHECK(bad == 0, "copy of %zu bytes at distance %zu: %zu bytes wrong", n, dist, bad);
}

static void test_every_distance(void) {
  unsigned char *src = aligned_alloc(PAGE, 4 * PAGE);
  unsigned char *dst = aligned_alloc(PAGE, 6 * PAGE);
  for (size_t i = 0; i < 4 * PAGE; i++) src[i] = pattern_at(i);
  const size_t sizes[] = {0, 1, 127, 128, 129, TCC_COPY_ALIAS_MIN_BYTES - 1, TCC_COPY_ALIAS_MIN_BYTES,
                          TCC_COPY_ALIAS_MIN_BYTES + 1, 2 * PAGE + 3, MAX_BYTES};
  for (size_t dist = 0; dist < PAGE + 80; dist += dist < 80 || dist > PAGE - 80 ? 1 : 61)
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) check_copy(src, dst, dist, sizes[k]);
  free(src);
  free(dst);
}

/* Which copies take the vector loop: exactly the slow distances, from the
 * threshold on. */
static void test_aliased_choice(void) {
  static char buf[2 * PAGE];
  const size_t big = TCC_COPY_ALIAS_MIN_BYTES;
  CHECK(!tcc__copy_aliased(buf, buf, big), "distance 0");
  CHECK(tcc__copy_aliased(buf + 1, buf, big), "distance 1");
  CHECK(tcc__copy_aliased(buf + 16, buf, big), "distance 16");
  CHECK(tcc__copy_aliased(buf + TCC_COPY_ALIAS_MAX_DIST, buf, big), "distance %d", TCC_COPY_ALIAS_MAX_DIST);
  CHECK(!tcc__copy_aliased(buf + TCC_COPY_ALIAS_MAX_DIST + 1, buf, big), "distance past the range");
  CHECK(tcc__copy_aliased(buf + PAGE + 16, buf, big), "distance 16 modulo 4096");
  CHECK(!tcc__copy_aliased(buf, buf + 16, big), "destination before the source");
  CHECK(!tcc__copy_aliased(buf + 16, buf, big - 1), "under the threshold");
}

/* Moves within one buffer, forwards and backwards, by small and large
 * shifts: the result is what a copy through a scratch buffer gives. */
static void test_overlapping_moves(void) {
  enum { LEN = 3 * PAGE };
  unsigned char *buf = malloc(LEN), *want = malloc(LEN), *tmp = malloc(LEN);
  const size_t shifts[] = {1, 16, 63, 64, 1000, PAGE + 16};
  const size_t sizes[] = {1, 200, TCC_COPY_ALIAS_MIN_BYTES + 5, PAGE + 33};
  for (size_t a = 0; a < sizeof shifts / sizeof shifts[0]; a++)
    for (size_t b = 0; b < sizeof sizes / sizeof sizes[0]; b++)
      for (int forward = 0; forward < 2; forward++) {
        const size_t shift = shifts[a], n = sizes[b];
        if (shift + n > LEN) continue;
        const size_t from = forward ? 0 : shift, to = forward ? shift : 0;
        for (size_t i = 0; i < LEN; i++) buf[i] = want[i] = pattern_at(i);
        memcpy(tmp, want + from, n);
        memcpy(want + to, tmp, n);
        tcc__move(buf + to, buf + from, n);
        CHECK(memcmp(buf, want, LEN) == 0, "move of %zu bytes by %s%zu: wrong", n, forward ? "+" : "-", shift);
      }
  tcc__move(buf, buf, LEN); /* onto itself: nothing to do */
  tcc__move(NULL, NULL, 0);
  free(buf);
  free(want);
  free(tmp);
}

int main(void) {
  test_aliased_choice();
  test_every_distance();
  test_overlapping_moves();
  printf("test_copy: %ld failures\n", check_failures);
  CHECK_DONE();
}
