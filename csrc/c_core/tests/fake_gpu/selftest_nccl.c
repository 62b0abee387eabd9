/*
 * selftest_nccl.c - checks the fake NCCL (fake_nccl.c) on its own, through
 * the fake CUDA runtime: groups of 2 and 3 forked ranks (forked before any
 * thread exists) run every collective against a reference computed here,
 * point-to-point in groups, split, nonblocking communicators, fault
 * injection, abort from another thread, a peer killed while the survivor
 * waits, graph replays, and finally check that /dev/shm is clean.
 *
 *   gcc -std=c11 -D_GNU_SOURCE -pthread -isystem <cuda>/include -isystem <nccl>/include -Itests/fake_gpu \
 *       tests/fake_gpu/selftest_nccl.c -L<dir> -l:libnccl.so.2 -lcudart -lm -Wl,-rpath,<dir>
 *
 * Device memory of the fake runtime is host memory: the checks read it
 * directly once the stream is synchronized.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "fake_gpu.h"

static int failures;
static int my_rank = -1;

#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      failures++;                                                               \
      fprintf(stderr, "FAIL rank %d, line %d: ", my_rank, __LINE__);            \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
    }                                                                           \
  } while (0)

#define NCHECK(expr)                                                            \
  do {                                                                          \
    ncclResult_t r_ = (expr);                                                   \
    CHECK(r_ == ncclSuccess, "%s: %s (%s)", #expr, ncclGetErrorString(r_), ncclGetLastError(NULL)); \
  } while (0)

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- shared between the ranks of a run (mapped before the fork) ---------- */

#define MAX_IDS 16
static struct shared {
  ncclUniqueId ids[MAX_IDS];
  atomic_int flag;
} *sh;

/* ---- reference arithmetic, independent of the fake's bit tricks --------- */

/* Rounds v to a binary format with `p` significand bits and minimum normal
 * exponent emin, nearest even (nearbyint in the default rounding mode). */
static double round_to(double v, int p, int emin, double maxval) {
  if (v == 0 || isnan(v) || isinf(v)) return v;
  int e;
  frexp(fabs(v), &e); /* |v| in [2^(e-1), 2^e) */
  int exp = e - 1 < emin ? emin : e - 1;
  const double q = ldexp(1.0, exp - p + 1);
  const double r = nearbyint(v / q) * q;
  return fabs(r) > maxval ? copysign(INFINITY, v) : r;
}
static double r16(double v) { return round_to(v, 11, -14, 65504.0); }
static double rbf(double v) { return round_to(v, 8, -126, 3.3895313892515355e38); }

static uint16_t enc16(double v) { /* v exactly representable as a half */
  uint16_t s = v < 0 ? 0x8000 : 0;
  v = fabs(v);
  if (v == 0) return s;
  if (isinf(v)) return s | 0x7c00;
  int e;
  double m = frexp(v, &e); /* v = m 2^e, m in [0.5,1) */
  if (e - 1 < -14) return s | (uint16_t)(v / ldexp(1.0, -24));
  return s | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)((m * 2 - 1) * 1024);
}
static double dec16(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}
static uint16_t encbf(double v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16); /* v exactly representable: truncation is exact */
}
static double decbf(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Element i of rank r's input for type t: values with many significand bits
 * (so rounding shows), exactly representable in t. */
static double input(ncclDataType_t t, int r, size_t i) {
  const uint32_t h = (uint32_t)(i * 2654435761u + (uint32_t)r * 40503u + 17u);
  switch (t) {
    case ncclFloat16: return (1.0 + (h % 1024) / 1024.0) * ldexp(1.0, (int)((i + (size_t)r) % 5) - 2) * ((h >> 12) & 1 ? -1 : 1);
    case ncclBfloat16: return (1.0 + (h % 128) / 128.0) * ldexp(1.0, (int)((i + (size_t)r) % 7) - 3) * ((h >> 12) & 1 ? -1 : 1);
    case ncclFloat32: return (double)(float)((1.0 + (h % 8388608) / 8388608.0) * ((h >> 23) & 1 ? -1 : 1));
    case ncclFloat64: return (1.0 + (h % 1000003) / 1000003.0) * ((h >> 20) & 1 ? -1 : 1);
    case ncclInt8: return (double)(int8_t)(h % 256);
    case ncclUint8: return (double)(h % 256);
    case ncclInt32: return (double)(int32_t)(h * 2246822519u);
    case ncclUint32: return (double)(h * 2246822519u);
    case ncclInt64: return (double)((int64_t)(h % 1000000) - 500000);
    case ncclUint64: return (double)(h % 1000000);
    default: return 0;
  }
}

static size_t tsize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

static void put(void *buf, size_t i, ncclDataType_t t, double v) {
  switch (t) {
    case ncclInt8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case ncclUint8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case ncclInt32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case ncclUint32: ((uint32_t *)buf)[i] = (uint32_t)v; break;
    case ncclInt64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case ncclUint64: ((uint64_t *)buf)[i] = (uint64_t)v; break;
    case ncclFloat16: ((uint16_t *)buf)[i] = enc16(v); break;
    case ncclBfloat16: ((uint16_t *)buf)[i] = encbf(v); break;
    case ncclFloat32: ((float *)buf)[i] = (float)v; break;
    default: ((double *)buf)[i] = v; break;
  }
}

static double get(const void *buf, size_t i, ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return ((const int8_t *)buf)[i];
    case ncclUint8: return ((const uint8_t *)buf)[i];
    case ncclInt32: return ((const int32_t *)buf)[i];
    case ncclUint32: return ((const uint32_t *)buf)[i];
    case ncclInt64: return (double)((const int64_t *)buf)[i];
    case ncclUint64: return (double)((const uint64_t *)buf)[i];
    case ncclFloat16: return dec16(((const uint16_t *)buf)[i]);
    case ncclBfloat16: return decbf(((const uint16_t *)buf)[i]);
    case ncclFloat32: return ((const float *)buf)[i];
    default: return ((const double *)buf)[i];
  }
}

/* One operation's result rounded/wrapped to t (the exact value is computed
 * in long double / 128-bit-free integer arithmetic first). */
static double to_type(ncclDataType_t t, double v) {
  switch (t) {
    case ncclFloat16: return r16(v);
    case ncclBfloat16: return rbf(v);
    case ncclFloat32: return (float)v;
    default: return v;
  }
}

static int is_int(ncclDataType_t t) { return t <= ncclUint64; }

/* Integer arithmetic wraps in the type. */
static double wrap(ncclDataType_t t, __int128 v) {
  switch (t) {
    case ncclInt8: return (int8_t)(uint8_t)v;
    case ncclUint8: return (uint8_t)v;
    case ncclInt32: return (int32_t)(uint32_t)v;
    case ncclUint32: return (uint32_t)v;
    case ncclInt64: return (double)(int64_t)(uint64_t)v;
    default: return (double)(uint64_t)v;
  }
}

static double scalar_of(ncclDataType_t t, int r) { return is_int(t) ? r + 2 : to_type(t, 0.5 * (r + 1)); }

/* The reduction of element i over ranks 0..n-1, in rank order, one rounding per operation. */
static double reference(ncclDataType_t t, int op, int n, size_t i) {
  double acc = 0;
  const double avg_scale = to_type(t, 1.0 / n);
  for (int r = 0; r < n; r++) {
    double x = input(t, r, i);
    if (op == -1) x = is_int(t) ? wrap(t, (__int128)x * (__int128)scalar_of(t, r)) : to_type(t, x * scalar_of(t, r));
    if (op == ncclAvg && !is_int(t)) x = to_type(t, x * avg_scale);
    if (r == 0) {
      acc = x;
      continue;
    }
    if (is_int(t)) {
      const __int128 a = (__int128)acc, b = (__int128)x;
      acc = op == ncclProd ? wrap(t, a * b) : op == ncclMax ? (acc > x ? acc : x) : op == ncclMin ? (acc < x ? acc : x)
                                                                                                 : wrap(t, a + b);
    } else {
      acc = op == ncclProd ? to_type(t, acc * x) : op == ncclMax ? (acc > x ? acc : x) : op == ncclMin ? (acc < x ? acc : x)
                                                                                                    : to_type(t, acc + x);
    }
  }
  if (op == ncclAvg && is_int(t)) {
    if (t == ncclUint64) acc = (double)((uint64_t)acc / (uint64_t)n);
    else if (t == ncclUint8 || t == ncclUint32) acc = (double)((int64_t)acc / n);
    else acc = (double)((int64_t)acc / n);
  }
  return acc;
}

/* ---- helpers ------------------------------------------------------------------ */

static void *dalloc(size_t bytes) {
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  CHECK(e == cudaSuccess, "cudaMalloc(%zu)", bytes);
  return p;
}

static cudaStream_t new_stream(void) {
  cudaStream_t s = NULL;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
  return s;
}

static void sync_stream(cudaStream_t s) { CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync"); }

static ncclResult_t settle(ncclComm_t c) {
  ncclResult_t st = ncclInProgress;
  const int64_t t0 = now_ms();
  while (st == ncclInProgress && now_ms() - t0 < 20000) {
    if (ncclCommGetAsyncError(c, &st) != ncclSuccess) return ncclInternalError;
    if (st == ncclInProgress) usleep(200);
  }
  return st;
}

static ncclComm_t init_blocking(int id, int n, int rank) {
  ncclComm_t c = NULL;
  NCHECK(ncclCommInitRank(&c, n, sh->ids[id], rank));
  return c;
}

static ncclComm_t init_nonblocking(int id, int n, int rank) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t c = NULL;
  ncclResult_t r = ncclCommInitRankConfig(&c, n, sh->ids[id], rank, &cfg);
  CHECK(r == ncclInProgress || r == ncclSuccess, "nonblocking init: %s", ncclGetErrorString(r));
  CHECK(settle(c) == ncclSuccess, "nonblocking init settles: %s", ncclGetLastError(c));
  return c;
}

/* ---- the cases ------------------------------------------------------------ */

static const ncclDataType_t all_types[] = {ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64,
                                           ncclUint64, ncclFloat16, ncclFloat32, ncclFloat64, ncclBfloat16};

static void check_buf(const char *what, ncclDataType_t t, int op, const void *buf, size_t count, size_t first, int n) {
  for (size_t i = 0; i < count; i++) {
    const double want = reference(t, op, n, first + i), got = get(buf, i, t);
    if (got != want && !(isnan(got) && isnan(want))) {
      CHECK(0, "%s type %d op %d [%zu]: got %.17g want %.17g", what, (int)t, op, first + i, got, want);
      return;
    }
  }
}

/* Holds a stream until *arg is set (a host function on the stream). */
static void gate_wait(void *arg) {
  atomic_int *g = arg;
  while (!atomic_load(g)) usleep(100);
}

static void case_allreduce(ncclComm_t c, cudaStream_t s, int n, int rank) {
  const size_t count = 3001; /* several slots of FAKE_NCCL_SLOT_BYTES=8192 */
  for (size_t k = 0; k < sizeof all_types / sizeof *all_types; k++) {
    const ncclDataType_t t = all_types[k];
    uint8_t *in = dalloc(count * tsize(t)), *out = dalloc(count * tsize(t));
    for (int op = -1; op <= ncclAvg; op++) {
      for (size_t i = 0; i < count; i++) put(in, i, t, input(t, rank, i));
      ncclRedOp_t rop = (ncclRedOp_t)op;
      if (op == -1) { /* PreMulSum with this rank's own scalar */
        uint8_t sc[8];
        put(sc, 0, t, scalar_of(t, rank));
        NCHECK(ncclRedOpCreatePreMulSum(&rop, sc, t, ncclScalarHostImmediate, c));
        memset(sc, 0, sizeof sc); /* copied at creation */
      }
      NCHECK(ncclAllReduce(in, out, count, t, rop, c, s));
      if (op == -1) NCHECK(ncclRedOpDestroy(rop, c)); /* legal once the call returned */
      sync_stream(s);
      check_buf("allreduce", t, op, out, count, 0, n);
      /* in place */
      NCHECK(ncclAllReduce(in, in, count, t, op == -1 ? ncclSum : rop, c, s));
      sync_stream(s);
      if (op != -1) check_buf("in-place allreduce", t, op, in, count, 0, n);
    }
    cudaFree(in);
    cudaFree(out);
  }
  /* PreMulSum with a device scalar is read when the work runs: the stream is
   * held by a host function while the scalar changes after the call. */
  float *in = dalloc(64 * 4), *out = dalloc(64 * 4), *scalar = dalloc(4);
  for (int i = 0; i < 64; i++) in[i] = (float)(i + rank);
  *scalar = 100.0f;
  atomic_int gate = 0;
  CHECK(cudaLaunchHostFunc(s, gate_wait, &gate) == cudaSuccess, "host fn");
  ncclRedOp_t rop;
  NCHECK(ncclRedOpCreatePreMulSum(&rop, scalar, ncclFloat32, ncclScalarDevice, c));
  NCHECK(ncclAllReduce(in, out, 64, ncclFloat32, rop, c, s));
  NCHECK(ncclRedOpDestroy(rop, c));
  *scalar = 0.5f;
  atomic_store(&gate, 1);
  sync_stream(s);
  for (int i = 0; i < 64; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += (float)(i + r) * 0.5f;
    CHECK(out[i] == want, "device-scalar premul [%d]: %g vs %g", i, out[i], want);
    if (out[i] != want) break;
  }
  cudaFree(in);
  cudaFree(out);
  cudaFree(scalar);
  /* count 0 does nothing; invalid arguments are refused */
  NCHECK(ncclAllReduce(NULL, NULL, 0, ncclFloat32, ncclSum, c, s));
  CHECK(ncclAllReduce(NULL, NULL, 4, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument, "NULL buffers");
  CHECK(ncclAllReduce(&rop, &rop, 1, ncclFloat8e4m3, ncclSum, c, s) == ncclInvalidArgument, "fp8 reduction");
  CHECK(ncclAllReduce(&rop, &rop, 1, ncclFloat32, (ncclRedOp_t)(ncclNumOps + 7), c, s) == ncclInvalidArgument,
        "unknown op");
  CHECK(strstr(ncclGetLastError(c), "not created") != NULL, "last error: %s", ncclGetLastError(c));
}

static void case_collectives(ncclComm_t c, cudaStream_t s, int n, int rank) {
  const size_t count = 2500;
  const ncclDataType_t t = ncclFloat64;
  double *in = dalloc(count * n * 8), *out = dalloc(count * n * 8);
  /* broadcast from every root */
  for (int root = 0; root < n; root++) {
    for (size_t i = 0; i < count; i++) in[i] = input(t, rank, i);
    NCHECK(ncclBroadcast(in, out, count, t, root, c, s));
    sync_stream(s);
    for (size_t i = 0; i < count; i++)
      if (out[i] != input(t, root, i)) {
        CHECK(0, "broadcast root %d [%zu]", root, i);
        break;
      }
  }
  /* reduce: only the root's buffer changes */
  for (size_t i = 0; i < count; i++) out[i] = -1;
  NCHECK(ncclReduce(in, rank == n - 1 ? out : NULL, count, t, ncclSum, n - 1, c, s));
  sync_stream(s);
  if (rank == n - 1) check_buf("reduce", t, ncclSum, out, count, 0, n);
  /* allgather */
  NCHECK(ncclAllGather(in, out, count, t, c, s));
  sync_stream(s);
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      if (out[(size_t)r * count + i] != input(t, r, i)) {
        CHECK(0, "allgather block %d [%zu]", r, i);
        r = n;
        break;
      }
  /* reduce_scatter: block b of rank r's input is input(r, b*count + i) */
  for (size_t i = 0; i < count * (size_t)n; i++) in[i] = input(t, rank, i);
  NCHECK(ncclReduceScatter(in, out, count, t, ncclMax, c, s));
  sync_stream(s);
  check_buf("reduce_scatter", t, ncclMax, out, count, (size_t)rank * count, n);
  /* alltoall, gather, scatter (grouped p2p inside) */
  for (size_t i = 0; i < count * (size_t)n; i++) in[i] = rank * 1e6 + (double)i;
  NCHECK(ncclAlltoAll(in, out, count, t, c, s));
  sync_stream(s);
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      if (out[(size_t)r * count + i] != r * 1e6 + (double)((size_t)rank * count + i)) {
        CHECK(0, "alltoall from %d [%zu]: %g", r, i, out[(size_t)r * count + i]);
        r = n;
        break;
      }
  NCHECK(ncclGather(in, out, count, t, 0, c, s));
  sync_stream(s);
  if (rank == 0)
    for (int r = 0; r < n; r++)
      CHECK(out[(size_t)r * count + 7] == r * 1e6 + 7, "gather from %d", r);
  NCHECK(ncclScatter(in, out, count, t, 1, c, s));
  sync_stream(s);
  CHECK(out[5] == 1e6 + (double)((size_t)rank * count + 5), "scatter: %g", out[5]);
  cudaFree(in);
  cudaFree(out);
}

static void case_p2p(ncclComm_t c, cudaStream_t s, int n, int rank) {
  const size_t bytes = 10000 + 3; /* several rings of FAKE_NCCL_MBOX_BYTES=4096 */
  uint8_t *a = dalloc(bytes), *b = dalloc(bytes), *x = dalloc(bytes), *y = dalloc(bytes);
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  for (size_t i = 0; i < bytes; i++) {
    a[i] = (uint8_t)(rank * 31 + i);
    x[i] = (uint8_t)(rank * 17 + i * 3);
  }
  /* both directions in one group: each send needs the peer's receive */
  NCHECK(ncclGroupStart());
  NCHECK(ncclSend(a, bytes, ncclUint8, next, c, s));
  NCHECK(ncclRecv(b, bytes, ncclUint8, prev, c, s));
  NCHECK(ncclSend(x, bytes, ncclUint8, prev, c, s));
  NCHECK(ncclRecv(y, bytes, ncclUint8, next, c, s));
  NCHECK(ncclGroupEnd());
  sync_stream(s);
  for (size_t i = 0; i < bytes; i++) {
    if (b[i] != (uint8_t)(prev * 31 + i) || y[i] != (uint8_t)(next * 17 + i * 3)) {
      CHECK(0, "p2p ring [%zu]", i);
      break;
    }
  }
  /* a lone send completes only once the receive is posted */
  if (rank == 0) {
    NCHECK(ncclSend(a, 100, ncclUint8, 1, c, s));
    sync_stream(s);
    CHECK(atomic_load(&sh->flag) == 1, "the send completed before its receive was posted");
  } else if (rank == 1) {
    usleep(100000);
    atomic_store(&sh->flag, 1);
    NCHECK(ncclRecv(b, 100, ncclUint8, 0, c, s));
    sync_stream(s);
  }
  /* streams of one communicator must agree within a group */
  cudaStream_t s2 = new_stream();
  NCHECK(ncclGroupStart());
  NCHECK(ncclSend(a, 1, ncclUint8, next, c, s));
  CHECK(ncclRecv(b, 1, ncclUint8, prev, c, s2) == ncclInvalidUsage, "two streams in one group");
  CHECK(ncclGroupEnd() == ncclInvalidUsage, "the group of a failed call fails");
  CHECK(ncclGroupEnd() == ncclInvalidUsage, "ncclGroupEnd without start");
  cudaStreamDestroy(s2);
  cudaFree(a);
  cudaFree(b);
  cudaFree(x);
  cudaFree(y);
}

/* First p2p on a nonblocking communicator: the handshake is in the background. */
static void case_nonblocking_p2p(ncclComm_t c, cudaStream_t s, int n, int rank) {
  int v = rank, got = -1;
  NCHECK(ncclCommGetAsyncError(c, &(ncclResult_t){0}));
  ncclResult_t r;
  NCHECK(ncclGroupStart());
  ncclSend(&v, 1, ncclInt32, (rank + 1) % n, c, s);
  ncclRecv(&got, 1, ncclInt32, (rank + n - 1) % n, c, s);
  r = ncclGroupEnd();
  CHECK(r == ncclInProgress, "first p2p on a nonblocking comm: %s", ncclGetErrorString(r));
  CHECK(settle(c) == ncclSuccess, "settle: %s", ncclGetLastError(c));
  sync_stream(s);
  CHECK(got == (rank + n - 1) % n, "nonblocking p2p got %d", got);
  /* a second time the connection exists: no background work */
  NCHECK(ncclGroupStart());
  ncclSend(&v, 1, ncclInt32, (rank + 1) % n, c, s);
  ncclRecv(&got, 1, ncclInt32, (rank + n - 1) % n, c, s);
  NCHECK(ncclGroupEnd());
  sync_stream(s);
}

static void case_split(ncclComm_t c, int n, int rank) {
  ncclComm_t sub = NULL;
  const int color = rank == 2 ? NCCL_SPLIT_NOCOLOR : 7;
  NCHECK(ncclCommSplit(c, color, -rank, &sub, NULL));
  if (color == NCCL_SPLIT_NOCOLOR) {
    CHECK(sub == NULL, "NOCOLOR gives no communicator");
  } else {
    int sn = 0, sr = -1;
    NCHECK(ncclCommCount(sub, &sn));
    NCHECK(ncclCommUserRank(sub, &sr));
    const int members = n < 2 ? n : 2;
    CHECK(sn == members && sr == members - 1 - rank, "split: rank %d of %d", sr, sn);
    cudaStream_t s = new_stream();
    int v = 1 << rank, sum = 0;
    NCHECK(ncclAllReduce(&v, &sum, 1, ncclInt32, ncclSum, sub, s));
    sync_stream(s);
    CHECK(sum == (members == 2 ? 3 : 1), "allreduce on the split: %d", sum);
    NCHECK(ncclCommDestroy(sub));
    cudaStreamDestroy(s);
  }
  /* a second split, nonblocking, all ranks in one color */
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = ncclCommSplit(c, 0, rank, &sub, &cfg);
  CHECK(r == ncclInProgress, "nonblocking split: %s", ncclGetErrorString(r));
  CHECK(settle(sub) == ncclSuccess, "split settles: %s", ncclGetLastError(sub));
  int sn = 0;
  NCHECK(ncclCommCount(sub, &sn));
  CHECK(sn == n, "second split has %d ranks", sn);
  NCHECK(ncclCommDestroy(sub));
}

struct thread_ar {
  ncclComm_t comm;
  cudaStream_t stream;
  int in, out;
};

static void *thread_allreduce(void *arg) {
  struct thread_ar *a = arg;
  NCHECK(ncclAllReduce(&a->in, &a->out, 1, ncclInt32, ncclSum, a->comm, a->stream));
  sync_stream(a->stream);
  return NULL;
}

/* Groups are per thread: a call inside another's open group waits for its
 * end, a call of another thread does not. */
static void case_thread_groups(ncclComm_t a, ncclComm_t b, int n, int rank) {
  cudaStream_t sa = new_stream(), sb = new_stream();
  int in = rank + 1, out = -1;
  struct thread_ar tb = {b, sb, rank + 10, -1};
  if (rank == 0) {
    NCHECK(ncclGroupStart());
    NCHECK(ncclAllReduce(&in, &out, 1, ncclInt32, ncclSum, a, sa)); /* "launched" inside the open group */
    pthread_t t;
    pthread_create(&t, NULL, thread_allreduce, &tb);
    pthread_join(t, NULL); /* another thread's call ran to completion meanwhile */
    usleep(50000);
    CHECK(fake_cuda_stream_pending(sa) == 0 && out == -1, "a call inside an open group was launched before its end");
    NCHECK(ncclGroupEnd());
    sync_stream(sa);
  } else {
    thread_allreduce(&tb);
    NCHECK(ncclAllReduce(&in, &out, 1, ncclInt32, ncclSum, a, sa));
    sync_stream(sa);
  }
  CHECK(out == n * (n + 1) / 2, "grouped allreduce: %d", out);
  CHECK(tb.out == 10 * n + n * (n - 1) / 2, "other thread's allreduce: %d", tb.out);
  cudaStreamDestroy(sa);
  cudaStreamDestroy(sb);
}

/* A captured allreduce replayed: every launch is a fresh collective. */
static void case_graph(ncclComm_t c, int n, int rank) {
  cudaStream_t s = new_stream();
  int *in = dalloc(16 * 4), *out = dalloc(16 * 4);
  cudaGraph_t g = NULL;
  cudaGraphExec_t x = NULL;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "begin capture");
  NCHECK(ncclAllReduce(in, out, 16, ncclInt32, ncclSum, c, s));
  CHECK(cudaStreamEndCapture(s, &g) == cudaSuccess, "end capture");
  CHECK(cudaGraphInstantiate(&x, g, 0) == cudaSuccess, "instantiate");
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < 16; i++) in[i] = round * 100 + rank + i;
    CHECK(cudaGraphLaunch(x, s) == cudaSuccess, "launch");
    sync_stream(s);
    CHECK(out[3] == n * (round * 100 + 3) + n * (n - 1) / 2, "replay %d: %d", round, out[3]);
  }
  cudaGraphExecDestroy(x);
  cudaGraphDestroy(g);
  cudaFree(in);
  cudaFree(out);
  cudaStreamDestroy(s);
}

struct aborter {
  ncclComm_t comm;
  int delay_ms;
};

static void *abort_later(void *arg) {
  struct aborter *a = arg;
  usleep((useconds_t)a->delay_ms * 1000);
  NCHECK(ncclCommAbort(a->comm));
  return NULL;
}

/* A hung kernel, a blocked host call and a blocked handshake are released by an abort from another thread. */
static void case_abort(int id, int n, int rank) {
  const int alive = fake_nccl_comms_alive();
  ncclComm_t c = init_blocking(id, n, rank);
  cudaStream_t s = new_stream();
  int v = 1, out = 0;
  fake_nccl_inject("ncclAllReduce", 1, FAKE_NCCL_HANG_KERNEL);
  NCHECK(ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, c, s));
  struct aborter ab = {c, 150};
  pthread_t t;
  pthread_create(&t, NULL, abort_later, &ab);
  int64_t t0 = now_ms();
  sync_stream(s);
  const int64_t took = now_ms() - t0;
  pthread_join(t, NULL);
  CHECK(took >= 100 && took < 5000, "hung kernel released after %lld ms", (long long)took);
  CHECK(fake_nccl_comms_alive() == alive, "comms alive %d, want %d", fake_nccl_comms_alive(), alive);

  c = init_blocking(id + 1, n, rank);
  fake_nccl_inject("ncclBroadcast", 1, FAKE_NCCL_BLOCK);
  ab.comm = c;
  pthread_create(&t, NULL, abort_later, &ab);
  t0 = now_ms();
  ncclResult_t r = ncclBroadcast(&v, &out, 1, ncclInt32, 0, c, s);
  CHECK(r == ncclSystemError && now_ms() - t0 >= 100, "blocked call: %s after %lld ms", ncclGetErrorString(r),
        (long long)(now_ms() - t0));
  pthread_join(t, NULL);

  /* rank 0 sends to rank 1, which never makes a p2p call: the blocking handshake waits */
  c = init_blocking(id + 2, n, rank);
  ab.comm = c;
  pthread_create(&t, NULL, abort_later, &ab);
  if (rank == 0) {
    t0 = now_ms();
    r = ncclSend(&v, 1, ncclInt32, 1, c, s);
    CHECK(r == ncclSystemError && now_ms() - t0 >= 100, "blocked handshake: %s", ncclGetErrorString(r));
  }
  pthread_join(t, NULL);
  sync_stream(s);
  cudaStreamDestroy(s);
  CHECK(fake_nccl_comms_alive() == alive, "comms alive %d, want %d", fake_nccl_comms_alive(), alive);
}

/* A nonblocking communicator refuses calls until it is ready. */
static void case_inprogress(int id, int n, int rank) {
  fake_nccl_inject("ncclCommInitRankConfig", 1, FAKE_NCCL_INPROGRESS);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t c = NULL;
  CHECK(ncclCommInitRankConfig(&c, n, sh->ids[id], rank, &cfg) == ncclInProgress, "init in progress");
  int v = 1;
  CHECK(ncclAllReduce(&v, &v, 1, ncclInt32, ncclSum, c, NULL) == ncclInvalidUsage, "a call before it is ready");
  CHECK(strstr(ncclGetLastError(c), "in progress") != NULL, "message: %s", ncclGetLastError(c));
  CHECK(settle(c) == ncclSuccess, "settles");
  /* an injected async error: reported, the work ends */
  cudaStream_t s = new_stream();
  fake_nccl_inject("ncclAllReduce", 1, FAKE_NCCL_ASYNC_ERROR);
  NCHECK(ncclAllReduce(&v, &v, 1, ncclInt32, ncclSum, c, s));
  sync_stream(s);
  ncclResult_t st = ncclSuccess;
  NCHECK(ncclCommGetAsyncError(c, &st));
  CHECK(st == ncclRemoteError, "async error: %s", ncclGetErrorString(st));
  NCHECK(ncclCommAbort(c));
  cudaStreamDestroy(s);
  /* an uninitialized config is refused */
  ncclConfig_t bad;
  memset(&bad, 0, sizeof bad);
  CHECK(ncclCommInitRankConfig(&c, n, sh->ids[id], rank, &bad) == ncclInvalidArgument, "config without magic");
}

/* Sizes of a send and its receive must agree: the receiver hears of it. */
static void case_mismatch(ncclComm_t c, int rank) {
  cudaStream_t s = new_stream();
  char buf[100] = {0};
  if (rank == 0) NCHECK(ncclSend(buf, 100, ncclInt8, 1, c, s));
  if (rank == 1) NCHECK(ncclRecv(buf, 80, ncclInt8, 0, c, s));
  sync_stream(s);
  ncclResult_t st = ncclSuccess;
  NCHECK(ncclCommGetAsyncError(c, &st));
  if (rank == 1) CHECK(st == ncclInvalidUsage && strstr(ncclGetLastError(c), "80 bytes"), "mismatch: %s / %s",
                       ncclGetErrorString(st), ncclGetLastError(c));
  if (rank == 0) CHECK(st == ncclSuccess, "sender's state: %s", ncclGetErrorString(st));
  cudaStreamDestroy(s);
}

static void rank_main(int n, int rank) {
  cudaSetDevice(rank);
  ncclComm_t a = init_blocking(0, n, rank);
  ncclComm_t b = init_nonblocking(1, n, rank);
  int v = 0;
  NCHECK(ncclCommCuDevice(a, &v));
  CHECK(v == rank, "device %d", v);
  cudaStream_t s = new_stream(), sb = new_stream();
  case_allreduce(a, s, n, rank);
  case_collectives(a, s, n, rank);
  case_p2p(a, s, n, rank);
  case_nonblocking_p2p(b, sb, n, rank);
  case_split(a, n, rank);
  case_thread_groups(a, b, n, rank);
  case_graph(a, n, rank);
  if (n == 2) {
    ncclComm_t m = init_blocking(2, n, rank);
    case_mismatch(m, rank);
    NCHECK(ncclCommDestroy(m));
  }
  case_inprogress(3, n, rank);
  case_abort(4, n, rank);
  NCHECK(ncclCommFinalize(a));
  NCHECK(ncclCommDestroy(a));
  NCHECK(ncclCommDestroy(b));
  cudaStreamDestroy(s);
  cudaStreamDestroy(sb);
  CHECK(fake_nccl_comms_alive() == 0, "%d communicators left", fake_nccl_comms_alive());
}

/* Rank 1 is killed while rank 0 waits for it in an allreduce. */
static void rank_peer_killed(int n, int rank) {
  ncclComm_t c = init_blocking(0, n, rank);
  cudaStream_t s = new_stream();
  int v = 1, out = 0;
  NCHECK(ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, c, s));
  sync_stream(s);
  if (rank == 1) raise(SIGKILL);
  NCHECK(ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, c, s));
  const int64_t t0 = now_ms();
  ncclResult_t st = ncclSuccess;
  while (st == ncclSuccess && now_ms() - t0 < 5000) {
    NCHECK(ncclCommGetAsyncError(c, &st));
    usleep(1000);
  }
  CHECK(st == ncclRemoteError, "a dead peer: %s after %lld ms", ncclGetErrorString(st), (long long)(now_ms() - t0));
  CHECK(strstr(ncclGetLastError(c), "rank 1") && strstr(ncclGetLastError(c), "died"), "message: %s",
        ncclGetLastError(c));
  CHECK(fake_cuda_stream_pending(s) > 0, "the work still waits (as real kernels spin)");
  NCHECK(ncclCommAbort(c));
  sync_stream(s);
  cudaStreamDestroy(s);
}

/* Of 3 ranks, rank 1 joins and exits, rank 2 never comes: rank 0's blocking
 * init fails instead of waiting for ever, and leaves nothing behind. */
static void rank_dies_in_init(int n, int rank) {
  (void)n;
  ncclComm_t c = NULL;
  if (rank == 1) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK(ncclCommInitRankConfig(&c, 3, sh->ids[0], 1, &cfg) == ncclInProgress, "rank 1 init");
    usleep(200000);
    _exit(failures ? 1 : 0); /* as if it crashed: no abort */
  }
  const int64_t t0 = now_ms();
  const ncclResult_t r = ncclCommInitRank(&c, 3, sh->ids[0], 0);
  CHECK(r == ncclRemoteError && strstr(ncclGetLastError(NULL), "died"), "init with a dead peer: %s (%s)",
        ncclGetErrorString(r), ncclGetLastError(NULL));
  CHECK(c == NULL && fake_nccl_comms_alive() == 0, "the failed init freed its communicator");
  CHECK(now_ms() - t0 < 5000, "noticed after %lld ms", (long long)(now_ms() - t0));
}

/* Single-process checks: faults from the environment (exec'd), NCCL_COMM_BLOCKING, a peer that never joins. */
static int solo_main(void) {
  my_rank = 0;
  ncclComm_t c = NULL;
  cudaStream_t s = new_stream();
  int v = 2, out = 0;
  NCHECK(ncclCommInitRank(&c, 1, sh->ids[0], 0));
  NCHECK(ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, c, s));
  CHECK(ncclAllReduce(&v, &out, 1, ncclInt32, ncclSum, c, s) == ncclSystemError, "FAKE_NCCL_FAULTS fail");
  NCHECK(ncclAllReduce(&v, &out, 1, ncclInt32, ncclProd, c, s));
  sync_stream(s);
  CHECK(out == 2 && fake_nccl_calls("ncclAllReduce") == 3, "out %d, calls %d", out, fake_nccl_calls("ncclAllReduce"));
  NCHECK(ncclCommDestroy(c));
  setenv("NCCL_COMM_BLOCKING", "0", 1);
  CHECK(ncclCommInitRank(&c, 1, sh->ids[1], 0) == ncclInProgress, "NCCL_COMM_BLOCKING=0 makes it nonblocking");
  CHECK(settle(c) == ncclSuccess, "settles");
  NCHECK(ncclCommDestroy(c));
  unsetenv("NCCL_COMM_BLOCKING");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 1;
  NCHECK(ncclCommInitRankConfig(&c, 1, sh->ids[2], 0, &cfg));
  NCHECK(ncclCommDestroy(c));
  /* Ranks may be threads, or one thread may drive several ranks in groups:
   * inits inside a group are joined at its end, and first p2p connections
   * of several ranks in one group must not wait on each other. */
  ncclComm_t t[2] = {NULL, NULL};
  NCHECK(ncclGroupStart());
  for (int r = 0; r < 2; r++) NCHECK(ncclCommInitRank(&t[r], 2, sh->ids[4], r));
  NCHECK(ncclGroupEnd());
  cudaStream_t ts[2] = {new_stream(), new_stream()};
  int tin[2] = {3, 4}, tout[2] = {0, 0}, tx[2] = {0, 0};
  NCHECK(ncclGroupStart());
  for (int r = 0; r < 2; r++) NCHECK(ncclAllReduce(&tin[r], &tout[r], 1, ncclInt32, ncclSum, t[r], ts[r]));
  for (int r = 0; r < 2; r++) {
    NCHECK(ncclSend(&tin[r], 1, ncclInt32, 1 - r, t[r], ts[r]));
    NCHECK(ncclRecv(&tx[r], 1, ncclInt32, 1 - r, t[r], ts[r]));
  }
  NCHECK(ncclGroupEnd());
  for (int r = 0; r < 2; r++) {
    sync_stream(ts[r]);
    CHECK(tout[r] == 7 && tx[r] == tin[1 - r], "one thread, two ranks: rank %d got %d and %d", r, tout[r], tx[r]);
    NCHECK(ncclCommFinalize(t[r]));
    NCHECK(ncclCommDestroy(t[r]));
    cudaStreamDestroy(ts[r]);
  }
  /* a peer never joins: in progress until aborted, and the segment goes */
  cfg.blocking = 0;
  CHECK(ncclCommInitRankConfig(&c, 2, sh->ids[3], 0, &cfg) == ncclInProgress, "init of 2 alone");
  usleep(100000);
  ncclResult_t st = ncclSuccess;
  NCHECK(ncclCommGetAsyncError(c, &st));
  CHECK(st == ncclInProgress, "still in progress: %s", ncclGetErrorString(st));
  NCHECK(ncclCommAbort(c));
  cudaStreamDestroy(s);
  CHECK(fake_nccl_comms_alive() == 0, "comms alive");
  return failures;
}

/* ---- driver ------------------------------------------------------------------- */

/* The fakenccl-* segments in /dev/shm (at most 64 names are remembered). */
#define MAX_SEGS 64
typedef struct segs {
  int n;
  char names[MAX_SEGS][256];
} segs_t;

static void list_segments(segs_t *out) {
  out->n = 0;
  DIR *d = opendir("/dev/shm");
  for (struct dirent *e; d && (e = readdir(d));)
    if (strncmp(e->d_name, "fakenccl-", 9) == 0 && out->n < MAX_SEGS)
      snprintf(out->names[out->n++], sizeof out->names[0], "%s", e->d_name);
  if (d) closedir(d);
}

/* Segments in `after` that were not in `before`: what this run left (other
 * runs on the machine may come and go meanwhile). */
static int new_segments(const segs_t *before, const segs_t *after) {
  int k = 0;
  for (int i = 0; i < after->n; i++) {
    int old = 0;
    for (int j = 0; j < before->n; j++) old |= strcmp(after->names[i], before->names[j]) == 0;
    if (!old) {
      fprintf(stderr, "left in /dev/shm: %s\n", after->names[i]);
      k++;
    }
  }
  return k;
}

/* Forks n ranks; `killed` is the rank expected to die of SIGKILL (-1: none). */
static int run(const char *name, int n, void (*fn)(int, int), int killed) {
  for (int i = 0; i < MAX_IDS; i++) ncclGetUniqueId(&sh->ids[i]);
  atomic_store(&sh->flag, 0);
  pid_t pids[8];
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      my_rank = r;
      alarm(60);
      fn(n, r);
      fflush(stderr);
      _exit(failures ? 1 : 0);
    }
  }
  int bad = 0;
  for (int r = 0; r < n; r++) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    const int ok = r == killed ? WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL
                               : WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok) {
      fprintf(stderr, "%s: rank %d of %d failed (status 0x%x)\n", name, r, n, status);
      bad++;
    }
  }
  printf("%-14s %d ranks: %s\n", name, n, bad ? "FAILED" : "ok");
  fflush(stdout);
  return bad;
}

int main(int argc, char **argv) {
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (argc > 1 && strcmp(argv[1], "--solo") == 0) {
    for (int i = 0; i < MAX_IDS; i++) ncclGetUniqueId(&sh->ids[i]);
    return solo_main() ? 1 : 0;
  }
  /* Small staging so that every path chunks (before the first NCCL call). */
  setenv("FAKE_NCCL_SLOT_BYTES", "8192", 1);
  setenv("FAKE_NCCL_MBOX_BYTES", "4096", 1);
  setenv("FAKE_CUDA_DELAY_US", "50", 0);
  static segs_t before, after;
  list_segments(&before);
  int bad = 0;
  bad += run("collectives", 2, rank_main, -1);
  bad += run("collectives", 3, rank_main, -1);
  bad += run("peer killed", 2, rank_peer_killed, 1);
  bad += run("dies in init", 2, rank_dies_in_init, -1);
  /* Faults from the environment reach an exec'd process's first NCCL call. */
  pid_t p = fork();
  if (p == 0) {
    setenv("FAKE_NCCL_FAULTS", "ncclAllReduce:2:fail", 1);
    execl("/proc/self/exe", argv[0], "--solo", (char *)NULL);
    _exit(127);
  }
  int status = 0;
  waitpid(p, &status, 0);
  const int solo_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  printf("%-14s 1 rank:  %s\n", "env faults", solo_ok ? "ok" : "FAILED");
  bad += !solo_ok;
  list_segments(&after);
  bad += new_segments(&before, &after);
  printf("%s\n", bad ? "selftest_nccl: FAILED" : "selftest_nccl: all ok");
  return bad ? 1 : 0;
}
