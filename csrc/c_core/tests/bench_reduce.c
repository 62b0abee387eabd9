/*
 * bench_reduce.c - throughput of tcc__reduce_n (SUM, out of place) at
 * 4 MiB per source, next to memcpy of 4 MiB.
 *
 *   bench_reduce [BYTES_PER_SOURCE]   e.g. 16K: the buffers stay in L1 and
 *                                     the kernels' arithmetic shows, not memory
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

#define DEFAULT_BYTES_PER_SOURCE (4u << 20)
#define MAX_SOURCES 4
#define ROUNDS 7
#define MIN_ROUND_NS 50000000 /* 50 ms */

static void *buffers[MAX_SOURCES + 1];
static size_t bytes_per_source = DEFAULT_BYTES_PER_SOURCE;

/* Best seconds per call over ROUNDS rounds of at least MIN_ROUND_NS each. */
static double time_reduce(tcc_dtype_t dt, int nsrc, int use_memcpy) {
  size_t count = bytes_per_source / tcc_dtype_size(dt);
  const void *srcs[MAX_SOURCES];
  for (int s = 0; s < nsrc; s++) srcs[s] = buffers[s];
  void *dst = buffers[MAX_SOURCES];
  double best = 1e30;
  for (int round = 0; round < ROUNDS; round++) {
    long calls = 0;
    int64_t start = tcc__now_ns(), elapsed;
    do {
      if (use_memcpy) memcpy(dst, srcs[0], bytes_per_source);
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
  double traffic = (double)bytes_per_source * buffers_touched / seconds * 1e-9;
  double input = (double)bytes_per_source * nsrc / seconds * 1e-9;
  printf("%-9s %4d %10.2f %13.1f %11.1f\n", name, nsrc, seconds * 1e6, traffic, input);
}

int main(int argc, char **argv) {
  if (argc > 1) {
    char *end;
    unsigned long long n = strtoull(argv[1], &end, 10);
    if (*end == 'K' || *end == 'k') n <<= 10, end++;
    else if (*end == 'M' || *end == 'm') n <<= 20, end++;
    /* A multiple of 64 keeps aligned_alloc valid and every dtype whole. */
    if (*end || n == 0 || n % 64 || n > (1ull << 30)) {
      fprintf(stderr, "usage: %s [BYTES_PER_SOURCE: a multiple of 64 up to 1G, K/M suffix allowed]\n", argv[0]);
      return 2;
    }
    bytes_per_source = (size_t)n;
  }
  for (int b = 0; b <= MAX_SOURCES; b++) {
    buffers[b] = aligned_alloc(64, bytes_per_source);
    if (buffers[b] == NULL) return 1;
    /* Small positive patterns: finite in every dtype, no denormal slow paths. */
    uint16_t *words = buffers[b];
    for (size_t i = 0; i < bytes_per_source / 2; i++)
      words[i] = (uint16_t)(0x3C00 + ((i * 7 + (size_t)b) & 0x3FF));
  }
  const char *isa = getenv("TCCOMM_REDUCE_ISA");
  printf("tcc__reduce_n SUM, %zu KiB per source, kernels=%s\n", bytes_per_source >> 10,
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
