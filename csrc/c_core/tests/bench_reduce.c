/*
 * bench_reduce.c - throughput of tcc__reduce_n (SUM, out of place) at
 * 4 MiB per source, next to memcpy of 4 MiB.
 *
 * "traffic GB/s" counts every byte read and written (nsrc + 1 buffers for
 * a reduction, 2 for memcpy), so the two are comparable; "input GB/s"
 * counts only the source bytes consumed. Best of several timed rounds.
 * TCCOMM_REDUCE_ISA=generic measures the portable kernels.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

#define BYTES_PER_SOURCE (4u << 20)
#define MAX_SOURCES 4
#define ROUNDS 7
#define MIN_ROUND_NS 50000000 /* 50 ms */

static void *buffers[MAX_SOURCES + 1];

/* Best seconds per call over ROUNDS rounds of at least MIN_ROUND_NS each. */
static double time_reduce(tcc_dtype_t dt, int nsrc, int use_memcpy) {
  size_t count = BYTES_PER_SOURCE / tcc_dtype_size(dt);
  const void *srcs[MAX_SOURCES];
  for (int s = 0; s < nsrc; s++) srcs[s] = buffers[s];
  void *dst = buffers[MAX_SOURCES];
  double best = 1e30;
  for (int round = 0; round < ROUNDS; round++) {
    long calls = 0;
    int64_t start = tcc__now_ns(), elapsed;
    do {
      if (use_memcpy) memcpy(dst, srcs[0], BYTES_PER_SOURCE);
      else tcc__reduce_n(dst, srcs, nsrc, count, dt, TCC_SUM, 1.0);
      calls++;
      elapsed = tcc__now_ns() - start;
    } while (elapsed < MIN_ROUND_NS);
    double per_call = (double)elapsed * 1e-9 / (double)calls;
    if (per_call < best) best = per_call;
  }
  return best;
}

static void report(const char *name, int nsrc, int buffers_touched, double seconds) {
  double traffic = (double)BYTES_PER_SOURCE * buffers_touched / seconds * 1e-9;
  double input = (double)BYTES_PER_SOURCE * nsrc / seconds * 1e-9;
  printf("%-9s %4d %10.1f %13.1f %11.1f\n", name, nsrc, seconds * 1e6, traffic, input);
}

int main(void) {
  for (int b = 0; b <= MAX_SOURCES; b++) {
    buffers[b] = aligned_alloc(64, BYTES_PER_SOURCE);
    if (buffers[b] == NULL) return 1;
    /* Small positive patterns: finite in every dtype, no denormal slow paths. */
    uint16_t *words = buffers[b];
    for (size_t i = 0; i < BYTES_PER_SOURCE / 2; i++)
      words[i] = (uint16_t)(0x3C00 + ((i * 7 + (size_t)b) & 0x3FF));
  }
  const char *isa = getenv("TCCOMM_REDUCE_ISA");
  printf("tcc__reduce_n SUM, %u MiB per source, kernels=%s\n", BYTES_PER_SOURCE >> 20,
         isa ? isa : "auto");
  printf("%-9s %4s %10s %13s %11s\n", "dtype", "nsrc", "us/call", "traffic GB/s", "input GB/s");
  report("memcpy", 1, 2, time_reduce(TCC_FLOAT32, 1, 1));
  static const tcc_dtype_t dtypes[] = {TCC_FLOAT32, TCC_BFLOAT16, TCC_FLOAT16, TCC_FLOAT64,
                                       TCC_INT32};
  for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
    for (int nsrc = 2; nsrc <= 4; nsrc += 2)
      report(tcc_dtype_name(dtypes[d]), nsrc, nsrc + 1, time_reduce(dtypes[d], nsrc, 0));
  for (int b = 0; b <= MAX_SOURCES; b++) free(buffers[b]);
  return 0;
}
