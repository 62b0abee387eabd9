/*
 * fake_nccl.c - a test double of NCCL, built as libnccl.so.2 against the
 * real nccl.h, so that the core's CUDA path (src/nccl/) runs in CI on
 * machines without a GPU, against groups of processes. It never ships; the
 * controls it adds for tests are in fake_gpu.h.
 *
 * The model:
 *
 * - Ranks are processes (or threads) of one machine. A communicator is a
 *   POSIX shared-memory segment named after the unique id. Every rank maps
 *   it, registers (pid, rank) and waits until all nranks did; the segment
 *   is unlinked as soon as everyone mapped it (and on abort or destroy), so
 *   /dev/shm is clean whatever the ranks do afterwards. ncclCommSplit
 *   derives the child's name from the parent's id, a per-parent split
 *   counter and the color, so it needs no exchange beyond (color, key).
 *
 * - Host calls only record work. A collective or p2p call, or at the
 *   outermost ncclGroupEnd the whole group (groups are per thread, as in
 *   NCCL), becomes one fake_task_t per communicator, enqueued on the
 *   caller's stream (fake_gpu.h). The stream's worker drives the task's
 *   step, which never blocks: it moves data as far as the peers allow and
 *   returns 0 while it waits, as a kernel spins on a flag. The tasks of
 *   one communicator execute one at a time, in the order they start, as
 *   NCCL's kernels on one communicator do.
 *
 * - The data paths live in the segment and use only C11 atomics (lock-free
 *   and address-free, so they work across processes):
 *   collectives: every rank owns a staging slot. Each chunk of each
 *     collective has a generation g, the same on every rank (ranks issue
 *     the same collectives in the same order). A rank fills its slot once
 *     every rank acknowledged g-1, publishes g, waits until every rank
 *     published g, computes its output from all the slots - reductions in
 *     rank order 0..n-1, so every rank gets the same bits - and
 *     acknowledges g.
 *   point-to-point: a byte ring per ordered pair of ranks. The receiver
 *     posts its receive; the sender, once it is posted, announces the
 *     size and streams the bytes; the receiver drains them and says done,
 *     which completes the send. Messages of a pair match in issue order.
 *
 * - What tests rely on, as with real NCCL: a nonblocking communicator
 *   returns ncclInProgress and finishes init (and first connections) in a
 *   thread of ours, and a call made before it is ready is refused; the
 *   first p2p call towards a peer handshakes with it on the host; device
 *   work that waits for a dead peer spins until ncclCommAbort, while
 *   ncclCommGetAsyncError reports ncclRemoteError; ncclCommAbort releases
 *   any thread blocked inside the communicator. Faults can be injected per
 *   call (fake_nccl_inject, $FAKE_NCCL_FAULTS).
 *
 * Where the fake says more than NCCL would (NCCL would hang or corrupt
 * data): ranks running different collectives (kind, count, type, op, root)
 * get ncclInvalidUsage as their async error and the communicator's device
 * work ends from then on, as after an injected async error; a receive
 * whose size differs from its send gets ncclInvalidUsage; an init whose
 * registered peer died or aborted fails with ncclRemoteError (a peer that
 * never comes still makes it wait for ever). AlltoAll, Gather and Scatter
 * are grouped sends and receives, as in NCCL.
 *
 * Object lifetimes: a handle (struct ncclComm) is what the user holds and
 * is freed by destroy/abort, once no call is inside it, so a later use is
 * a use-after-free that ASan reports. The internals (core_t) are reference
 * counted: the handle, every task a stream still holds, every recorded op
 * and every background job keep them alive.
 *
 * Waiting: host-side waits nap with nanosleep (20 us, growing to 1 ms);
 * device-side waits return 0 and let the stream's worker nap. Nothing
 * spins: CI runs several ranks on two cores.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "fake_gpu.h"

_Static_assert(ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_LONG_LOCK_FREE == 2 && ATOMIC_LLONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free to work across processes");

#define ID_MAGIC "FAKENCCL" /* the first bytes of every unique id we make */
#define HANDLE_MAGIC 0x4e43434cu
#define MSG_LEN 512
#define MAX_PREMUL 256
#define MAX_RULES 64
#define LIVENESS_NS (100 * 1000 * 1000LL) /* how often a waiter looks at its peers */
#define DEFAULT_SLOT_BYTES ((size_t)1 << 20)
#define SMALL_MBOX_BYTES ((size_t)256 << 10)

enum { GONE_ABORTED = 1, GONE_DESTROYED = 2 };

/* ==== small utilities ===================================================== */

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_ns(int64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Host-side polling: short naps while a peer is probably just behind,
 * longer ones once the wait has lasted (a hang must not eat a core). */
typedef struct backoff {
  int64_t since;
} backoff_t;

static backoff_t backoff_start(void) { return (backoff_t){now_ns()}; }

static void backoff_nap(const backoff_t *b) {
  const int64_t idle = now_ns() - b->since;
  sleep_ns(idle < 2000000 ? 20000 : idle < 100000000 ? 100000 : 1000000);
}

static long env_long(const char *name, long dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end = NULL;
  long v = strtol(s, &end, 10);
  return end && *end == '\0' ? v : dflt;
}

static int abort_ms(void) {
  long ms = env_long("FAKE_NCCL_ABORT_MS", 20);
  return ms < 0 ? 0 : ms > 60000 ? 60000 : (int)ms;
}

static int inprogress_ms(void) {
  long ms = env_long("FAKE_NCCL_INPROGRESS_MS", 50);
  return ms < 0 ? 0 : ms > 600000 ? 600000 : (int)ms;
}

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* splitmix64's finalizer: derives split ids, mixes nothing secret. */
static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/* ==== errors ============================================================== */

/* ncclGetLastError returns the newest of the thread's last synchronous
 * failure and the communicator's asynchronous one; a global clock orders them. */
static _Atomic uint64_t message_clock;
static _Thread_local char tl_msg[MSG_LEN];
static _Thread_local uint64_t tl_msg_stamp;
static _Thread_local char tl_msg_out[MSG_LEN];

static ncclResult_t fail(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static ncclResult_t fail(ncclResult_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_msg, sizeof tl_msg, fmt, ap);
  va_end(ap);
  tl_msg_stamp = atomic_fetch_add(&message_clock, 1) + 1;
  return r;
}

/* ==== fault injection and call counting =================================== */

enum api {
  API_GetVersion, API_GetUniqueId, API_CommInitRank, API_CommInitRankConfig, API_CommSplit,
  API_CommFinalize, API_CommDestroy, API_CommAbort, API_CommGetAsyncError, API_CommCount,
  API_CommUserRank, API_CommCuDevice, API_GetErrorString, API_GetLastError, API_GroupStart,
  API_GroupEnd, API_AllReduce, API_Broadcast, API_Bcast, API_Reduce, API_AllGather,
  API_ReduceScatter, API_Send, API_Recv, API_AlltoAll, API_Gather, API_Scatter,
  API_RedOpCreatePreMulSum, API_RedOpDestroy, API_COUNT
};

static const char *const api_names[API_COUNT] = {
    "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommSplit",
    "ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclCommCount",
    "ncclCommUserRank", "ncclCommCuDevice", "ncclGetErrorString", "ncclGetLastError", "ncclGroupStart",
    "ncclGroupEnd", "ncclAllReduce", "ncclBroadcast", "ncclBcast", "ncclReduce", "ncclAllGather",
    "ncclReduceScatter", "ncclSend", "ncclRecv", "ncclAlltoAll", "ncclGather", "ncclScatter",
    "ncclRedOpCreatePreMulSum", "ncclRedOpDestroy"};

typedef struct rule {
  char name[64];
  int target; /* fires on this value of the name's call count */
  fake_nccl_fault_t fault;
} rule_t;

static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static rule_t rules[MAX_RULES];
static int nrules;
static int call_count[API_COUNT];
static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static atomic_int comms_alive;

static int api_index(const char *name) {
  for (int i = 0; i < API_COUNT; i++)
    if (name && strcmp(name, api_names[i]) == 0) return i;
  return -1;
}

/* Caller holds fault_lock. */
static void add_rule(const char *call, int nth, fake_nccl_fault_t fault) {
  if (!call || nth < 1 || fault == FAKE_NCCL_NONE || nrules == MAX_RULES) return;
  const int api = api_index(call);
  rule_t *r = &rules[nrules++];
  snprintf(r->name, sizeof r->name, "%s", call);
  r->target = (api >= 0 ? call_count[api] : 0) + nth;
  r->fault = fault;
}

/* $FAKE_NCCL_FAULTS="ncclAllReduce:3:hang_kernel,ncclCommInitRankConfig:1:block", read
 * at the first NCCL call of the process, so forked or exec'd ranks can get faults. */
static void parse_env_faults(void) {
  const char *s = getenv("FAKE_NCCL_FAULTS");
  if (!s || !*s) return;
  static const struct { const char *name; fake_nccl_fault_t fault; } kinds[] = {
      {"fail", FAKE_NCCL_FAIL},           {"block", FAKE_NCCL_BLOCK},
      {"inprogress", FAKE_NCCL_INPROGRESS}, {"hang_kernel", FAKE_NCCL_HANG_KERNEL},
      {"async_error", FAKE_NCCL_ASYNC_ERROR}};
  char buf[2048];
  snprintf(buf, sizeof buf, "%s", s);
  char *save = NULL;
  pthread_mutex_lock(&fault_lock);
  for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    char *c1 = strchr(item, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    fake_nccl_fault_t fault = FAKE_NCCL_NONE;
    if (c1 && c2) {
      *c1 = *c2 = '\0';
      for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++)
        if (strcmp(c2 + 1, kinds[k].name) == 0) fault = kinds[k].fault;
    }
    const int nth = c1 ? atoi(c1 + 1) : 0;
    if (fault == FAKE_NCCL_NONE || nth < 1 || api_index(item) < 0)
      fprintf(stderr, "fake NCCL: ignoring the FAKE_NCCL_FAULTS entry '%s' (want call:nth:fault)\n", item);
    else
      add_rule(item, nth, fault);
  }
  pthread_mutex_unlock(&fault_lock);
}

/* Counts a call of `api` and returns the fault it must show (one-shot). */
static fake_nccl_fault_t enter_api(enum api api) {
  pthread_once(&env_once, parse_env_faults);
  fake_nccl_fault_t f = FAKE_NCCL_NONE;
  pthread_mutex_lock(&fault_lock);
  const int n = ++call_count[api];
  for (int i = 0; i < nrules; i++) {
    if (rules[i].target == n && strcmp(rules[i].name, api_names[api]) == 0) {
      f = rules[i].fault;
      rules[i] = rules[--nrules];
      break;
    }
  }
  pthread_mutex_unlock(&fault_lock);
  return f;
}

void fake_nccl_inject(const char *call, int nth, fake_nccl_fault_t fault) {
  pthread_once(&env_once, parse_env_faults);
  pthread_mutex_lock(&fault_lock);
  add_rule(call, nth, fault);
  pthread_mutex_unlock(&fault_lock);
}

void fake_nccl_clear_faults(void) {
  pthread_once(&env_once, parse_env_faults);
  pthread_mutex_lock(&fault_lock);
  nrules = 0;
  pthread_mutex_unlock(&fault_lock);
}

int fake_nccl_calls(const char *call) {
  const int api = api_index(call);
  if (api < 0) return 0;
  pthread_mutex_lock(&fault_lock);
  const int n = call_count[api];
  pthread_mutex_unlock(&fault_lock);
  return n;
}

int fake_nccl_comms_alive(void) { return atomic_load(&comms_alive); }

/* ==== numbers: 16-bit floats and the reduction kernels ===================== */

static float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t bits;
  if (e == 0) {
    const float v = (float)m * 0x1p-24f; /* zero or subnormal: exact */
    return sign ? -v : v;
  }
  if (e == 31) bits = sign | 0x7f800000u | (m << 13);
  else bits = sign | ((e + 112) << 23) | (m << 13);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* Round to nearest, ties to even, as the GPU's __float2half_rn. */
static uint16_t f32_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff)); /* NaN stays NaN */
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* >= 65520 (and inf): inf */
  if (ax >= 0x38800000u) {                                  /* normal half */
    uint32_t r = ax - 0x38000000u;                          /* exponent rebiased 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
  }
  if (ax < 0x33000000u) return sign; /* below half the smallest subnormal (ties to 0, even) */
  const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - e; /* value in units of 2^-24 is m >> shift */
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) q++;
  return (uint16_t)(sign | q);
}

static float bf16_to_f32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

static float ld_f32(float v) { return v; }
static float st_f32(float v) { return v; }
static double ld_f64(double v) { return v; }
static double st_f64(double v) { return v; }

/* The reduce kinds after mapping: AVG on floats becomes PREMUL by 1/n (as
 * NCCL does), AVG on integers stays a sum divided by n at the end. */
enum red_kind { RED_SUM, RED_PROD, RED_MAX, RED_MIN, RED_AVG, RED_PREMUL };

typedef struct redop {
  int kind;        /* enum red_kind */
  int user;        /* the op as called: 0..ncclNumOps-1, or ncclNumOps for a PreMulSum op */
  int device;      /* the scalar is read from dev_scalar when the work runs */
  uint8_t scalar[8];
  const void *dev_scalar;
} redop_t;

/* acc[i] = acc[i] (op) x[i]; float max/min return the non-NaN operand as fmaxf does. */
#define FOLD_LOOPS(T, LD, ST)                                                                  \
  switch (kind) {                                                                              \
    case RED_PROD:                                                                             \
      for (size_t i = 0; i < len; i++) acc[i] = ST(LD(acc[i]) * LD(x[i]));                     \
      break;                                                                                   \
    case RED_MAX:                                                                              \
      for (size_t i = 0; i < len; i++) {                                                       \
        const __typeof__(LD(acc[0])) a = LD(acc[i]), b = LD(x[i]);                             \
        acc[i] = ST((a > b || b != b) ? a : b);                                                \
      }                                                                                        \
      break;                                                                                   \
    case RED_MIN:                                                                              \
      for (size_t i = 0; i < len; i++) {                                                       \
        const __typeof__(LD(acc[0])) a = LD(acc[i]), b = LD(x[i]);                             \
        acc[i] = ST((a < b || b != b) ? a : b);                                                \
      }                                                                                        \
      break;                                                                                   \
    default:                                                                                   \
      for (size_t i = 0; i < len; i++) acc[i] = ST(LD(acc[i]) + LD(x[i]));                     \
      break;                                                                                   \
  }

/* Integers wrap as on the GPU: sums and products in the unsigned type. */
#define INT_KERNELS(NAME, T, UT, WIDE)                                                          \
  static void fold_##NAME(T *acc, const T *x, size_t len, int kind) {                          \
    switch (kind) {                                                                            \
      case RED_PROD:                                                                           \
        for (size_t i = 0; i < len; i++) acc[i] = (T)((UT)((UT)acc[i] * (UT)x[i]));            \
        break;                                                                                 \
      case RED_MAX:                                                                            \
        for (size_t i = 0; i < len; i++)                                                       \
          if (x[i] > acc[i]) acc[i] = x[i];                                                    \
        break;                                                                                 \
      case RED_MIN:                                                                            \
        for (size_t i = 0; i < len; i++)                                                       \
          if (x[i] < acc[i]) acc[i] = x[i];                                                    \
        break;                                                                                 \
      default:                                                                                 \
        for (size_t i = 0; i < len; i++) acc[i] = (T)((UT)((UT)acc[i] + (UT)x[i]));            \
        break;                                                                                 \
    }                                                                                          \
  }                                                                                            \
  static void scale_##NAME(T *x, size_t len, const uint8_t *s) {                               \
    T v;                                                                                       \
    memcpy(&v, s, sizeof v);                                                                   \
    for (size_t i = 0; i < len; i++) x[i] = (T)((UT)((UT)x[i] * (UT)v));                       \
  }                                                                                            \
  static void div_##NAME(T *x, size_t len, int n) {                                            \
    for (size_t i = 0; i < len; i++) x[i] = (T)((WIDE)x[i] / (WIDE)n);                         \
  }

INT_KERNELS(i8, int8_t, uint8_t, int64_t)
INT_KERNELS(u8, uint8_t, uint8_t, uint64_t)
INT_KERNELS(i32, int32_t, uint32_t, int64_t)
INT_KERNELS(u32, uint32_t, uint32_t, uint64_t)
INT_KERNELS(i64, int64_t, uint64_t, int64_t)
INT_KERNELS(u64, uint64_t, uint64_t, uint64_t)

/* Floating types compute in float (double for float64) and round once per
 * operation: for 16-bit types that equals the GPU's correctly rounded
 * half/bfloat16 arithmetic (float has more than 2p+2 bits). */
#define FLOAT_KERNELS(NAME, T, C, LD, ST)                                                       \
  static void fold_##NAME(T *acc, const T *x, size_t len, int kind) { FOLD_LOOPS(T, LD, ST) }  \
  static void scale_##NAME(T *x, size_t len, const uint8_t *s) {                               \
    T v;                                                                                       \
    memcpy(&v, s, sizeof v);                                                                   \
    const C sv = LD(v);                                                                        \
    for (size_t i = 0; i < len; i++) x[i] = ST(LD(x[i]) * sv);                                 \
  }

FLOAT_KERNELS(f16, uint16_t, float, f16_to_f32, f32_to_f16)
FLOAT_KERNELS(bf16, uint16_t, float, bf16_to_f32, f32_to_bf16)
FLOAT_KERNELS(f32, float, float, ld_f32, st_f32)
FLOAT_KERNELS(f64, double, double, ld_f64, st_f64)

static size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static int is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
}

static const char *type_name(ncclDataType_t t) {
  static const char *const names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64",
                                      "float16", "float32", "float64", "bfloat16", "fp8e4m3", "fp8e5m2"};
  return (int)t >= 0 && (int)t < ncclNumTypes ? names[t] : "invalid type";
}

static void fold(ncclDataType_t t, int kind, void *acc, const void *x, size_t len) {
  switch (t) {
    case ncclInt8: fold_i8(acc, x, len, kind); break;
    case ncclUint8: fold_u8(acc, x, len, kind); break;
    case ncclInt32: fold_i32(acc, x, len, kind); break;
    case ncclUint32: fold_u32(acc, x, len, kind); break;
    case ncclInt64: fold_i64(acc, x, len, kind); break;
    case ncclUint64: fold_u64(acc, x, len, kind); break;
    case ncclFloat16: fold_f16(acc, x, len, kind); break;
    case ncclBfloat16: fold_bf16(acc, x, len, kind); break;
    case ncclFloat32: fold_f32(acc, x, len, kind); break;
    case ncclFloat64: fold_f64(acc, x, len, kind); break;
    default: break;
  }
}

static void scale(ncclDataType_t t, void *x, size_t len, const uint8_t *s) {
  switch (t) {
    case ncclInt8: scale_i8(x, len, s); break;
    case ncclUint8: scale_u8(x, len, s); break;
    case ncclInt32: scale_i32(x, len, s); break;
    case ncclUint32: scale_u32(x, len, s); break;
    case ncclInt64: scale_i64(x, len, s); break;
    case ncclUint64: scale_u64(x, len, s); break;
    case ncclFloat16: scale_f16(x, len, s); break;
    case ncclBfloat16: scale_bf16(x, len, s); break;
    case ncclFloat32: scale_f32(x, len, s); break;
    case ncclFloat64: scale_f64(x, len, s); break;
    default: break;
  }
}

/* Integer average: the sum divided by n with C's integer division, as NCCL. */
static void divide(ncclDataType_t t, void *x, size_t len, int n) {
  switch (t) {
    case ncclInt8: div_i8(x, len, n); break;
    case ncclUint8: div_u8(x, len, n); break;
    case ncclInt32: div_i32(x, len, n); break;
    case ncclUint32: div_u32(x, len, n); break;
    case ncclInt64: div_i64(x, len, n); break;
    case ncclUint64: div_u64(x, len, n); break;
    default: break;
  }
}

/* 1/n in the type's own precision: the scalar of a floating-point AVG. */
static void reciprocal(ncclDataType_t t, int n, uint8_t *out) {
  const float f = 1.0f / (float)n;
  const double d = 1.0 / (double)n;
  uint16_t h;
  switch (t) {
    case ncclFloat16: h = f32_to_f16(f); memcpy(out, &h, 2); break;
    case ncclBfloat16: h = f32_to_bf16(f); memcpy(out, &h, 2); break;
    case ncclFloat32: memcpy(out, &f, 4); break;
    default: memcpy(out, &d, 8); break;
  }
}

/* ==== the shared segment ==================================================== */

typedef struct coll_meta { /* what a rank runs: checked against its peers */
  uint32_t kind, type, red, root;
  uint64_t count;
} coll_meta_t;

typedef struct sh_hdr {
  _Atomic uint32_t nranks;     /* set by the first rank to map it; the others compare */
  _Atomic uint32_t registered; /* ranks that joined */
  _Atomic uint32_t unlinked;   /* whoever swaps 0 -> 1 unlinks the name */
  _Atomic uint64_t slot_bytes, mbox_bytes;
} sh_hdr_t;

typedef struct sh_rank {
  _Alignas(64) _Atomic uint32_t joined; /* the rank claimed this entry */
  _Atomic uint32_t gone;                /* GONE_*: no longer takes part */
  _Atomic int32_t pid;
  _Atomic uint64_t start_time; /* tells the rank's process from a later one with its pid */
  _Atomic uint64_t pub_gen, ack_gen;
  coll_meta_t meta; /* of the chunk published as pub_gen */
  _Atomic uint64_t split_seq, split_ack;
  int32_t split_color, split_key; /* of split number split_seq */
} sh_rank_t;

typedef struct sh_pair { /* the ring from one rank to another */
  _Alignas(64) _Atomic uint64_t posted; /* receives the receiver posted */
  _Atomic uint64_t announced;           /* messages whose size the sender published */
  _Atomic uint64_t bytes;               /* the size of message announced-1 */
  _Atomic uint64_t head, tail;          /* bytes written / consumed, ever */
  _Atomic uint64_t done;                /* messages the receiver consumed */
} sh_pair_t;

typedef struct layout {
  size_t ranks, conn, pairs, slots, mboxes, total;
} layout_t;

static layout_t layout_of(int n, size_t slot, size_t mbox) {
  layout_t l;
  const size_t nn = (size_t)n * (size_t)n;
  l.ranks = align_up(sizeof(sh_hdr_t), 64);
  l.conn = l.ranks + (size_t)n * sizeof(sh_rank_t);
  l.pairs = align_up(l.conn + nn * sizeof(_Atomic uint32_t), 64);
  l.slots = align_up(l.pairs + nn * sizeof(sh_pair_t), 4096);
  l.mboxes = l.slots + (size_t)n * slot;
  l.total = align_up(l.mboxes + nn * mbox, 4096);
  return l;
}

/* ==== communicators ========================================================= */

typedef struct premul {
  int used;
  ncclDataType_t type;
  int device;
  uint8_t value[8];
  const void *ptr;
} premul_t;

typedef struct core {
  _Atomic int refs;
  int blocking, device;
  /* Identity: set before the communicator is used (a split child's by its
   * job, published by `named`). */
  int rank, nranks;
  uint8_t key[16];
  char shm_name[48];
  size_t slot_bytes, mbox_bytes;
  layout_t lay;
  _Atomic int named;
  /* The mapping, published by `mapped`. */
  uint8_t *map;
  _Atomic int claimed; /* this rank owns its entry in the segment */
  _Atomic int mapped;
  _Atomic int joined;   /* every rank registered */
  _Atomic int aborted;  /* ncclCommAbort */
  _Atomic int closed;   /* ncclCommDestroy */
  _Atomic int busy;     /* background jobs of a nonblocking communicator */
  _Atomic int pending;  /* eager device work enqueued and not finished */
  _Atomic int broken;   /* device work ends at once (an injected async error, a mismatch) */
  _Atomic int async_err;
  _Atomic uint32_t splits;
  _Atomic int *connected; /* per peer: the p2p handshake is done */
  _Atomic int *reported;  /* per rank: its death was reported */
  pthread_mutex_t mu;     /* async_msg, async_stamp, premul */
  char async_msg[MSG_LEN];
  uint64_t async_stamp;
  premul_t premul[MAX_PREMUL];
  /* Device side: touched only by the task whose turn it is. */
  _Atomic uint64_t next_ticket, turn;
  uint64_t coll_gen;
  uint64_t *sent, *recvd; /* per peer: messages */
} core_t;

struct ncclComm {
  uint32_t magic;
  core_t *core;
  atomic_int inside; /* threads inside a call on this handle */
};

static sh_hdr_t *sh_hdr(const core_t *c) { return (sh_hdr_t *)c->map; }
static sh_rank_t *sh_rank(const core_t *c, int r) { return (sh_rank_t *)(c->map + c->lay.ranks) + r; }
static _Atomic uint32_t *sh_conn(const core_t *c, int from, int to) {
  return (_Atomic uint32_t *)(c->map + c->lay.conn) + (size_t)from * (size_t)c->nranks + (size_t)to;
}
static sh_pair_t *sh_pair(const core_t *c, int from, int to) {
  return (sh_pair_t *)(c->map + c->lay.pairs) + (size_t)from * (size_t)c->nranks + (size_t)to;
}
static uint8_t *sh_slot(const core_t *c, int r) { return c->map + c->lay.slots + (size_t)r * c->slot_bytes; }
static uint8_t *sh_mbox(const core_t *c, int from, int to) {
  return c->map + c->lay.mboxes + ((size_t)from * (size_t)c->nranks + (size_t)to) * c->mbox_bytes;
}

/* The first error stays; its message is what ncclGetLastError shows. */
static void set_async(core_t *c, ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_async(core_t *c, ncclResult_t r, const char *fmt, ...) {
  int expected = ncclSuccess;
  if (!atomic_compare_exchange_strong(&c->async_err, &expected, (int)r)) return;
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&c->mu);
  vsnprintf(c->async_msg, sizeof c->async_msg, fmt, ap);
  c->async_stamp = atomic_fetch_add(&message_clock, 1) + 1;
  pthread_mutex_unlock(&c->mu);
  va_end(ap);
}

static core_t *core_new(int blocking, int device) {
  core_t *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  atomic_init(&c->refs, 1);
  pthread_mutex_init(&c->mu, NULL);
  c->blocking = blocking;
  c->device = device;
  return c;
}

static void core_ref(core_t *c) { atomic_fetch_add(&c->refs, 1); }

static void core_unref(core_t *c) {
  if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
  if (c->map) munmap(c->map, c->lay.total);
  free(c->connected);
  free(c->reported);
  free(c->sent);
  free(c->recvd);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

static size_t env_bytes(const char *name, size_t dflt, size_t lo, size_t hi) {
  long v = env_long(name, (long)dflt);
  size_t b = v <= 0 ? dflt : (size_t)v;
  b = b < lo ? lo : b > hi ? hi : b;
  return align_up(b, 64);
}

/* Gives the communicator its rank, size and segment name. */
static ncclResult_t core_setup(core_t *c, int nranks, int rank, const uint8_t key[16]) {
  c->nranks = nranks;
  c->rank = rank;
  memcpy(c->key, key, 16);
  char *p = c->shm_name + snprintf(c->shm_name, sizeof c->shm_name, "/fakenccl-");
  for (int i = 0; i < 16; i++) p += sprintf(p, "%02x", key[i]);
  /* One slot must hold an element of every rank (reduce-scatter chunks). */
  c->slot_bytes = env_bytes("FAKE_NCCL_SLOT_BYTES", DEFAULT_SLOT_BYTES, (size_t)nranks * 64 + 4096, (size_t)1 << 30);
  /* 256 KiB rings up to 4 ranks (4 ranks: 8 MiB in all); beyond, the rings share ~4 MiB. */
  size_t mbox = nranks <= 4 ? SMALL_MBOX_BYTES : ((size_t)4 << 20) / ((size_t)nranks * (size_t)nranks);
  c->mbox_bytes = env_bytes("FAKE_NCCL_MBOX_BYTES", mbox, 4096, (size_t)1 << 30);
  c->lay = layout_of(nranks, c->slot_bytes, c->mbox_bytes);
  c->connected = calloc((size_t)nranks, sizeof *c->connected);
  c->reported = calloc((size_t)nranks, sizeof *c->reported);
  c->sent = calloc((size_t)nranks, sizeof *c->sent);
  c->recvd = calloc((size_t)nranks, sizeof *c->recvd);
  if (!c->connected || !c->reported || !c->sent || !c->recvd)
    return fail(ncclSystemError, "fake NCCL: out of memory");
  atomic_store(&c->named, 1);
  return ncclSuccess;
}

static struct ncclComm *handle_new(core_t *c) {
  struct ncclComm *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  h->magic = HANDLE_MAGIC;
  h->core = c;
  atomic_fetch_add(&comms_alive, 1);
  return h;
}

/* Frees the handle once no other call is inside it (an abort released them). */
static void handle_free(struct ncclComm *h) {
  const backoff_t b = backoff_start();
  while (atomic_load(&h->inside) > 0) backoff_nap(&b);
  core_t *c = h->core;
  h->magic = 0;
  free(h);
  core_unref(c);
  atomic_fetch_sub(&comms_alive, 1);
}

/* A call enters the handle (abort waits for it to leave) and gets the core. */
static ncclResult_t comm_enter(struct ncclComm *h, const char *call, core_t **out) {
  if (!h) return fail(ncclInvalidArgument, "fake NCCL: %s: the communicator is NULL", call);
  if (h->magic != HANDLE_MAGIC)
    return fail(ncclInvalidArgument, "fake NCCL: %s: not a communicator (destroyed or aborted already?)", call);
  atomic_fetch_add(&h->inside, 1);
  *out = h->core;
  return ncclSuccess;
}

static void comm_leave(struct ncclComm *h) { atomic_fetch_sub(&h->inside, 1); }

/* Calls other than abort, destroy and the queries must wait until a
 * nonblocking communicator is ready, as NCCL's documentation requires. */
static ncclResult_t check_ready(core_t *c, const char *call) {
  if (atomic_load(&c->busy))
    return fail(ncclInvalidUsage,
                "fake NCCL: %s on a nonblocking communicator that is still in progress: poll "
                "ncclCommGetAsyncError until it no longer returns ncclInProgress before issuing further calls",
                call);
  if (!atomic_load(&c->joined)) {
    char why[MSG_LEN];
    pthread_mutex_lock(&c->mu);
    snprintf(why, sizeof why, "%s", c->async_msg);
    pthread_mutex_unlock(&c->mu);
    return fail(ncclInvalidUsage, "fake NCCL: %s on a communicator whose initialization failed: %s", call, why);
  }
  if (atomic_load(&c->aborted) || atomic_load(&c->closed))
    return fail(ncclInvalidUsage, "fake NCCL: %s on a communicator that was aborted or destroyed", call);
  return ncclSuccess;
}

/* ---- peers ---------------------------------------------------------------- */

/* Field 22 of /proc/<pid>/stat (start time), 0 if unreadable; *state gets field 3. */
static uint64_t proc_start_time(pid_t pid, char *state) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  *state = '?';
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) *state = 'X';
    return 0;
  }
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces and ')' */
  if (!p || p[1] != ' ') return 0;
  *state = p[2];
  p += 2;
  for (int field = 3; field < 22 && p; field++) {
    p = strchr(p, ' ');
    if (p) p++;
  }
  return p ? strtoull(p, NULL, 10) : 0;
}

/* Why rank j can no longer take part (it died, aborted, destroyed), or NULL.
 * A zombie counts as dead: a killed rank's parent may not have reaped it. */
static const char *peer_gone(const core_t *c, int j, char *why, size_t len) {
  const sh_rank_t *r = sh_rank(c, j);
  const int pid = atomic_load(&r->pid);
  const uint32_t gone = atomic_load(&r->gone);
  if (gone) {
    snprintf(why, len, "fake NCCL: rank %d (pid %d) %s its communicator", j, pid,
             gone == GONE_ABORTED ? "aborted" : "destroyed");
    return why;
  }
  if (pid <= 0 || pid == getpid()) return NULL;
  char state;
  const uint64_t start = proc_start_time(pid, &state);
  int dead = state == 'Z' || state == 'X' || (start && atomic_load(&r->start_time) && start != atomic_load(&r->start_time));
  if (state == '?' && kill(pid, 0) != 0 && errno == ESRCH) dead = 1;
  if (!dead) return NULL;
  snprintf(why, len, "fake NCCL: rank %d (pid %d) died", j, pid);
  return why;
}

/* Reports (once per rank) each peer in `waiting` that is gone: the waits go
 * on, as real kernels spin, but ncclCommGetAsyncError says ncclRemoteError. */
static void report_gone_peers(core_t *c, const uint8_t *waiting) {
  char why[160];
  for (int j = 0; j < c->nranks; j++) {
    if (!waiting[j] || j == c->rank || atomic_load(&c->reported[j])) continue;
    if (peer_gone(c, j, why, sizeof why) && !atomic_exchange(&c->reported[j], 1))
      set_async(c, ncclRemoteError, "%s", why);
  }
}

static void report_gone_peer(core_t *c, int j) {
  uint8_t *waiting = calloc((size_t)c->nranks, 1);
  if (!waiting) return;
  waiting[j] = 1;
  report_gone_peers(c, waiting);
  free(waiting);
}

/* ---- joining ------------------------------------------------------------ */

/* Leaves the segment for good: peers stop waiting on this rank, and the
 * name goes (whoever unlinks first; an unmapped rank unlinks by name, so
 * the creator of a segment nobody else joined cleans it too). */
static void shm_leave(core_t *c, uint32_t how) {
  if (atomic_load(&c->mapped)) {
    if (atomic_load(&c->claimed)) atomic_store(&sh_rank(c, c->rank)->gone, how);
    if (!atomic_exchange(&sh_hdr(c)->unlinked, 1)) shm_unlink(c->shm_name);
  } else if (atomic_load(&c->named)) {
    shm_unlink(c->shm_name);
  }
}

/* Opens (creating it if first), sizes, maps the segment and registers this rank. */
static ncclResult_t join_open(core_t *c) {
  const size_t size = c->lay.total;
  int fd = shm_open(c->shm_name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 && errno == EEXIST) fd = shm_open(c->shm_name, O_RDWR | O_CREAT, 0600);
  if (fd < 0) return fail(ncclSystemError, "fake NCCL: shm_open(%s): %s", c->shm_name, strerror(errno));
  struct stat st;
  /* Every rank grows it to the size it computed; never shrinks it (a peer
   * with a bigger nranks would fault), the header check below catches that. */
  if (fstat(fd, &st) != 0 || ((size_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0)) {
    const int e = errno;
    close(fd);
    shm_unlink(c->shm_name);
    return fail(ncclSystemError, "fake NCCL: sizing %s to %zu bytes: %s", c->shm_name, size, strerror(e));
  }
  void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (map == MAP_FAILED) return fail(ncclSystemError, "fake NCCL: mmap of %s: %s", c->shm_name, strerror(e));
  c->map = map;
  atomic_store(&c->mapped, 1);
  if (atomic_load(&c->aborted)) { /* an abort that ran before the map could not unlink it */
    shm_leave(c, GONE_ABORTED);
    return fail(ncclSystemError, "fake NCCL: the communicator was aborted during its initialization");
  }
  sh_hdr_t *h = sh_hdr(c);
  uint32_t n0 = 0;
  uint64_t s0 = 0, m0 = 0;
  if (!atomic_compare_exchange_strong(&h->nranks, &n0, (uint32_t)c->nranks) && n0 != (uint32_t)c->nranks)
    return fail(ncclInvalidUsage, "fake NCCL: rank %d was given nranks %d but a peer of the same unique id %u",
                c->rank, c->nranks, n0);
  if ((!atomic_compare_exchange_strong(&h->slot_bytes, &s0, c->slot_bytes) && s0 != c->slot_bytes) ||
      (!atomic_compare_exchange_strong(&h->mbox_bytes, &m0, c->mbox_bytes) && m0 != c->mbox_bytes))
    return fail(ncclInvalidUsage, "fake NCCL: the ranks disagree on FAKE_NCCL_SLOT_BYTES or FAKE_NCCL_MBOX_BYTES");
  sh_rank_t *me = sh_rank(c, c->rank);
  uint32_t j0 = 0;
  if (!atomic_compare_exchange_strong(&me->joined, &j0, 1))
    return fail(ncclInvalidUsage, "fake NCCL: rank %d of this unique id joined twice", c->rank);
  atomic_store(&c->claimed, 1);
  char state;
  atomic_store(&me->pid, (int32_t)getpid());
  atomic_store(&me->start_time, proc_start_time(getpid(), &state));
  atomic_fetch_add(&h->registered, 1);
  return ncclSuccess;
}

/* Waits until every rank registered (forever if one never does, as NCCL),
 * unless aborted or a rank that registered is gone (NCCL's bootstrap fails
 * when a peer's connection closes); then the name goes. */
static ncclResult_t join_wait(core_t *c) {
  sh_hdr_t *h = sh_hdr(c);
  const backoff_t b = backoff_start();
  int64_t last_check = now_ns();
  while (atomic_load(&h->registered) < (uint32_t)c->nranks) {
    if (atomic_load(&c->aborted))
      return fail(ncclSystemError, "fake NCCL: aborted while waiting for all ranks to join (%u of %d did)",
                  atomic_load(&h->registered), c->nranks);
    if (now_ns() - last_check >= LIVENESS_NS) {
      last_check = now_ns();
      char why[160];
      for (int j = 0; j < c->nranks; j++)
        if (j != c->rank && atomic_load(&sh_rank(c, j)->joined) && peer_gone(c, j, why, sizeof why))
          return fail(ncclRemoteError, "%s during the initialization", why);
    }
    backoff_nap(&b);
  }
  if (!atomic_exchange(&h->unlinked, 1)) shm_unlink(c->shm_name);
  atomic_store(&c->joined, 1);
  return ncclSuccess;
}

static ncclResult_t join(core_t *c, int delay_ms) {
  if (delay_ms) sleep_ns((int64_t)delay_ms * 1000000);
  if (atomic_load(&c->aborted)) return fail(ncclSystemError, "fake NCCL: the communicator was aborted");
  ncclResult_t r = join_open(c);
  if (r == ncclSuccess) r = join_wait(c);
  if (r != ncclSuccess) shm_leave(c, GONE_ABORTED); /* a failed init leaves nothing in /dev/shm */
  return r;
}

static ncclResult_t wait_aborted(core_t *c, const char *call) {
  const backoff_t b = backoff_start();
  while (!c || !atomic_load(&c->aborted)) backoff_nap(&b);
  return fail(ncclSystemError, "fake NCCL: %s was blocked by an injected fault (FAKE_NCCL_BLOCK) until the "
              "communicator was aborted", call);
}

/* Faults of calls without device work. */
static ncclResult_t host_fault(fake_nccl_fault_t f, core_t *c, const char *call) {
  switch (f) {
    case FAKE_NCCL_FAIL:
      return fail(ncclSystemError, "fake NCCL: injected failure of %s (FAKE_NCCL_FAIL)", call);
    case FAKE_NCCL_BLOCK:
      return wait_aborted(c, call);
    case FAKE_NCCL_INPROGRESS:
      sleep_ns((int64_t)inprogress_ms() * 1000000);
      return ncclSuccess;
    case FAKE_NCCL_ASYNC_ERROR:
      if (c) set_async(c, ncclRemoteError, "fake NCCL: injected asynchronous error (FAKE_NCCL_ASYNC_ERROR) in %s", call);
      return ncclSuccess;
    default:
      return ncclSuccess;
  }
}

/* ==== device work ========================================================= */

typedef enum { K_ALLREDUCE, K_BROADCAST, K_REDUCE, K_ALLGATHER, K_REDUCESCATTER, K_SEND, K_RECV } kind_t;

static const char *const kind_names[] = {"ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                                         "ncclReduceScatter", "ncclSend", "ncclRecv"};

static int is_p2p(kind_t k) { return k == K_SEND || k == K_RECV; }
static int is_reduction(kind_t k) { return k == K_ALLREDUCE || k == K_REDUCE || k == K_REDUCESCATTER; }

typedef struct op {
  struct op *next;
  core_t *core; /* a reference while recorded */
  kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ncclDataType_t type;
  redop_t red;
  int root, peer;
  cudaStream_t stream;
  int inprogress, hang, async_error; /* injected faults */
  /* Execution state, reset before each execution. */
  int phase, done;
  uint64_t gen0, chunks, chunk, msg;
  size_t moved, total;
} op_t;

typedef struct task {
  core_t *core;
  int nops;
  op_t *ops;
  int hang, async_error;
  atomic_int eager; /* counted in core->pending until its run ends */
  uint64_t ticket;
  int started;
  int64_t last_check;
  uint8_t *waiting; /* per rank: a wait of this step depends on it */
  char name[32];
} task_t;

/* Elements of one block per chunk (a reduce-scatter chunk holds n blocks). */
static size_t chunk_elems(const core_t *c, const op_t *o) {
  const size_t es = type_size(o->type);
  return o->kind == K_REDUCESCATTER ? c->slot_bytes / (es * (size_t)c->nranks) : c->slot_bytes / es;
}

/* This rank's contribution to chunk [off, off+len) goes into its slot. */
static void publish(const core_t *c, op_t *o, size_t off, size_t len) {
  const size_t es = type_size(o->type), n = (size_t)c->nranks;
  uint8_t *dst = sh_slot(c, c->rank);
  const uint8_t *src = o->send;
  size_t elems = len;
  switch (o->kind) {
    case K_BROADCAST:
      if (c->rank == o->root) memcpy(dst, src + off * es, len * es);
      return;
    case K_REDUCESCATTER:
      for (size_t b = 0; b < n; b++) memcpy(dst + b * len * es, src + (b * o->count + off) * es, len * es);
      elems = n * len;
      break;
    default:
      memcpy(dst, src + off * es, len * es);
      break;
  }
  if (is_reduction(o->kind) && o->red.kind == RED_PREMUL) scale(o->type, dst, elems, o->red.scalar);
}

/* dst = the reduction, in rank order, of block `boff` of every slot. */
static void reduce_slots(const core_t *c, const op_t *o, uint8_t *dst, size_t boff, size_t len) {
  const size_t es = type_size(o->type);
  memcpy(dst, sh_slot(c, 0) + boff, len * es);
  for (int j = 1; j < c->nranks; j++) fold(o->type, o->red.kind, dst, sh_slot(c, j) + boff, len);
  if (o->red.kind == RED_AVG) divide(o->type, dst, len, c->nranks);
}

static void consume(const core_t *c, op_t *o, size_t off, size_t len) {
  const size_t es = type_size(o->type);
  uint8_t *recv = o->recv;
  switch (o->kind) {
    case K_ALLREDUCE: reduce_slots(c, o, recv + off * es, 0, len); break;
    case K_REDUCE:
      if (c->rank == o->root) reduce_slots(c, o, recv + off * es, 0, len);
      break;
    case K_REDUCESCATTER: reduce_slots(c, o, recv + off * es, (size_t)c->rank * len * es, len); break;
    case K_BROADCAST: memcpy(recv + off * es, sh_slot(c, o->root), len * es); break;
    case K_ALLGATHER:
      for (int j = 0; j < c->nranks; j++) memcpy(recv + ((size_t)j * o->count + off) * es, sh_slot(c, j), len * es);
      break;
    default: break;
  }
}

static coll_meta_t meta_of(const op_t *o) {
  const int rooted = o->kind == K_BROADCAST || o->kind == K_REDUCE;
  return (coll_meta_t){(uint32_t)o->kind, (uint32_t)o->type, is_reduction(o->kind) ? (uint32_t)o->red.user : 0,
                       rooted ? (uint32_t)o->root : 0, o->count};
}

/* Every rank must run the same collective; NCCL would hang or corrupt data,
 * the fake says which rank disagrees and how. */
static int metas_agree(core_t *c, const op_t *o) {
  const coll_meta_t mine = meta_of(o);
  for (int j = 0; j < c->nranks; j++) {
    const coll_meta_t *m = &sh_rank(c, j)->meta;
    if (m->kind == mine.kind && m->type == mine.type && m->red == mine.red && m->root == mine.root &&
        m->count == mine.count)
      continue;
    set_async(c, ncclInvalidUsage,
              "fake NCCL: collective mismatch: rank %d runs %s(count %llu, %s, op %u, root %u) but rank %d runs "
              "%s(count %llu, %s, op %u, root %u)",
              c->rank, kind_names[mine.kind], (unsigned long long)mine.count, type_name((ncclDataType_t)mine.type),
              mine.red, mine.root, j, m->kind <= K_RECV ? kind_names[m->kind] : "?", (unsigned long long)m->count,
              type_name((ncclDataType_t)m->type), m->red, m->root);
    return 0;
  }
  return 1;
}

/* 1: done, 0: waiting for a peer, -1: the ranks disagree. */
static int coll_progress(task_t *t, op_t *o) {
  core_t *c = t->core;
  const int n = c->nranks, me = c->rank;
  const size_t per = chunk_elems(c, o);
  sh_rank_t *mine = sh_rank(c, me);
  while (o->chunk < o->chunks) {
    const uint64_t g = o->gen0 + o->chunk;
    const size_t off = (size_t)o->chunk * per, len = o->count - off < per ? o->count - off : per;
    if (o->phase == 0) {
      /* My slot is free once every rank that still takes part read chunk g-1. */
      for (int j = 0; j < n; j++) {
        if (j == me) continue;
        sh_rank_t *r = sh_rank(c, j);
        if (atomic_load_explicit(&r->ack_gen, memory_order_acquire) + 1 < g && !atomic_load(&r->gone)) {
          t->waiting[j] = 1;
          return 0;
        }
      }
      publish(c, o, off, len);
      mine->meta = meta_of(o);
      atomic_store_explicit(&mine->pub_gen, g, memory_order_release);
      o->phase = 1;
    }
    for (int j = 0; j < n; j++) {
      if (j != me && atomic_load_explicit(&sh_rank(c, j)->pub_gen, memory_order_acquire) < g) {
        t->waiting[j] = 1;
        return 0;
      }
    }
    if (o->chunk == 0 && !metas_agree(c, o)) return -1;
    consume(c, o, off, len);
    atomic_store_explicit(&mine->ack_gen, g, memory_order_release);
    o->chunk++;
    o->phase = 0;
  }
  return 1;
}

/* A send: wait until the receive is posted (and the pair's previous message
 * drained), announce the size, stream the bytes, wait until drained. */
static int send_progress(task_t *t, op_t *o) {
  core_t *c = t->core;
  sh_pair_t *p = sh_pair(c, c->rank, o->peer);
  const uint64_t ring = c->mbox_bytes;
  if (o->phase == 0) {
    if (atomic_load_explicit(&p->posted, memory_order_acquire) <= o->msg ||
        atomic_load_explicit(&p->done, memory_order_acquire) < o->msg) {
      t->waiting[o->peer] = 1;
      return 0;
    }
    atomic_store_explicit(&p->bytes, o->total, memory_order_relaxed);
    atomic_store_explicit(&p->announced, o->msg + 1, memory_order_release);
    o->phase = 1;
  }
  if (o->phase == 1) {
    uint8_t *mbox = sh_mbox(c, c->rank, o->peer);
    const uint8_t *src = o->send;
    uint64_t head = atomic_load_explicit(&p->head, memory_order_relaxed); /* only we write it */
    while (o->moved < o->total) {
      const uint64_t used = head - atomic_load_explicit(&p->tail, memory_order_acquire);
      if (used == ring) {
        t->waiting[o->peer] = 1;
        return 0;
      }
      const size_t pos = (size_t)(head % ring);
      size_t k = o->total - o->moved;
      if (k > ring - used) k = (size_t)(ring - used);
      if (k > ring - pos) k = (size_t)(ring - pos);
      memcpy(mbox + pos, src + o->moved, k);
      o->moved += k;
      head += k;
      atomic_store_explicit(&p->head, head, memory_order_release);
    }
    o->phase = 2;
  }
  if (atomic_load_explicit(&p->done, memory_order_acquire) <= o->msg) {
    t->waiting[o->peer] = 1;
    return 0;
  }
  return 1;
}

/* A receive: post it, learn the size, drain the ring into the buffer. A
 * size that differs from ours is a usage error; the bytes are drained all
 * the same (the sender must not hang on it). */
static int recv_progress(task_t *t, op_t *o) {
  core_t *c = t->core;
  sh_pair_t *p = sh_pair(c, o->peer, c->rank);
  const uint64_t ring = c->mbox_bytes;
  const size_t want = o->count * type_size(o->type);
  if (o->phase == 0) {
    if (atomic_load_explicit(&p->posted, memory_order_relaxed) != o->msg) return 0; /* an earlier receive first */
    atomic_store_explicit(&p->posted, o->msg + 1, memory_order_release);
    o->phase = 1;
  }
  if (o->phase == 1) {
    if (atomic_load_explicit(&p->announced, memory_order_acquire) <= o->msg) {
      t->waiting[o->peer] = 1;
      return 0;
    }
    o->total = (size_t)atomic_load_explicit(&p->bytes, memory_order_relaxed);
    if (o->total != want)
      set_async(c, ncclInvalidUsage,
                "fake NCCL: rank %d received a message of %zu bytes from rank %d, but its ncclRecv expected %zu "
                "bytes (%zu x %s)",
                c->rank, o->total, o->peer, want, o->count, type_name(o->type));
    o->phase = 2;
  }
  const uint8_t *mbox = sh_mbox(c, o->peer, c->rank);
  uint8_t *dst = o->recv;
  uint64_t tail = atomic_load_explicit(&p->tail, memory_order_relaxed); /* only we write it */
  while (o->moved < o->total) {
    const uint64_t avail = atomic_load_explicit(&p->head, memory_order_acquire) - tail;
    if (avail == 0) {
      t->waiting[o->peer] = 1;
      return 0;
    }
    const size_t pos = (size_t)(tail % ring);
    size_t k = o->total - o->moved;
    if (k > avail) k = (size_t)avail;
    if (k > ring - pos) k = (size_t)(ring - pos);
    if (o->moved < want) memcpy(dst + o->moved, mbox + pos, o->moved + k <= want ? k : want - o->moved);
    o->moved += k;
    tail += k;
    atomic_store_explicit(&p->tail, tail, memory_order_release);
  }
  atomic_store_explicit(&p->done, o->msg + 1, memory_order_release);
  return 1;
}

static int task_end(task_t *t) {
  core_t *c = t->core;
  if (t->started) atomic_store_explicit(&c->turn, t->ticket + 1, memory_order_release);
  if (atomic_exchange(&t->eager, 0)) atomic_fetch_sub(&c->pending, 1);
  return 1;
}

/* Every execution (an eager run, each graph replay) is a fresh instance. */
static void task_reset(void *arg) {
  task_t *t = arg;
  t->ticket = atomic_fetch_add(&t->core->next_ticket, 1);
  t->started = 0;
  t->last_check = now_ns();
  for (int i = 0; i < t->nops; i++) {
    op_t *o = &t->ops[i];
    o->phase = o->done = 0;
    o->chunk = 0;
    o->moved = 0;
    o->total = o->kind == K_SEND ? o->count * type_size(o->type) : 0;
  }
}

/* Once the task's turn comes: numbers its collective chunks and messages. */
static void task_begin(task_t *t) {
  core_t *c = t->core;
  for (int i = 0; i < t->nops; i++) {
    op_t *o = &t->ops[i];
    if (o->kind == K_SEND) o->msg = c->sent[o->peer]++;
    else if (o->kind == K_RECV) o->msg = c->recvd[o->peer]++;
    else {
      const size_t per = chunk_elems(c, o);
      o->chunks = (o->count + per - 1) / per;
      o->gen0 = c->coll_gen + 1;
      c->coll_gen += o->chunks;
      if (o->red.device) memcpy(o->red.scalar, o->red.dev_scalar, type_size(o->type)); /* read when it runs */
    }
  }
}

/* Never blocks: moves what it can, returns 0 while a peer is behind. */
static int task_step(void *arg) {
  task_t *t = arg;
  core_t *c = t->core;
  if (atomic_load(&c->aborted) || atomic_load(&c->closed)) return task_end(t);
  if (!t->started) {
    if (atomic_load_explicit(&c->turn, memory_order_acquire) != t->ticket) return 0;
    t->started = 1;
    if (t->async_error) {
      set_async(c, ncclRemoteError, "fake NCCL: injected asynchronous error (FAKE_NCCL_ASYNC_ERROR) in %s", t->name);
      atomic_store(&c->broken, 1);
    }
    if (atomic_load(&c->broken)) return task_end(t);
    task_begin(t);
  }
  if (t->hang) return 0; /* FAKE_NCCL_HANG_KERNEL: until the abort */
  memset(t->waiting, 0, (size_t)c->nranks);
  int all_done = 1, coll_waits = 0;
  for (int i = 0; i < t->nops; i++) {
    op_t *o = &t->ops[i];
    if (o->done) continue;
    int r;
    if (is_p2p(o->kind)) {
      r = o->kind == K_SEND ? send_progress(t, o) : recv_progress(t, o);
    } else if (coll_waits) {
      r = 0; /* the collectives of a group run in order */
    } else {
      r = coll_progress(t, o);
      coll_waits = r == 0;
    }
    if (r < 0) {
      atomic_store(&c->broken, 1);
      return task_end(t);
    }
    if (r) o->done = 1;
    else all_done = 0;
  }
  if (all_done) return task_end(t);
  const int64_t now = now_ns();
  if (now - t->last_check >= LIVENESS_NS) {
    t->last_check = now;
    report_gone_peers(c, t->waiting);
  }
  return 0;
}

static void task_free(task_t *t) {
  core_unref(t->core);
  free(t->ops);
  free(t->waiting);
  free(t);
}

static void task_release(void *arg) {
  task_t *t = arg;
  if (atomic_exchange(&t->eager, 0)) atomic_fetch_sub(&t->core->pending, 1); /* never ran */
  task_free(t);
}

/* ==== groups ============================================================== */

/* The ops of one communicator in a group: one task. */
typedef struct batch {
  struct batch *next;
  core_t *core; /* a reference */
  op_t *head, *tail;
  int nops;
  cudaStream_t stream;
  int inprogress, hang, async_error;
  int *peers; /* p2p peers not connected yet: handshakes at launch */
  int npeers;
} batch_t;

/* A ncclCommInit* made inside a group: joined at the group's end. */
typedef struct deferred {
  struct deferred *next;
  core_t *core; /* a reference; busy counted */
  int delay_ms;
} deferred_t;

static _Thread_local int tl_depth;
static _Thread_local op_t *tl_head, *tl_tail;
static _Thread_local ncclResult_t tl_group_err;
static _Thread_local deferred_t *tl_inits;

static ncclResult_t group_error(ncclResult_t r) {
  if (tl_depth > 0 && tl_group_err == ncclSuccess) tl_group_err = r;
  return r;
}

static void op_free(op_t *o) {
  core_unref(o->core);
  free(o);
}

static void batch_free(batch_t *b) {
  while (b->head) {
    op_t *o = b->head;
    b->head = o->next;
    op_free(o);
  }
  core_unref(b->core);
  free(b->peers);
  free(b);
}

/* Builds the task of a batch and enqueues it on the batch's stream. */
static ncclResult_t enqueue_batch(batch_t *b) {
  core_t *c = b->core;
  task_t *t = calloc(1, sizeof *t);
  if (t) t->ops = calloc((size_t)b->nops, sizeof *t->ops);
  if (t) t->waiting = calloc((size_t)c->nranks, 1);
  if (!t || !t->ops || !t->waiting) {
    if (t) free(t->ops);
    if (t) free(t->waiting);
    free(t);
    return fail(ncclSystemError, "fake NCCL: out of memory");
  }
  int i = 0;
  for (const op_t *o = b->head; o; o = o->next) {
    t->ops[i] = *o;
    t->ops[i].next = NULL;
    t->ops[i].core = NULL; /* the task holds one reference for all */
    i++;
  }
  t->nops = b->nops;
  t->hang = b->hang;
  t->async_error = b->async_error;
  t->core = c;
  core_ref(c);
  snprintf(t->name, sizeof t->name, "%s", b->nops == 1 ? kind_names[b->head->kind] : "ncclGroup");
  /* Work recorded into a graph capture is not work the destroy waits for. */
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(b->stream, &cs) != cudaSuccess) cs = cudaStreamCaptureStatusNone;
  if (cs == cudaStreamCaptureStatusNone) {
    atomic_store(&t->eager, 1);
    atomic_fetch_add(&c->pending, 1);
  }
  const fake_task_t ft = {task_step, task_reset, task_release, t, t->name};
  const cudaError_t e = fake_cuda_enqueue(b->stream, &ft);
  if (e != cudaSuccess) {
    if (atomic_exchange(&t->eager, 0)) atomic_fetch_sub(&c->pending, 1);
    task_free(t);
    return fail(ncclUnhandledCudaError, "fake NCCL: enqueueing %s's kernel failed: %s", kind_names[b->head->kind],
                cudaGetErrorString(e));
  }
  return ncclSuccess;
}

/* The first p2p call towards a peer, at its group's end: this rank says it
 * is there, then (handshake_wait) waits until the peer said so too. */
static void handshake_mark(batch_t *b) {
  core_t *c = b->core;
  for (int i = 0; i < b->npeers; i++) atomic_store_explicit(sh_conn(c, c->rank, b->peers[i]), 1, memory_order_release);
}

static ncclResult_t handshake_wait(batch_t *b) {
  core_t *c = b->core;
  const backoff_t bo = backoff_start();
  int64_t last_check = now_ns();
  for (int i = 0; i < b->npeers; i++) {
    const int p = b->peers[i];
    while (!atomic_load_explicit(sh_conn(c, p, c->rank), memory_order_acquire)) {
      if (atomic_load(&c->aborted) || atomic_load(&c->closed))
        return fail(ncclSystemError, "fake NCCL: the communicator was aborted while rank %d waited for the "
                    "connection to rank %d", c->rank, p);
      if (now_ns() - last_check >= LIVENESS_NS) {
        last_check = now_ns();
        report_gone_peer(c, p);
      }
      backoff_nap(&bo);
    }
    atomic_store(&c->connected[p], 1);
  }
  return ncclSuccess;
}

/* ---- background jobs (nonblocking communicators) --------------------------- */

typedef enum { JOB_INIT, JOB_SPLIT, JOB_LAUNCH, JOB_FINALIZE, JOB_BLOCK } job_kind_t;

typedef struct job {
  job_kind_t kind;
  core_t *core;   /* kept busy until the job ends; NULL: a split this rank leaves */
  core_t *parent; /* JOB_SPLIT: kept busy until the exchange is over */
  int delay_ms;
  batch_t *batch;
  uint32_t split_index;
  int color, key;
  const char *call;
} job_t;

static ncclResult_t split_exchange(core_t *p, uint32_t k, int color, int key, int *out_rank, int *out_n);
static void split_key_of(const core_t *p, uint32_t k, int color, uint8_t out[16]);

static void job_done(job_t *j, ncclResult_t r) {
  if (r != ncclSuccess && r != ncclInProgress && j->core) set_async(j->core, r, "%s", tl_msg);
  if (j->core) {
    atomic_fetch_sub(&j->core->busy, 1);
    core_unref(j->core);
  }
  if (j->parent) {
    atomic_fetch_sub(&j->parent->busy, 1);
    core_unref(j->parent);
  }
  if (j->batch) batch_free(j->batch);
  free(j);
}

static void *job_main(void *arg) {
  job_t *j = arg;
  ncclResult_t r = ncclSuccess;
  core_t *c = j->core;
  if (c) cudaSetDevice(c->device);
  switch (j->kind) {
    case JOB_INIT:
      r = join(c, j->delay_ms);
      break;
    case JOB_SPLIT: {
      int rank = -1, n = 0;
      r = split_exchange(j->parent, j->split_index, j->color, j->key, &rank, &n);
      uint8_t key[16];
      if (r == ncclSuccess && c) {
        split_key_of(j->parent, j->split_index, j->color, key);
        r = core_setup(c, n, rank, key);
      }
      atomic_fetch_sub(&j->parent->busy, 1); /* the parent is usable again */
      core_unref(j->parent);
      j->parent = NULL;
      if (r == ncclSuccess && c) r = join(c, j->delay_ms);
      break;
    }
    case JOB_LAUNCH:
      if (j->delay_ms) sleep_ns((int64_t)j->delay_ms * 1000000);
      handshake_mark(j->batch);
      r = handshake_wait(j->batch);
      if (r == ncclSuccess && !atomic_load(&c->aborted)) r = enqueue_batch(j->batch);
      break;
    case JOB_FINALIZE: {
      const backoff_t b = backoff_start();
      while (atomic_load(&c->pending) > 0 && !atomic_load(&c->aborted)) backoff_nap(&b);
      break;
    }
    case JOB_BLOCK:
      r = wait_aborted(c, j->call);
      break;
  }
  if (c && atomic_load(&c->aborted)) r = ncclSuccess; /* nobody listens any more */
  job_done(j, r);
  return NULL;
}

/* Starts a job: its communicators count as busy until it ends. On failure
 * the job is freed (and its batch). */
static ncclResult_t start_job(job_t *j) {
  if (j->core) {
    atomic_fetch_add(&j->core->busy, 1);
    core_ref(j->core);
  }
  if (j->parent) {
    atomic_fetch_add(&j->parent->busy, 1);
    core_ref(j->parent);
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t th;
  const int rc = pthread_create(&th, &attr, job_main, j);
  pthread_attr_destroy(&attr);
  if (rc == 0) return ncclSuccess;
  ncclResult_t r = fail(ncclSystemError, "fake NCCL: cannot start a background thread: %s", strerror(rc));
  job_done(j, ncclSuccess); /* undoes the counts, frees the batch */
  return r;
}

static job_t *job_new(job_kind_t kind, core_t *c) {
  job_t *j = calloc(1, sizeof *j);
  if (j) {
    j->kind = kind;
    j->core = c;
  }
  return j;
}

/* ---- launching a group ----------------------------------------------------- */

static batch_t *batch_of(batch_t **list, core_t *c) {
  batch_t **pp = list;
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->core == c) return *pp;
  batch_t *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->core = c;
  core_ref(c);
  *pp = b;
  return b;
}

/* The p2p peers of a batch that have not been connected to yet. */
static ncclResult_t batch_peers(batch_t *b) {
  core_t *c = b->core;
  b->peers = calloc((size_t)c->nranks, sizeof *b->peers);
  if (!b->peers) return fail(ncclSystemError, "fake NCCL: out of memory");
  for (const op_t *o = b->head; o; o = o->next) {
    if (!is_p2p(o->kind) || o->peer == c->rank || atomic_load(&c->connected[o->peer])) continue;
    int seen = 0;
    for (int i = 0; i < b->npeers; i++) seen |= b->peers[i] == o->peer;
    if (!seen) b->peers[b->npeers++] = o->peer;
  }
  return ncclSuccess;
}

/* Starts the inits deferred to the end of a group; waits for the blocking ones. */
static ncclResult_t launch_inits(deferred_t *list) {
  ncclResult_t first = ncclSuccess;
  int any_nonblocking = 0;
  for (deferred_t *d = list; d; d = d->next) {
    job_t *j = job_new(JOB_INIT, d->core);
    ncclResult_t r = j ? ncclSuccess : fail(ncclSystemError, "fake NCCL: out of memory");
    if (j) {
      j->delay_ms = d->delay_ms;
      r = start_job(j);
    }
    if (r != ncclSuccess) {
      set_async(d->core, r, "%s", tl_msg);
      if (first == ncclSuccess) first = r;
    }
    atomic_fetch_sub(&d->core->busy, 1); /* the job holds its own count now */
    any_nonblocking |= !d->core->blocking;
  }
  for (deferred_t *d = list; d; d = d->next) {
    if (d->core->blocking) {
      const backoff_t b = backoff_start();
      while (atomic_load(&d->core->busy) > 0 && !atomic_load(&d->core->aborted)) backoff_nap(&b);
      const ncclResult_t e = (ncclResult_t)atomic_load(&d->core->async_err);
      if (e != ncclSuccess && first == ncclSuccess) {
        pthread_mutex_lock(&d->core->mu);
        fail(e, "%s", d->core->async_msg);
        pthread_mutex_unlock(&d->core->mu);
        first = e;
      }
    }
  }
  while (list) {
    deferred_t *d = list;
    list = d->next;
    core_unref(d->core);
    free(d);
  }
  return first != ncclSuccess ? first : any_nonblocking ? ncclInProgress : ncclSuccess;
}

/* The outermost group ended (or a call outside any group): one task per
 * communicator. Blocking communicators connect new peers here, waiting on
 * the host; nonblocking ones do it in a job and answer ncclInProgress. */
static ncclResult_t launch(op_t *ops, fake_nccl_fault_t f) {
  batch_t *batches = NULL;
  ncclResult_t first = ncclSuccess;
  while (ops) {
    op_t *o = ops;
    ops = o->next;
    o->next = NULL;
    batch_t *b = first == ncclSuccess ? batch_of(&batches, o->core) : NULL;
    if (!b) {
      if (first == ncclSuccess) first = fail(ncclSystemError, "fake NCCL: out of memory");
      op_free(o);
      continue;
    }
    if (b->tail) b->tail->next = o;
    else b->head = o;
    b->tail = o;
    b->nops++;
    b->stream = o->stream;
    b->inprogress |= o->inprogress || f == FAKE_NCCL_INPROGRESS;
    b->hang |= o->hang || f == FAKE_NCCL_HANG_KERNEL;
    b->async_error |= o->async_error || f == FAKE_NCCL_ASYNC_ERROR;
  }
  if (first == ncclSuccess) {
    for (batch_t *b = batches; b; b = b->next) {
      ncclResult_t r = batch_peers(b);
      if (r != ncclSuccess && first == ncclSuccess) first = r;
    }
  }
  if (first != ncclSuccess) {
    while (batches) {
      batch_t *b = batches;
      batches = b->next;
      batch_free(b);
    }
    return first;
  }
  /* Nonblocking batches with something to wait for go to a job; the
   * blocking ones announce themselves to all their peers before waiting
   * on any, so one thread driving several ranks cannot deadlock. */
  int in_progress = 0;
  batch_t **pp = &batches;
  while (*pp) {
    batch_t *b = *pp;
    core_t *c = b->core;
    if (atomic_load(&c->aborted) || atomic_load(&c->closed)) {
      *pp = b->next;
      if (first == ncclSuccess)
        first = fail(ncclInvalidUsage, "fake NCCL: ncclGroupEnd: a communicator of the group was aborted or "
                     "destroyed before the group ended");
      batch_free(b);
      continue;
    }
    if (!c->blocking && (b->npeers || b->inprogress)) {
      *pp = b->next;
      job_t *j = job_new(JOB_LAUNCH, c);
      ncclResult_t r = j ? ncclSuccess : fail(ncclSystemError, "fake NCCL: out of memory");
      if (j) {
        j->batch = b;
        j->delay_ms = b->inprogress ? inprogress_ms() : 0;
        r = start_job(j);
      } else {
        batch_free(b);
      }
      if (r != ncclSuccess && first == ncclSuccess) first = r;
      in_progress |= r == ncclSuccess;
      continue;
    }
    if (b->npeers) handshake_mark(b);
    pp = &b->next;
  }
  while (batches) {
    batch_t *b = batches;
    batches = b->next;
    ncclResult_t r = handshake_wait(b);
    if (r == ncclSuccess && b->inprogress) sleep_ns((int64_t)inprogress_ms() * 1000000);
    if (r == ncclSuccess) r = enqueue_batch(b);
    if (r != ncclSuccess && first == ncclSuccess) first = r;
    batch_free(b);
  }
  return first != ncclSuccess ? first : in_progress ? ncclInProgress : ncclSuccess;
}

/* ---- recording calls ------------------------------------------------------- */

typedef struct call_args {
  kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root, peer;
  cudaStream_t stream;
} call_args_t;

static ncclResult_t resolve_redop(core_t *c, ncclRedOp_t op, ncclDataType_t t, redop_t *out, const char *call) {
  memset(out, 0, sizeof *out);
  if ((int)op < 0 || (int)op >= (int)ncclMaxRedOp) return fail(ncclInvalidArgument, "fake NCCL: %s: invalid reduction op %d", call, (int)op);
  if ((int)op < (int)ncclNumOps) {
    out->user = (int)op;
    out->kind = (int)op; /* ncclSum..ncclAvg are RED_SUM..RED_AVG */
    if (op == ncclAvg && is_float(t)) {
      out->kind = RED_PREMUL;
      reciprocal(t, c->nranks, out->scalar);
    }
    return ncclSuccess;
  }
  const int idx = (int)op - (int)ncclNumOps;
  pthread_mutex_lock(&c->mu);
  const premul_t pm = idx < MAX_PREMUL ? c->premul[idx] : (premul_t){0};
  pthread_mutex_unlock(&c->mu);
  if (!pm.used)
    return fail(ncclInvalidArgument, "fake NCCL: %s: reduction op %d was not created on this communicator (or was "
                "destroyed)", call, (int)op);
  if (pm.type != t)
    return fail(ncclInvalidArgument, "fake NCCL: %s: the PreMulSum op was created for %s, the call is on %s", call,
                type_name(pm.type), type_name(t));
  out->user = (int)ncclNumOps;
  out->kind = RED_PREMUL;
  out->device = pm.device;
  memcpy(out->scalar, pm.value, sizeof out->scalar);
  out->dev_scalar = pm.ptr;
  return ncclSuccess;
}

static ncclResult_t validate(core_t *c, const call_args_t *a, redop_t *red, const char *call) {
  const size_t es = type_size(a->type);
  const int n = c->nranks;
  if (!es) return fail(ncclInvalidArgument, "fake NCCL: %s: invalid datatype %d", call, (int)a->type);
  if (is_reduction(a->kind)) {
    if (a->type == ncclFloat8e4m3 || a->type == ncclFloat8e5m2)
      return fail(ncclInvalidArgument, "fake NCCL: %s: fp8 reductions are not supported by the fake", call);
    ncclResult_t r = resolve_redop(c, a->op, a->type, red, call);
    if (r != ncclSuccess) return r;
  }
  if ((a->kind == K_BROADCAST || a->kind == K_REDUCE) && (a->root < 0 || a->root >= n))
    return fail(ncclInvalidArgument, "fake NCCL: %s: root %d is not a rank of this communicator of %d", call, a->root, n);
  if (is_p2p(a->kind) && (a->peer < 0 || a->peer >= n))
    return fail(ncclInvalidArgument, "fake NCCL: %s: peer %d is not a rank of this communicator of %d", call, a->peer, n);
  if (a->count == 0) return ncclSuccess;
  if (a->count > SIZE_MAX / es / (size_t)n)
    return fail(ncclInvalidArgument, "fake NCCL: %s: count %zu is too large", call, a->count);
  const int me = c->rank;
  const int need_send = a->kind == K_BROADCAST ? me == a->root : a->kind != K_RECV;
  const int need_recv = a->kind == K_REDUCE ? me == a->root : a->kind != K_SEND;
  if (need_send && !a->send) return fail(ncclInvalidArgument, "fake NCCL: %s: sendbuff is NULL", call);
  if (need_recv && !a->recv) return fail(ncclInvalidArgument, "fake NCCL: %s: recvbuff is NULL", call);
  return ncclSuccess;
}

/* Validates the ops of one call and appends them to the thread's group
 * (all or none). *inprogress: a nonblocking FAKE_NCCL_INPROGRESS fault. */
static ncclResult_t record(struct ncclComm *h, fake_nccl_fault_t f, const call_args_t *args, int nargs,
                           const char *call, int *inprogress_out) {
  core_t *c = NULL;
  ncclResult_t r = comm_enter(h, call, &c);
  if (r != ncclSuccess) return r;
  r = check_ready(c, call);
  redop_t *reds = r == ncclSuccess ? calloc((size_t)(nargs ? nargs : 1), sizeof *reds) : NULL;
  if (r == ncclSuccess && !reds) r = fail(ncclSystemError, "fake NCCL: out of memory");
  for (int i = 0; i < nargs && r == ncclSuccess; i++) r = validate(c, &args[i], &reds[i], call);
  int inprogress = 0;
  if (r == ncclSuccess) {
    switch (f) {
      case FAKE_NCCL_FAIL: r = fail(ncclSystemError, "fake NCCL: injected failure of %s (FAKE_NCCL_FAIL)", call); break;
      case FAKE_NCCL_BLOCK: r = wait_aborted(c, call); break;
      case FAKE_NCCL_INPROGRESS:
        if (c->blocking) sleep_ns((int64_t)inprogress_ms() * 1000000);
        else inprogress = 1;
        break;
      default: break;
    }
  }
  /* NCCL takes one stream per communicator and group. */
  for (const op_t *o = tl_head; o && r == ncclSuccess; o = o->next)
    for (int i = 0; i < nargs && r == ncclSuccess; i++)
      if (o->core == c && o->stream != args[i].stream)
        r = fail(ncclInvalidUsage, "fake NCCL: %s: the calls of one communicator in a group must use one stream "
                 "(%p here, %p for an earlier %s)", call, (void *)args[i].stream, (void *)o->stream, kind_names[o->kind]);
  op_t *head = NULL, **tail = &head;
  for (int i = 0; i < nargs && r == ncclSuccess; i++) {
    if (args[i].count == 0) continue; /* legal, and nothing to do */
    op_t *o = calloc(1, sizeof *o);
    if (!o) {
      r = fail(ncclSystemError, "fake NCCL: out of memory");
      break;
    }
    o->core = c;
    core_ref(c);
    o->kind = args[i].kind;
    o->send = args[i].send;
    o->recv = args[i].recv;
    o->count = args[i].count;
    o->type = args[i].type;
    o->red = reds[i];
    o->root = args[i].root;
    o->peer = args[i].peer;
    o->stream = args[i].stream;
    o->inprogress = inprogress;
    o->hang = f == FAKE_NCCL_HANG_KERNEL;
    o->async_error = f == FAKE_NCCL_ASYNC_ERROR;
    *tail = o;
    tail = &o->next;
  }
  free(reds);
  comm_leave(h);
  if (r != ncclSuccess) {
    while (head) {
      op_t *o = head;
      head = o->next;
      op_free(o);
    }
    return r;
  }
  for (op_t *o = head; o; o = o->next) {
    if (tl_tail) tl_tail->next = o;
    else tl_head = o;
    tl_tail = o;
  }
  *inprogress_out = inprogress;
  return ncclSuccess;
}

/* Records one call; outside a group, launches it at once (an implicit group). */
static ncclResult_t submit(struct ncclComm *h, fake_nccl_fault_t f, const call_args_t *args, int nargs,
                           const char *call) {
  int inprogress = 0;
  ncclResult_t r = record(h, f, args, nargs, call, &inprogress);
  if (r != ncclSuccess) return group_error(r);
  if (tl_depth > 0) return inprogress ? ncclInProgress : ncclSuccess;
  op_t *ops = tl_head;
  tl_head = tl_tail = NULL;
  r = launch(ops, FAKE_NCCL_NONE);
  return r == ncclSuccess && inprogress ? ncclInProgress : r;
}

/* ==== split ================================================================ */

static void split_key_of(const core_t *p, uint32_t k, int color, uint8_t out[16]) {
  uint64_t a, b;
  memcpy(&a, p->key, 8);
  memcpy(&b, p->key + 8, 8);
  const uint64_t x = mix64(a ^ mix64(b ^ (((uint64_t)k << 32) | (uint32_t)color)));
  const uint64_t y = mix64(b ^ mix64(x + 0x5bd1e995ULL));
  memcpy(out, &x, 8);
  memcpy(out + 8, &y, 8);
}

/* Split number k over the parent: every rank publishes (color, key) and
 * learns everybody's; the child rank orders equal colors by (key, parent rank). */
static ncclResult_t split_exchange(core_t *p, uint32_t k, int color, int key, int *out_rank, int *out_n) {
  const int n = p->nranks, me = p->rank;
  sh_rank_t *mine = sh_rank(p, me);
  const backoff_t b = backoff_start();
  int64_t last_check = now_ns();
  /* Overwrite the previous split's values only once every rank read them. */
  for (int j = 0; j < n; j++) {
    sh_rank_t *r = sh_rank(p, j);
    while (atomic_load_explicit(&r->split_ack, memory_order_acquire) < k && !atomic_load(&r->gone)) {
      if (atomic_load(&p->aborted)) return fail(ncclSystemError, "fake NCCL: ncclCommSplit: the parent was aborted");
      backoff_nap(&b);
    }
  }
  mine->split_color = color;
  mine->split_key = key;
  atomic_store_explicit(&mine->split_seq, (uint64_t)k + 1, memory_order_release);
  for (int j = 0; j < n; j++) {
    while (atomic_load_explicit(&sh_rank(p, j)->split_seq, memory_order_acquire) < (uint64_t)k + 1) {
      if (atomic_load(&p->aborted))
        return fail(ncclSystemError, "fake NCCL: ncclCommSplit: the parent was aborted while rank %d waited for "
                    "rank %d", me, j);
      if (now_ns() - last_check >= LIVENESS_NS) {
        last_check = now_ns();
        report_gone_peer(p, j);
      }
      backoff_nap(&b);
    }
  }
  int rank = 0, count = 0;
  for (int j = 0; j < n; j++) {
    const sh_rank_t *r = sh_rank(p, j);
    if (r->split_color != color) continue;
    count++;
    if (r->split_key < key || (r->split_key == key && j < me)) rank++;
  }
  atomic_store_explicit(&mine->split_ack, (uint64_t)k + 1, memory_order_release);
  *out_rank = rank;
  *out_n = count;
  return ncclSuccess;
}

/* ==== the API ============================================================== */

ncclResult_t ncclGetVersion(int *version) {
  const fake_nccl_fault_t f = enter_api(API_GetVersion);
  ncclResult_t r = host_fault(f, NULL, "ncclGetVersion");
  if (r != ncclSuccess) return r;
  if (!version) return fail(ncclInvalidArgument, "fake NCCL: ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t result) {
  enter_api(API_GetErrorString);
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0) /* ncclTimeout is new in 2.30 */
    case ncclTimeout: return "NCCL timeout";
#endif
    default: return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t comm) {
  enter_api(API_GetLastError);
  if (comm && comm->magic == HANDLE_MAGIC) {
    core_t *c = comm->core;
    pthread_mutex_lock(&c->mu);
    const int newer = c->async_stamp > tl_msg_stamp;
    if (newer) snprintf(tl_msg_out, sizeof tl_msg_out, "%s", c->async_msg);
    pthread_mutex_unlock(&c->mu);
    if (newer) return tl_msg_out;
  }
  return tl_msg;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  const fake_nccl_fault_t f = enter_api(API_GetUniqueId);
  ncclResult_t r = host_fault(f, NULL, "ncclGetUniqueId");
  if (r != ncclSuccess) return r;
  if (!uniqueId) return fail(ncclInvalidArgument, "fake NCCL: ncclGetUniqueId: uniqueId is NULL");
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, ID_MAGIC, 8);
  uint8_t *key = (uint8_t *)uniqueId->internal + 8;
  size_t got = 0;
  while (got < 16) {
    ssize_t k = getrandom(key + got, 16 - got, 0);
    if (k < 0 && errno != EINTR) return fail(ncclSystemError, "fake NCCL: getrandom: %s", strerror(errno));
    if (k > 0) got += (size_t)k;
  }
  return ncclSuccess;
}

/* NCCL_CONFIG_UNDEF_INT means "not set": then $NCCL_COMM_BLOCKING decides (default blocking). */
static int resolve_blocking(const ncclConfig_t *config, int inherited) {
  if (config && config->blocking != NCCL_CONFIG_UNDEF_INT) return config->blocking != 0;
  if (inherited >= 0) return inherited;
  const char *env = getenv("NCCL_COMM_BLOCKING");
  return !(env && strcmp(env, "0") == 0);
}

/* The value NCCL_CONFIG_INITIALIZER stores; nccl.h names it from 2.29 on. */
#ifndef NCCL_API_MAGIC
#define NCCL_API_MAGIC 0xcafebeef
#endif

static ncclResult_t check_config(const ncclConfig_t *config, const char *call) {
  if (!config) return ncclSuccess;
  if (config->magic != NCCL_API_MAGIC)
    return fail(ncclInvalidArgument, "fake NCCL: %s: the config's magic is 0x%x, not NCCL_API_MAGIC: initialize it "
                "with NCCL_CONFIG_INITIALIZER", call, config->magic);
  if (config->blocking != NCCL_CONFIG_UNDEF_INT && config->blocking != 0 && config->blocking != 1)
    return fail(ncclInvalidArgument, "fake NCCL: %s: config->blocking is %d (0, 1 or unset)", call, config->blocking);
  return ncclSuccess;
}

static ncclResult_t init_rank(enum api api, ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                              ncclConfig_t *config) {
  const char *call = api_names[api];
  const fake_nccl_fault_t f = enter_api(api);
  if (!comm) return fail(ncclInvalidArgument, "fake NCCL: %s: comm is NULL", call);
  *comm = NULL;
  ncclResult_t r = check_config(config, call);
  if (r != ncclSuccess) return r;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, "fake NCCL: %s: rank %d of nranks %d", call, rank, nranks);
  if (memcmp(id.internal, ID_MAGIC, 8) != 0)
    return fail(ncclInvalidArgument, "fake NCCL: %s: the unique id was not made by ncclGetUniqueId", call);
  if (f == FAKE_NCCL_FAIL) return host_fault(f, NULL, call);
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return fail(ncclUnhandledCudaError, "fake NCCL: %s: cudaGetDevice: %s", call, cudaGetErrorString(e));
  const int blocking = resolve_blocking(config, -1);
  core_t *c = core_new(blocking, device);
  if (!c || core_setup(c, nranks, rank, (const uint8_t *)id.internal + 8) != ncclSuccess) {
    core_unref(c);
    return fail(ncclSystemError, "fake NCCL: out of memory");
  }
  struct ncclComm *h = handle_new(c);
  if (!h) {
    core_unref(c);
    return fail(ncclSystemError, "fake NCCL: out of memory");
  }
  if (f == FAKE_NCCL_ASYNC_ERROR) host_fault(f, c, call);
  const int delay = f == FAKE_NCCL_INPROGRESS ? inprogress_ms() : 0;
  if (tl_depth > 0 && f != FAKE_NCCL_BLOCK) { /* joined at the group's end */
    deferred_t *d = calloc(1, sizeof *d);
    if (!d) {
      handle_free(h);
      return fail(ncclSystemError, "fake NCCL: out of memory");
    }
    d->core = c;
    core_ref(c);
    atomic_fetch_add(&c->busy, 1);
    d->delay_ms = delay;
    d->next = tl_inits;
    tl_inits = d;
    *comm = h;
    return ncclSuccess;
  }
  if (!blocking) {
    job_t *j = job_new(f == FAKE_NCCL_BLOCK ? JOB_BLOCK : JOB_INIT, c);
    r = j ? ncclSuccess : fail(ncclSystemError, "fake NCCL: out of memory");
    if (j) {
      j->delay_ms = delay;
      j->call = call;
      r = start_job(j);
    }
    if (r != ncclSuccess) {
      handle_free(h);
      return r;
    }
    *comm = h;
    return ncclInProgress;
  }
  /* Blocking: the handle is published first, so another thread can abort it. */
  atomic_fetch_add(&h->inside, 1);
  *comm = h;
  r = f == FAKE_NCCL_BLOCK ? wait_aborted(c, call) : join(c, delay);
  if (r != ncclSuccess && !atomic_load(&c->aborted)) {
    /* NCCL frees a communicator whose blocking init failed. */
    shm_leave(c, GONE_ABORTED);
    *comm = NULL;
    atomic_fetch_sub(&h->inside, 1);
    handle_free(h);
    return r;
  }
  comm_leave(h);
  return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(API_CommInitRank, comm, nranks, commId, rank, NULL);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config) {
  return init_rank(API_CommInitRankConfig, comm, nranks, commId, rank, config);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  const char *call = "ncclCommSplit";
  const fake_nccl_fault_t f = enter_api(API_CommSplit);
  if (!newcomm) return fail(ncclInvalidArgument, "fake NCCL: %s: newcomm is NULL", call);
  *newcomm = NULL;
  ncclResult_t r = check_config(config, call);
  if (r != ncclSuccess) return r;
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR)
    return fail(ncclInvalidArgument, "fake NCCL: %s: color %d (>= 0 or NCCL_SPLIT_NOCOLOR)", call, color);
  core_t *p = NULL;
  r = comm_enter(comm, call, &p);
  if (r != ncclSuccess) return r;
  r = check_ready(p, call);
  if (r == ncclSuccess && f != FAKE_NCCL_INPROGRESS) r = host_fault(f, p, call);
  if (r != ncclSuccess) {
    comm_leave(comm);
    return r;
  }
  const uint32_t k = atomic_fetch_add(&p->splits, 1);
  const int delay = f == FAKE_NCCL_INPROGRESS ? inprogress_ms() : 0;
  /* The child inherits the parent's mode unless the config says otherwise. */
  const int blocking = resolve_blocking(config, p->blocking);
  core_t *c = NULL;
  struct ncclComm *h = NULL;
  if (color != NCCL_SPLIT_NOCOLOR) {
    c = core_new(blocking, p->device);
    h = c ? handle_new(c) : NULL;
    if (!h) {
      core_unref(c);
      comm_leave(comm);
      return fail(ncclSystemError, "fake NCCL: out of memory");
    }
  }
  if (!blocking) {
    job_t *j = job_new(JOB_SPLIT, c);
    r = j ? ncclSuccess : fail(ncclSystemError, "fake NCCL: out of memory");
    if (j) {
      j->parent = p;
      j->split_index = k;
      j->color = color;
      j->key = key;
      j->delay_ms = delay;
      r = start_job(j);
    }
    comm_leave(comm);
    if (r != ncclSuccess) {
      if (h) handle_free(h);
      return r;
    }
    *newcomm = h;
    return ncclInProgress;
  }
  int rank = -1, n = 0;
  r = split_exchange(p, k, color, key, &rank, &n);
  comm_leave(comm);
  if (r != ncclSuccess || !c) {
    if (h) handle_free(h);
    return r;
  }
  uint8_t ckey[16];
  split_key_of(p, k, color, ckey);
  r = core_setup(c, n, rank, ckey);
  if (r != ncclSuccess) {
    handle_free(h);
    return r;
  }
  atomic_fetch_add(&h->inside, 1);
  *newcomm = h;
  r = join(c, delay);
  if (r != ncclSuccess && !atomic_load(&c->aborted)) {
    shm_leave(c, GONE_ABORTED);
    *newcomm = NULL;
    atomic_fetch_sub(&h->inside, 1);
    handle_free(h);
    return r;
  }
  comm_leave(h);
  return r;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  const fake_nccl_fault_t f = enter_api(API_CommFinalize);
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, "ncclCommFinalize", &c);
  if (r != ncclSuccess) return r;
  r = check_ready(c, "ncclCommFinalize");
  if (r == ncclSuccess) r = host_fault(f, c, "ncclCommFinalize");
  if (r == ncclSuccess && atomic_load(&c->pending) > 0) {
    if (c->blocking) {
      const backoff_t b = backoff_start();
      while (atomic_load(&c->pending) > 0 && !atomic_load(&c->aborted)) backoff_nap(&b);
      if (atomic_load(&c->aborted)) r = fail(ncclSystemError, "fake NCCL: ncclCommFinalize: the communicator was aborted");
    } else {
      job_t *j = job_new(JOB_FINALIZE, c);
      r = j ? start_job(j) : fail(ncclSystemError, "fake NCCL: out of memory");
      if (r == ncclSuccess) r = ncclInProgress;
    }
  }
  comm_leave(comm);
  return r;
}

/* Waits for the device work already enqueued (forever if it waits on a dead
 * peer, as NCCL), then frees the handle. */
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  const fake_nccl_fault_t f = enter_api(API_CommDestroy);
  if (!comm) return ncclSuccess;
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, "ncclCommDestroy", &c);
  if (r != ncclSuccess) return r;
  if (atomic_load(&c->busy))
    r = fail(ncclInvalidUsage, "fake NCCL: ncclCommDestroy on a nonblocking communicator that is still in "
             "progress: poll ncclCommGetAsyncError first, or use ncclCommAbort");
  if (r == ncclSuccess) r = host_fault(f, c, "ncclCommDestroy");
  if (r != ncclSuccess) {
    comm_leave(comm);
    return r;
  }
  const backoff_t b = backoff_start();
  while (atomic_load(&c->pending) > 0 && !atomic_load(&c->aborted)) backoff_nap(&b);
  if (atomic_load(&c->aborted)) {
    comm_leave(comm);
    return fail(ncclSystemError, "fake NCCL: ncclCommDestroy: the communicator was aborted meanwhile");
  }
  atomic_store(&c->closed, 1);
  shm_leave(c, GONE_DESTROYED);
  comm_leave(comm);
  handle_free(comm);
  return ncclSuccess;
}

/* From any thread: releases the calls blocked inside the communicator and
 * ends its device work at once; frees the handle once no call is inside. */
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  const fake_nccl_fault_t f = enter_api(API_CommAbort);
  if (!comm) return ncclSuccess;
  if (comm->magic != HANDLE_MAGIC)
    return fail(ncclInvalidArgument, "fake NCCL: ncclCommAbort: not a communicator (destroyed or aborted already?)");
  core_t *c = comm->core;
  /* A blocked abort has nobody to release it: it blocks for good. */
  ncclResult_t r = f == FAKE_NCCL_BLOCK ? wait_aborted(NULL, "ncclCommAbort") : host_fault(f, c, "ncclCommAbort");
  if (r != ncclSuccess) return r;
  atomic_store(&c->aborted, 1);
  /* As NCCL's abort: the communicator's kernels end (and the events
   * behind them complete) well before the call returns, which first tears
   * the communicator down ($FAKE_NCCL_ABORT_MS, default 20). */
  const backoff_t b = backoff_start();
  const int64_t kernels_end_by = now_ns() + 1000000000LL;
  while (atomic_load(&c->pending) > 0 && now_ns() < kernels_end_by) backoff_nap(&b);
  sleep_ns(abort_ms() * 1000000LL);
  shm_leave(c, GONE_ABORTED);
  handle_free(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  const fake_nccl_fault_t f = enter_api(API_CommGetAsyncError);
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, "ncclCommGetAsyncError", &c);
  if (r != ncclSuccess) return r;
  r = host_fault(f, c, "ncclCommGetAsyncError");
  if (r == ncclSuccess && !asyncError) r = fail(ncclInvalidArgument, "fake NCCL: ncclCommGetAsyncError: asyncError is NULL");
  if (r == ncclSuccess) {
    const ncclResult_t e = (ncclResult_t)atomic_load(&c->async_err);
    *asyncError = e != ncclSuccess ? e : atomic_load(&c->busy) ? ncclInProgress : ncclSuccess;
  }
  comm_leave(comm);
  return r;
}

static ncclResult_t query(enum api api, const ncclComm_t comm, int *out, int what) {
  const char *call = api_names[api];
  const fake_nccl_fault_t f = enter_api(api);
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, call, &c);
  if (r != ncclSuccess) return r;
  r = check_ready(c, call);
  if (r == ncclSuccess) r = host_fault(f, c, call);
  if (r == ncclSuccess && !out) r = fail(ncclInvalidArgument, "fake NCCL: %s: the output pointer is NULL", call);
  if (r == ncclSuccess) *out = what == 0 ? c->nranks : what == 1 ? c->rank : c->device;
  comm_leave(comm);
  return r;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) { return query(API_CommCount, comm, count, 0); }
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) { return query(API_CommUserRank, comm, rank, 1); }
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) { return query(API_CommCuDevice, comm, device, 2); }

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  const char *call = "ncclRedOpCreatePreMulSum";
  const fake_nccl_fault_t f = enter_api(API_RedOpCreatePreMulSum);
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, call, &c);
  if (r != ncclSuccess) return r;
  r = check_ready(c, call);
  if (r == ncclSuccess) r = host_fault(f, c, call);
  if (r == ncclSuccess && (!op || !scalar)) r = fail(ncclInvalidArgument, "fake NCCL: %s: op or scalar is NULL", call);
  if (r == ncclSuccess && (!type_size(datatype) || datatype == ncclFloat8e4m3 || datatype == ncclFloat8e5m2))
    r = fail(ncclInvalidArgument, "fake NCCL: %s: datatype %d cannot be reduced", call, (int)datatype);
  if (r == ncclSuccess && residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
    r = fail(ncclInvalidArgument, "fake NCCL: %s: invalid residence %d", call, (int)residence);
  if (r == ncclSuccess) {
    pthread_mutex_lock(&c->mu);
    int idx = 0;
    while (idx < MAX_PREMUL && c->premul[idx].used) idx++;
    if (idx < MAX_PREMUL) {
      premul_t *pm = &c->premul[idx];
      memset(pm, 0, sizeof *pm);
      pm->used = 1;
      pm->type = datatype;
      pm->device = residence == ncclScalarDevice;
      if (pm->device) pm->ptr = scalar;
      else memcpy(pm->value, scalar, type_size(datatype)); /* copied now, as NCCL */
      *op = (ncclRedOp_t)((int)ncclNumOps + idx);
    }
    pthread_mutex_unlock(&c->mu);
    if (idx == MAX_PREMUL) r = fail(ncclInvalidUsage, "fake NCCL: %s: more than %d live PreMulSum ops", call, MAX_PREMUL);
  }
  comm_leave(comm);
  return r;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  const char *call = "ncclRedOpDestroy";
  const fake_nccl_fault_t f = enter_api(API_RedOpDestroy);
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, call, &c);
  if (r != ncclSuccess) return r;
  r = host_fault(f, c, call);
  const int idx = (int)op - (int)ncclNumOps;
  if (r == ncclSuccess) {
    pthread_mutex_lock(&c->mu);
    const int ok = idx >= 0 && idx < MAX_PREMUL && c->premul[idx].used;
    if (ok) c->premul[idx].used = 0;
    pthread_mutex_unlock(&c->mu);
    if (!ok) r = fail(ncclInvalidArgument, "fake NCCL: %s: op %d is not a live PreMulSum op of this communicator", call, (int)op);
  }
  comm_leave(comm);
  return r;
}

/* ---- groups ---------------------------------------------------------------- */

ncclResult_t ncclGroupStart(void) {
  const fake_nccl_fault_t f = enter_api(API_GroupStart);
  ncclResult_t r = host_fault(f, NULL, "ncclGroupStart");
  if (r != ncclSuccess) return r;
  tl_depth++;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  const fake_nccl_fault_t f = enter_api(API_GroupEnd);
  if (tl_depth == 0) return fail(ncclInvalidUsage, "fake NCCL: ncclGroupEnd without a matching ncclGroupStart");
  if (--tl_depth > 0) return f == FAKE_NCCL_FAIL ? host_fault(f, NULL, "ncclGroupEnd") : ncclSuccess;
  /* The outermost end: whatever happens, the group is over. */
  op_t *ops = tl_head;
  deferred_t *inits = tl_inits;
  const ncclResult_t group_err = tl_group_err;
  tl_head = tl_tail = NULL;
  tl_inits = NULL;
  tl_group_err = ncclSuccess;
  ncclResult_t r = group_err;
  if (r == ncclSuccess && f == FAKE_NCCL_FAIL) r = host_fault(f, NULL, "ncclGroupEnd");
  if (r == ncclSuccess && f == FAKE_NCCL_BLOCK) {
    /* Until a communicator of the group is aborted (forever in an empty group). */
    const backoff_t b = backoff_start();
    for (;;) {
      int aborted = 0;
      for (const op_t *o = ops; o; o = o->next) aborted |= atomic_load(&o->core->aborted);
      if (aborted) break;
      backoff_nap(&b);
    }
    r = fail(ncclSystemError, "fake NCCL: ncclGroupEnd was blocked by an injected fault (FAKE_NCCL_BLOCK) until "
             "the communicator was aborted");
  }
  if (r != ncclSuccess) {
    /* A failed group launches nothing; NCCL frees it all the same. */
    while (ops) {
      op_t *o = ops;
      ops = o->next;
      op_free(o);
    }
    for (deferred_t *d = inits; d; d = d->next) set_async(d->core, r, "%s", tl_msg);
    while (inits) {
      deferred_t *d = inits;
      inits = d->next;
      atomic_fetch_sub(&d->core->busy, 1);
      core_unref(d->core);
      free(d);
    }
    return r; /* a failed call's own message stays the last error */
  }
  ncclResult_t ri = inits ? launch_inits(inits) : ncclSuccess;
  ncclResult_t ro = launch(ops, f);
  if (ri != ncclSuccess && ri != ncclInProgress) return ri;
  if (ro != ncclSuccess) return ro;
  return ri;
}

/* ---- collectives and point-to-point --------------------------------------- */

static ncclResult_t one(enum api api, kind_t kind, const void *send, void *recv, size_t count, ncclDataType_t type,
                       ncclRedOp_t op, int root, int peer, ncclComm_t comm, cudaStream_t stream) {
  const fake_nccl_fault_t f = enter_api(api);
  const call_args_t a = {kind, send, recv, count, type, op, root, peer, stream};
  return submit(comm, f, &a, 1, api_names[api]);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return one(API_AllReduce, K_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return one(API_Broadcast, K_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, 0, comm, stream);
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return one(API_Bcast, K_BROADCAST, buff, buff, count, datatype, ncclSum, root, 0, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return one(API_Reduce, K_REDUCE, sendbuff, recvbuff, count, datatype, op, root, 0, comm, stream);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return one(API_AllGather, K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return one(API_ReduceScatter, K_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, 0, comm, stream);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return one(API_Send, K_SEND, sendbuff, NULL, count, datatype, ncclSum, 0, peer, comm, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return one(API_Recv, K_RECV, NULL, recvbuff, count, datatype, ncclSum, 0, peer, comm, stream);
}

/* AlltoAll, Gather and Scatter are grouped sends and receives, as in NCCL
 * (so they connect peers on first use like any p2p call). */
static ncclResult_t p2p_collective(enum api api, const void *send, void *recv, size_t count, ncclDataType_t type,
                                   int root, ncclComm_t comm, cudaStream_t stream) {
  const fake_nccl_fault_t f = enter_api(api);
  const char *call = api_names[api];
  core_t *c = NULL;
  ncclResult_t r = comm_enter(comm, call, &c);
  if (r != ncclSuccess) return group_error(r);
  r = check_ready(c, call);
  const int n = r == ncclSuccess ? c->nranks : 0, me = r == ncclSuccess ? c->rank : 0;
  comm_leave(comm);
  if (r != ncclSuccess) return group_error(r);
  const size_t es = type_size(type);
  if (!es) return group_error(fail(ncclInvalidArgument, "fake NCCL: %s: invalid datatype %d", call, (int)type));
  if (api != API_AlltoAll && (root < 0 || root >= n))
    return group_error(fail(ncclInvalidArgument, "fake NCCL: %s: root %d is not a rank of this communicator of %d",
                            call, root, n));
  call_args_t *a = calloc((size_t)(2 * n), sizeof *a);
  if (!a) return group_error(fail(ncclSystemError, "fake NCCL: out of memory"));
  int k = 0;
  const uint8_t *s = send;
  uint8_t *d = recv;
  for (int j = 0; j < n; j++) {
    const size_t off = (size_t)j * count * es;
    const int sends = api == API_AlltoAll || (api == API_Gather ? j == root : me == root);
    const int recvs = api == API_AlltoAll || (api == API_Gather ? me == root : j == root);
    if (sends) a[k++] = (call_args_t){K_SEND, api == API_Gather ? send : s ? s + off : NULL, NULL, count, type, ncclSum, 0, j, stream};
    if (recvs) a[k++] = (call_args_t){K_RECV, NULL, api == API_Scatter ? recv : d ? d + off : NULL, count, type, ncclSum, 0, j, stream};
  }
  r = submit(comm, f, a, k, call); /* one call: one group of sends and receives */
  free(a);
  return r;
}

ncclResult_t ncclAlltoAll(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                          ncclComm_t comm, cudaStream_t stream) {
  return p2p_collective(API_AlltoAll, sendbuff, recvbuff, count, datatype, 0, comm, stream);
}

ncclResult_t ncclGather(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  return p2p_collective(API_Gather, sendbuff, recvbuff, count, datatype, root, comm, stream);
}

ncclResult_t ncclScatter(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                         ncclComm_t comm, cudaStream_t stream) {
  return p2p_collective(API_Scatter, sendbuff, recvbuff, count, datatype, root, comm, stream);
}
