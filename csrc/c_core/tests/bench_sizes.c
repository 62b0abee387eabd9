/*
 * bench_sizes.c - time per collective of a program driving the core
 * directly, by size: the floor under the torch layers that
 * bench/bench_collectives.py measures, op by op.
 *
 * Usage: bench_sizes [ranks] [shm|tcp] [op] [min bytes] [max bytes] [in-place] [huge-pages]
 *                    [bfloat16|float16]
 *   op: allreduce | allgather | alltoall | broadcast | reduce_scatter
 *   (default: 2 shm allreduce 64K 8M; sizes double from min to max)
 *   in-place: all_reduce into its input, as dist.all_reduce does (the
 *   other ops always run as bench/bench_collectives.py runs them)
 *   huge-pages: buffers 2 MiB-aligned and madvise(MADV_HUGEPAGE)d, as torch
 *   makes large tensors under THP_MEM_ALLOC_ENABLE=1; rank 0 prints how
 *   much of its memory the kernel backed with huge pages (AnonHugePages)
 * The size is what bench_collectives.py calls the size: the whole tensor of
 * all_reduce and broadcast, the output of all_gather and the input of
 * reduce_scatter and all_to_all (each rank's share is size / ranks).
 * bfloat16 | float16: elements of that type instead of float32 (what
 *   tensor-parallel inference sends; reductions then run the half kernels).
 * Buffers made once per size; warm-up, then the median of 5 batches
 * of about 0.3 s each, rank 0's clock after a barrier. Rank 0 prints
 *   "<op> <bytes> B, <n> ranks, <transport>: <us> us"
 * with ", <dtype>" after the transport for a half type.
 * The first and last element of every rank's result are checked against the
 * sum (or the value) the inputs give; in place, only after the first call
 * (the sums then grow from call to call).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench_median.h"
#include "check.h"
#include "group.h"

#define BATCHES 5
#define BATCH_NS 300000000LL

/* A failed call leaves the ranks out of step: the rank stops there. */
#define REQUIRE(cond, ...)                                                     \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "bench_sizes: " __VA_ARGS__);                            \
      fputc('\n', stderr);                                                     \
      _exit(1);                                                                \
    }                                                                          \
  } while (0)

static const char *op_name = "allreduce";
static bool in_place, huge_pages;
static tcc_dtype_t dtype = TCC_FLOAT32;
static const char *dtype_name = "float32";

#define HUGE_PAGE ((size_t)2 << 20)

/* Torch's CPU allocator aligns every tensor to this. */
#define TENSOR_ALIGN ((size_t)64)

/* A zeroed buffer of `bytes`, aligned as torch aligns a tensor, or on huge
 * pages where asked and granted. Not calloc's: its 16-byte alignment puts
 * an input and an output of one size at addresses 16 bytes apart modulo
 * 4096, and on AMD Zen CPUs a `rep movsb` copy between such addresses (the
 * one glibc's memcpy and the kernel's process_vm_readv make) runs 10-17x
 * slower: a 64 KiB all_gather took 18-46 us instead of 5. Tensors, 64-byte
 * aligned, never meet that distance. */
static void *buffer(size_t bytes) {
  const size_t align = huge_pages ? HUGE_PAGE : TENSOR_ALIGN;
  const size_t rounded = (bytes + align - 1) / align * align;
  void *p = NULL;
  if (posix_memalign(&p, align, rounded) != 0) return NULL;
  if (huge_pages) (void)madvise(p, rounded, MADV_HUGEPAGE); /* a hint: refused, the pages stay small */
  memset(p, 0, rounded);
  return p;
}

/* This process's anonymous memory on huge pages, in kB (-1: unknown). */
static long anon_huge_kb(void) {
  FILE *f = fopen("/proc/self/smaps_rollup", "r");
  if (!f) return -1;
  char line[256];
  long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb;
}
static size_t min_bytes = 64 << 10, max_bytes = 8 << 20;

/* One size's buffers: each rank's input and output, and the per-peer views. */
typedef struct {
  uint8_t *in, *out;
  size_t total, per; /* elements: whole tensor, one rank's share */
  float *values;     /* staging of the input's values, narrowed into `in` for a half type */
  tcc_buf_t ins[8], outs[8];
} bufs_t;

/* Small integers: every sum of up to 8 ranks' values (at most 112) is
 * exact in bfloat16's 8 bits of mantissa, so half results are checked
 * exactly too. */
static float value_of(int rank, size_t i) { return (float)(rank + 1) + (float)(i % 7); }

static size_t elem_size(void) { return tcc_dtype_size(dtype); }

static float element(const uint8_t *buf, size_t i) {
  float v;
  if (dtype == TCC_FLOAT32) memcpy(&v, buf + i * sizeof v, sizeof v);
  else tcc__half_widen(&v, buf + i * elem_size(), 1, dtype);
  return v;
}

static void fill(bufs_t *b, int me, int n) {
  const size_t count = strcmp(op_name, "allgather") == 0 ? b->per : b->total;
  for (size_t i = 0; i < count; i++) b->values[i] = value_of(me, i);
  if (dtype == TCC_FLOAT32) memcpy(b->in, b->values, count * sizeof(float));
  else tcc__half_narrow(b->in, b->values, count, dtype);
  const size_t share = b->per * elem_size();
  for (int r = 0; r < n; r++) {
    b->ins[r] = (tcc_buf_t){b->in + (size_t)r * share, b->per, dtype, -1, NULL};
    b->outs[r] = (tcc_buf_t){b->out + (size_t)r * share, b->per, dtype, -1, NULL};
  }
}

static int run_once(tcc_comm_t *comm, bufs_t *b) {
  const tcc_buf_t whole_in = {b->in, b->total, dtype, -1, NULL};
  const tcc_buf_t whole_out = {b->out, b->total, dtype, -1, NULL};
  tcc_op_t *op = NULL;
  tcc_result_t r;
  if (strcmp(op_name, "allreduce") == 0)
    r = tcc_allreduce(comm, whole_in, in_place ? whole_in : whole_out, TCC_SUM, NULL, &op);
  else if (strcmp(op_name, "allgather") == 0)
    r = tcc_allgather(comm, b->ins[0], b->outs, NULL, &op);
  else if (strcmp(op_name, "alltoall") == 0)
    r = tcc_alltoall(comm, b->ins, b->outs, NULL, &op);
  else if (strcmp(op_name, "broadcast") == 0)
    r = tcc_broadcast(comm, whole_in, 0, NULL, &op);
  else
    r = tcc_reduce_scatter(comm, b->ins, b->outs[0], TCC_SUM, NULL, &op);
  if (r != TCC_OK) return 0;
  r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  return r == TCC_OK;
}

/* Element i of this rank's result, as the inputs define it. */
static float expected(int me, int n, size_t i, size_t per) {
  float sum = 0;
  if (strcmp(op_name, "allreduce") == 0) {
    for (int r = 0; r < n; r++) sum += value_of(r, i);
    return sum;
  }
  if (strcmp(op_name, "allgather") == 0) return value_of((int)(i / per), i % per);
  if (strcmp(op_name, "alltoall") == 0) return value_of((int)(i / per), (size_t)me * per + i % per);
  if (strcmp(op_name, "broadcast") == 0) return value_of(0, i);
  for (int r = 0; r < n; r++) sum += value_of(r, (size_t)me * per + i);
  return sum;
}

static int check_result(const bufs_t *b, int me, int n) {
  const int rs = strcmp(op_name, "reduce_scatter") == 0, bc = strcmp(op_name, "broadcast") == 0;
  const uint8_t *got = bc || in_place ? b->in : b->out;
  const size_t count = rs ? b->per : b->total;
  return element(got, 0) == expected(me, n, 0, b->per) &&
         element(got, count - 1) == expected(me, n, count - 1, b->per);
}

static void bench_size(tcc_comm_t *comm, size_t bytes) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  bufs_t b = {0};
  b.total = bytes / elem_size() / (size_t)n * (size_t)n;
  b.per = b.total / (size_t)n;
  b.in = buffer(b.total * elem_size());
  b.out = buffer(b.total * elem_size());
  b.values = malloc(b.total * sizeof(float));
  REQUIRE(b.in && b.out && b.values, "out of memory for %zu bytes", bytes);
  fill(&b, me, n);
  REQUIRE(run_once(comm, &b), "%s failed", op_name);
  REQUIRE(check_result(&b, me, n), "%s of %zu bytes: wrong result on rank %d", op_name, bytes, me);
  /* Warm-up; rank 0's time for it sets every rank's batch length. */
  int64_t start = tcc__now_ns();
  for (int i = 0; i < 5; i++) REQUIRE(run_once(comm, &b), "%s warm-up call %d failed", op_name, i);
  double iters_wanted[1] = {(double)BATCH_NS * 5 / (double)(tcc__now_ns() - start + 1)};
  const tcc_buf_t ib = {iters_wanted, 1, TCC_FLOAT64, -1, NULL};
  tcc_op_t *op;
  REQUIRE(tcc_broadcast(comm, ib, 0, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "broadcast failed");
  tcc_op_release(op);
  const long iters = (long)iters_wanted[0] + 1;
  double per_call[BATCHES];
  for (int k = 0; k < BATCHES; k++) {
    fill(&b, me, n); /* broadcast overwrites non-root inputs; keep checks exact */
    float token[2] = {0, 0};
    tcc_buf_t tb = {token, 2, TCC_FLOAT32, -1, NULL};
    REQUIRE(tcc_allreduce(comm, tb, tb, TCC_SUM, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK,
            "barrier failed");
    tcc_op_release(op);
    start = tcc__now_ns();
    for (long i = 0; i < iters; i++) REQUIRE(run_once(comm, &b), "%s call %ld failed", op_name, i);
    per_call[k] = (double)(tcc__now_ns() - start) / (double)iters / 1000.0;
    REQUIRE(in_place || check_result(&b, me, n), "%s of %zu bytes: wrong result on rank %d", op_name, bytes, me);
  }
  char dt[32] = "";
  if (dtype != TCC_FLOAT32) snprintf(dt, sizeof dt, ", %s", dtype_name);
  if (me == 0 && huge_pages)
    printf("%s%s %zu B, %d ranks, %s%s, huge pages (%ld kB of rank 0's): %.1f us\n", op_name,
           in_place ? " in place" : "", bytes, n, tcc_comm_transport_name(comm), dt, anon_huge_kb(),
           median(per_call, BATCHES));
  else if (me == 0)
    printf("%s%s %zu B, %d ranks, %s%s: %.1f us\n", op_name, in_place ? " in place" : "", bytes, n,
           tcc_comm_transport_name(comm), dt, median(per_call, BATCHES));
  fflush(stdout);
  free(b.in);
  free(b.out);
  free(b.values);
}

static void bench(tcc_comm_t *comm) {
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) bench_size(comm, bytes);
}

static size_t parse_size(const char *s) {
  char *end;
  size_t v = strtoull(s, &end, 10);
  if (*end == 'K' || *end == 'k') v <<= 10;
  if (*end == 'M' || *end == 'm') v <<= 20;
  return v;
}

int main(int argc, char **argv) {
  static const char *ops[] = {"allreduce", "allgather", "alltoall", "broadcast", "reduce_scatter"};
  const int n = argc > 1 ? atoi(argv[1]) : 2;
  const char *transport = argc > 2 ? argv[2] : "shm";
  if (argc > 3) op_name = argv[3];
  if (argc > 4) min_bytes = parse_size(argv[4]);
  if (argc > 5) max_bytes = parse_size(argv[5]);
  bool flags_known = true;
  for (int i = 6; i < argc; i++) {
    if (strcmp(argv[i], "in-place") == 0) in_place = true;
    else if (strcmp(argv[i], "huge-pages") == 0) huge_pages = true;
    else if (strcmp(argv[i], "bfloat16") == 0) dtype = TCC_BFLOAT16, dtype_name = argv[i];
    else if (strcmp(argv[i], "float16") == 0) dtype = TCC_FLOAT16, dtype_name = argv[i];
    else flags_known = false;
  }
  int known = 0;
  for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) known |= strcmp(op_name, ops[i]) == 0;
  if (n < 1 || n > 8 || (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) || !known ||
      min_bytes < (size_t)n * elem_size() || max_bytes < min_bytes || !flags_known ||
      (in_place && strcmp(op_name, "allreduce") != 0)) {
    fprintf(stderr, "usage: bench_sizes [ranks 1..8] [shm|tcp] "
                    "[allreduce|allgather|alltoall|broadcast|reduce_scatter] [min bytes] [max bytes] [in-place] [huge-pages] "
                    "[bfloat16|float16]\n");
    return 2;
  }
  return run_group(n, transport, 600000, "bench-sizes", bench);
}
