/*
 * selftest_cudart.c - checks the fake CUDA runtime (fake_cudart.c) on its
 * own: stream ordering through events under random delays, queries,
 * the capture state machine and its refusals, graph replay, user-object
 * lifetimes and memory accounting. Runs every group, reports each failed
 * check with what was expected, and exits nonzero if any failed.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "fake_gpu.h"

static int failures;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);      \
      fprintf(stderr, __VA_ARGS__);                             \
      fputc('\n', stderr);                                      \
      failures++;                                               \
    }                                                           \
  } while (0)

/* The call must return `want`. */
#define EXPECT(want, call)                                                                              \
  do {                                                                                                  \
    cudaError_t got_ = (call);                                                                          \
    CHECK(got_ == (want), "%s returned %s, expected %s", #call, cudaGetErrorName(got_), #want);         \
  } while (0)

#define OK(call) EXPECT(cudaSuccess, call)

static void nap_us(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

/* ---- tasks --------------------------------------------------------------- */

/* Counts its runs and resets; finishes after `steps` calls of step. */
struct counter {
  atomic_int runs, resets, releases, left;
  int steps;
};

static int counter_step(void *arg) {
  struct counter *c = arg;
  if (atomic_fetch_sub(&c->left, 1) > 1) return 0;
  atomic_fetch_add(&c->runs, 1);
  return 1;
}

static void counter_reset(void *arg) {
  struct counter *c = arg;
  atomic_store(&c->left, c->steps);
  atomic_fetch_add(&c->resets, 1);
}

static void counter_release(void *arg) { atomic_fetch_add(&((struct counter *)arg)->releases, 1); }

static fake_task_t counter_task(struct counter *c, int steps) {
  c->steps = steps;
  fake_task_t t = {counter_step, counter_reset, counter_release, c, "counter"};
  return t;
}

/* Finishes once the gate is opened. */
static int gate_step(void *arg) { return atomic_load((atomic_int *)arg); }

static fake_task_t gate_task(atomic_int *gate) {
  fake_task_t t = {gate_step, NULL, NULL, gate, "gate"};
  return t;
}

static void set_flag(void *arg) { atomic_store((atomic_int *)arg, 1); }

/* ---- groups -------------------------------------------------------------- */

static void test_devices(void) {
  int n = -1, d = -1, v = 0;
  OK(cudaGetDeviceCount(&n));
  CHECK(n == 8, "default device count %d, expected 8 (is FAKE_CUDA_DEVICES set?)", n);
  EXPECT(cudaErrorInvalidDevice, cudaSetDevice(n));
  EXPECT(cudaErrorInvalidDevice, cudaGetLastError());
  OK(cudaGetLastError());
  OK(cudaSetDevice(3));
  OK(cudaGetDevice(&d));
  CHECK(d == 3, "current device %d, expected 3", d);
  OK(cudaSetDevice(0));
  fake_cuda_set_device_count(0);
  EXPECT(cudaErrorNoDevice, cudaGetDeviceCount(&n));
  CHECK(n == 0, "device count %d with no devices", n);
  fake_cuda_set_device_count(8);
  OK(cudaRuntimeGetVersion(&v));
  CHECK(v == 13000, "runtime version %d", v);
  CHECK(strcmp(cudaGetErrorString(cudaErrorNotReady), "device not ready") == 0, "error string");
  CHECK(strcmp(cudaGetErrorName(cudaErrorCapturedEvent), "cudaErrorCapturedEvent") == 0, "error name");
  (void)cudaGetLastError();
}

/* A copy on B that waits on an event recorded after a copy on A sees A's data. */
static void test_event_ordering(void) {
  enum { N = 1 << 16 };
  cudaStream_t a, b;
  cudaEvent_t e;
  OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  unsigned char *src = malloc(N), *out = malloc(N), *da = NULL, *db = NULL;
  OK(cudaMalloc((void **)&da, N));
  OK(cudaMalloc((void **)&db, N));
  CHECK(((size_t)da & 255) == 0, "allocation not 256-byte aligned");
  fake_cuda_set_delay_us(300);
  for (int round = 0; round < 20; round++) {
    memset(src, round + 1, N);
    OK(cudaMemsetAsync(da, 0, N, a));
    OK(cudaMemcpyAsync(da, src, N, cudaMemcpyHostToDevice, a));
    OK(cudaEventRecord(e, a));
    OK(cudaStreamWaitEvent(b, e, 0));
    OK(cudaMemcpyAsync(db, da, N, cudaMemcpyDeviceToDevice, b));
    OK(cudaMemcpyAsync(out, db, N, cudaMemcpyDeviceToHost, b));
    OK(cudaStreamSynchronize(b));
    CHECK(out[0] == round + 1 && out[N - 1] == round + 1, "round %d: B saw %d, expected A's %d", round, out[0],
          round + 1);
  }
  fake_cuda_set_delay_us(200);
  /* The synchronous copy is ordered on the legacy stream and waited for. */
  OK(cudaMemset(da, 7, N));
  OK(cudaMemcpy(out, da, N, cudaMemcpyDeviceToHost));
  CHECK(out[N / 2] == 7, "cudaMemset/cudaMemcpy: %d", out[N / 2]);
  OK(cudaFree(da));
  OK(cudaFree(db));
  OK(cudaEventDestroy(e));
  OK(cudaStreamDestroy(a));
  OK(cudaStreamDestroy(b));
  free(src);
  free(out);
}

static void test_queries(void) {
  cudaStream_t s;
  cudaEvent_t e, never;
  atomic_int gate = 0, flag = 0;
  OK(cudaStreamCreate(&s));
  OK(cudaEventCreate(&e));
  OK(cudaEventCreate(&never));
  OK(cudaEventQuery(never)); /* never recorded: complete */
  fake_task_t t = gate_task(&gate);
  OK(fake_cuda_enqueue(s, &t));
  OK(cudaEventRecord(e, s));
  OK(cudaLaunchHostFunc(s, set_flag, &flag));
  EXPECT(cudaErrorNotReady, cudaEventQuery(e));
  EXPECT(cudaErrorNotReady, cudaStreamQuery(s));
  OK(cudaGetLastError()); /* not-ready is not an error */
  CHECK(fake_cuda_stream_pending(s) == 3, "pending %d, expected 3", fake_cuda_stream_pending(s));
  OK(cudaStreamWaitEvent(s, never, 0)); /* no wait */
  atomic_store(&gate, 1);
  OK(cudaEventSynchronize(e));
  OK(cudaEventQuery(e));
  OK(cudaStreamSynchronize(s));
  OK(cudaStreamQuery(s));
  CHECK(atomic_load(&flag) == 1, "host function did not run");
  CHECK(fake_cuda_stream_pending(s) == 0, "pending %d after synchronize", fake_cuda_stream_pending(s));
  /* Destroying an event with a pending record, a stream with pending work. */
  atomic_store(&gate, 0);
  atomic_store(&flag, 0);
  OK(fake_cuda_enqueue(s, &t));
  OK(cudaEventRecord(e, s));
  OK(cudaEventDestroy(e));
  OK(cudaLaunchHostFunc(s, set_flag, &flag));
  OK(cudaStreamDestroy(s));
  EXPECT(cudaErrorInvalidResourceHandle, cudaStreamQuery(s));
  atomic_store(&gate, 1);
  for (int i = 0; i < 2000 && !atomic_load(&flag); i++) nap_us(1000);
  CHECK(atomic_load(&flag) == 1, "work queued on a destroyed stream did not run");
  OK(cudaEventDestroy(never));
  OK(cudaDeviceSynchronize());
  (void)cudaGetLastError();
}

static void test_memory(void) {
  void *p = NULL, *q = NULL;
  size_t base = fake_cuda_bytes_in_use();
  OK(cudaMalloc(&p, 1000));
  CHECK(fake_cuda_bytes_in_use() == base + 1000, "in use %zu, expected %zu", fake_cuda_bytes_in_use(), base + 1000);
  fake_cuda_set_memory_limit(base + 4096);
  EXPECT(cudaErrorMemoryAllocation, cudaMalloc(&q, 4000));
  EXPECT(cudaErrorMemoryAllocation, cudaGetLastError());
  OK(cudaGetLastError());
  OK(cudaMalloc(&q, 3000));
  fake_cuda_set_memory_limit(0);
  OK(cudaFree(q));
  EXPECT(cudaErrorInvalidValue, cudaFree(q)); /* twice */
  int local;
  EXPECT(cudaErrorInvalidValue, cudaFree(&local));
  OK(cudaFree(NULL));
  /* Stream-ordered free: happens when the stream gets there. */
  cudaStream_t s;
  atomic_int gate = 0;
  OK(cudaStreamCreate(&s));
  fake_task_t t = gate_task(&gate);
  OK(fake_cuda_enqueue(s, &t));
  OK(cudaFreeAsync(p, s));
  EXPECT(cudaErrorInvalidValue, cudaFreeAsync(p, s));
  CHECK(fake_cuda_bytes_in_use() == base + 1000, "freed before the stream got there");
  atomic_store(&gate, 1);
  OK(cudaStreamSynchronize(s));
  CHECK(fake_cuda_bytes_in_use() == base, "in use %zu after the free ran, expected %zu", fake_cuda_bytes_in_use(),
        base);
  OK(cudaMallocAsync(&p, 512, s));
  OK(cudaFreeAsync(p, s));
  OK(cudaStreamDestroy(s));
  OK(cudaDeviceSynchronize());
  CHECK(fake_cuda_bytes_in_use() == base, "cudaMallocAsync/cudaFreeAsync leaked");
  (void)cudaGetLastError();
}

/* ---- capture ------------------------------------------------------------- */

struct other_call {
  enum cudaStreamCaptureMode mode;
  cudaError_t result;
};

static void *malloc_from_other_thread(void *arg) {
  struct other_call *oc = arg;
  enum cudaStreamCaptureMode m = oc->mode;
  cudaThreadExchangeStreamCaptureMode(&m);
  void *p = NULL;
  oc->result = cudaMalloc(&p, 64);
  if (p) cudaFree(p);
  return NULL;
}

static cudaError_t malloc_in_thread(enum cudaStreamCaptureMode mode) {
  struct other_call oc = {mode, cudaErrorUnknown};
  pthread_t t;
  pthread_create(&t, NULL, malloc_from_other_thread, &oc);
  pthread_join(t, NULL);
  return oc.result;
}

static enum cudaStreamCaptureStatus status_of(cudaStream_t s) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(s, &st);
  return st;
}

/* Each capture-unsafe call, made by the capturing thread in global mode:
 * refused, and the capture invalidated. */
static void test_unsafe_calls(void) {
  static const char *names[] = {
      "cudaMalloc",     "cudaFree",             "cudaMemcpy",      "cudaMemset",
      "cudaEventQuery", "cudaEventSynchronize", "cudaStreamQuery", "cudaStreamSynchronize",
      "cudaDeviceSynchronize", "cudaStreamCreate", "cudaEventCreate",
  };
  cudaStream_t s, other, made;
  cudaEvent_t e, made_e;
  cudaGraph_t graph;
  void *p = NULL, *q = NULL;
  char host[16];
  OK(cudaStreamCreate(&s));
  OK(cudaStreamCreate(&other));
  OK(cudaEventCreate(&e));
  OK(cudaMalloc(&p, 16));
  for (int i = 0; i < (int)(sizeof names / sizeof *names); i++) {
    OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    cudaError_t r = cudaErrorUnknown;
    switch (i) {
      case 0: r = cudaMalloc(&q, 16); break;
      case 1: r = cudaFree(p); break;
      case 2: r = cudaMemcpy(host, p, 16, cudaMemcpyDeviceToHost); break;
      case 3: r = cudaMemset(p, 0, 16); break;
      case 4: r = cudaEventQuery(e); break;
      case 5: r = cudaEventSynchronize(e); break;
      case 6: r = cudaStreamQuery(other); break;
      case 7: r = cudaStreamSynchronize(other); break;
      case 8: r = cudaDeviceSynchronize(); break;
      case 9: r = cudaStreamCreate(&made); break;
      case 10: r = cudaEventCreate(&made_e); break;
    }
    CHECK(r == cudaErrorStreamCaptureUnsupported, "%s during a global capture returned %s", names[i],
          cudaGetErrorName(r));
    EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));
  }
  OK(cudaFree(p));
  OK(cudaEventDestroy(e));
  OK(cudaStreamDestroy(s));
  OK(cudaStreamDestroy(other));
  (void)cudaGetLastError();
}

/* Threads issuing on their own streams, ordering on each other's events,
 * while another thread polls the events (as the core's watchdog does). */
enum { WORKERS = 3, ROUNDS = 40 };
static cudaEvent_t shared_ev[WORKERS];
static atomic_int workers_done;

static void *issuer(void *arg) {
  int me = (int)(long)arg;
  cudaStream_t s;
  struct counter c = {0};
  fake_task_t t = counter_task(&c, 2);
  OK(cudaSetDevice(me % 2));
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < ROUNDS; i++) {
    OK(fake_cuda_enqueue(s, &t));
    OK(cudaStreamWaitEvent(s, shared_ev[(me + 1) % WORKERS], 0));
    cudaEvent_t ev;
    OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    OK(cudaEventRecord(ev, s));
    OK(cudaEventDestroy(ev)); /* with its record pending */
  }
  OK(cudaStreamSynchronize(s));
  CHECK(atomic_load(&c.runs) == ROUNDS && atomic_load(&c.releases) == ROUNDS, "issuer %d: runs %d releases %d", me,
        atomic_load(&c.runs), atomic_load(&c.releases));
  OK(cudaStreamDestroy(s));
  atomic_fetch_add(&workers_done, 1);
  return NULL;
}

static void test_threads(void) {
  pthread_t t[WORKERS];
  cudaStream_t s;
  OK(cudaStreamCreate(&s));
  for (int i = 0; i < WORKERS; i++) {
    OK(cudaEventCreateWithFlags(&shared_ev[i], cudaEventDisableTiming));
    OK(cudaEventRecord(shared_ev[i], s));
  }
  for (int i = 0; i < WORKERS; i++) pthread_create(&t[i], NULL, issuer, (void *)(long)i);
  enum cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&m);
  while (atomic_load(&workers_done) < WORKERS) {
    for (int i = 0; i < WORKERS; i++) {
      cudaError_t q = cudaEventQuery(shared_ev[i]);
      CHECK(q == cudaSuccess || q == cudaErrorNotReady, "polling: %s", cudaGetErrorName(q));
      OK(cudaEventRecord(shared_ev[i], s));
    }
    nap_us(200);
  }
  cudaThreadExchangeStreamCaptureMode(&m);
  for (int i = 0; i < WORKERS; i++) pthread_join(t[i], NULL);
  OK(cudaStreamSynchronize(s));
  for (int i = 0; i < WORKERS; i++) OK(cudaEventDestroy(shared_ev[i]));
  OK(cudaStreamDestroy(s));
}

static void test_capture_refusals(void) {
  cudaStream_t s, s2;
  cudaGraph_t graph = NULL;
  cudaEvent_t e;
  void *p = NULL;
  OK(cudaStreamCreate(&s));
  OK(cudaStreamCreate(&s2));
  OK(cudaEventCreate(&e));
  EXPECT(cudaErrorStreamCaptureUnsupported, cudaStreamBeginCapture(NULL, cudaStreamCaptureModeGlobal));
  EXPECT(cudaErrorIllegalState, cudaStreamEndCapture(s, &graph));

  /* Global mode: an unsafe call from this thread invalidates the capture. */
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  EXPECT(cudaErrorIllegalState, cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CHECK(status_of(s) == cudaStreamCaptureStatusActive, "not capturing after begin");
  enum cudaStreamCaptureStatus st;
  unsigned long long id = 0;
  OK(cudaStreamGetCaptureInfo(s, &st, &id, NULL, NULL, NULL, NULL));
  CHECK(st == cudaStreamCaptureStatusActive && id != 0, "capture info: status %d id %llu", (int)st, id);
  EXPECT(cudaErrorStreamCaptureUnsupported, cudaMalloc(&p, 64));
  CHECK(status_of(s) == cudaStreamCaptureStatusInvalidated, "cudaMalloc did not invalidate the capture");
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaMemsetAsync(p, 0, 0, s));
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));
  CHECK(graph == NULL && status_of(s) == cudaStreamCaptureStatusNone, "invalidated capture left a graph/state");

  /* Relaxed mode: allowed, and the capture goes on. */
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  enum cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
  OK(cudaThreadExchangeStreamCaptureMode(&m));
  CHECK(m == cudaStreamCaptureModeGlobal, "default mode %d, expected global", (int)m);
  cudaEvent_t e2;
  OK(cudaMalloc(&p, 64));
  OK(cudaEventCreate(&e2));
  OK(cudaThreadExchangeStreamCaptureMode(&m));
  CHECK(status_of(s) == cudaStreamCaptureStatusActive, "relaxed calls invalidated the capture");
  /* Another thread in global mode is refused by a global capture ... */
  EXPECT(cudaErrorStreamCaptureUnsupported, malloc_in_thread(cudaStreamCaptureModeGlobal));
  CHECK(status_of(s) == cudaStreamCaptureStatusInvalidated, "other thread's call did not invalidate");
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));
  /* ... but not one in thread-local mode, and not by a thread-local capture. */
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  OK(malloc_in_thread(cudaStreamCaptureModeThreadLocal));
  OK(cudaStreamEndCapture(s, &graph));
  OK(cudaGraphDestroy(graph));
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  OK(malloc_in_thread(cudaStreamCaptureModeGlobal));
  EXPECT(cudaErrorStreamCaptureUnsupported, cudaEventCreate(&e2)); /* this thread's own capture */
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));
  OK(cudaEventDestroy(e2));
  OK(cudaFree(p));

  /* Synchronizing or querying a capturing stream. */
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  EXPECT(cudaErrorStreamCaptureUnsupported, cudaStreamSynchronize(s));
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  EXPECT(cudaErrorStreamCaptureUnsupported, cudaStreamQuery(s));
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));

  /* Isolation: waiting on an event recorded outside the capture. */
  OK(cudaEventRecord(e, s2));
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  EXPECT(cudaErrorStreamCaptureIsolation, cudaStreamWaitEvent(s, e, 0));
  CHECK(status_of(s) == cudaStreamCaptureStatusInvalidated, "isolation did not invalidate");
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));

  /* Captured event: queries refused, even after the capture ended. */
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(e, s));
  m = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&m);
  EXPECT(cudaErrorCapturedEvent, cudaEventQuery(e));
  EXPECT(cudaErrorCapturedEvent, cudaEventSynchronize(e));
  cudaThreadExchangeStreamCaptureMode(&m);
  OK(cudaStreamEndCapture(s, &graph));
  EXPECT(cudaErrorCapturedEvent, cudaEventQuery(e));
  OK(cudaEventRecord(e, s));
  OK(cudaEventSynchronize(e));
  OK(cudaGraphDestroy(graph));

  OK(cudaEventDestroy(e));
  OK(cudaStreamDestroy(s));
  OK(cudaStreamDestroy(s2));
  (void)cudaGetLastError();
}

static void test_capture_joins(void) {
  cudaStream_t s1, s2, s3;
  cudaEvent_t fork, join, j2;
  cudaGraph_t graph = NULL;
  struct counter c = {0};
  fake_task_t t = counter_task(&c, 3);
  OK(cudaStreamCreate(&s1));
  OK(cudaStreamCreate(&s2));
  OK(cudaStreamCreate(&s3));
  OK(cudaEventCreate(&fork));
  OK(cudaEventCreate(&join));
  OK(cudaEventCreate(&j2));

  /* Forked, never joined. */
  OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(fork, s1));
  OK(cudaStreamWaitEvent(s2, fork, 0));
  CHECK(status_of(s2) == cudaStreamCaptureStatusActive, "s2 did not join the capture");
  OK(fake_cuda_enqueue(s2, &t));
  EXPECT(cudaErrorStreamCaptureUnjoined, cudaStreamEndCapture(s1, &graph));
  CHECK(graph == NULL, "unjoined capture returned a graph");
  CHECK(status_of(s2) == cudaStreamCaptureStatusNone, "s2 still capturing after the capture ended");
  CHECK(atomic_load(&c.runs) == 0 && atomic_load(&c.releases) == 1, "discarded captured task: runs %d releases %d",
        atomic_load(&c.runs), atomic_load(&c.releases));

  /* Forked, joined; then new work on the fork unjoins it again. */
  OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(fork, s1));
  OK(cudaStreamWaitEvent(s2, fork, 0));
  OK(fake_cuda_enqueue(s2, &t));
  OK(cudaEventRecord(join, s2));
  OK(cudaStreamWaitEvent(s1, join, 0));
  OK(cudaStreamEndCapture(s1, &graph));
  CHECK(graph != NULL, "joined capture returned no graph");
  OK(cudaGraphDestroy(graph));
  OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(fork, s1));
  OK(cudaStreamWaitEvent(s2, fork, 0));
  OK(cudaEventRecord(join, s2));
  OK(cudaStreamWaitEvent(s1, join, 0));
  OK(cudaMemsetAsync(NULL, 0, 0, s2));
  EXPECT(cudaErrorStreamCaptureUnjoined, cudaStreamEndCapture(s1, &graph));

  /* Joined transitively: s3 into s2, s2 into s1. */
  OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(fork, s1));
  OK(cudaStreamWaitEvent(s2, fork, 0));
  OK(cudaEventRecord(fork, s2));
  OK(cudaStreamWaitEvent(s3, fork, 0));
  OK(fake_cuda_enqueue(s3, &t));
  OK(cudaEventRecord(j2, s3));
  OK(cudaStreamWaitEvent(s2, j2, 0));
  OK(cudaEventRecord(join, s2));
  OK(cudaStreamWaitEvent(s1, join, 0));
  OK(cudaStreamEndCapture(s1, &graph));
  OK(cudaGraphDestroy(graph));

  /* Ended on a forked stream: unmatched; every stream leaves the capture. */
  OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(fork, s1));
  OK(cudaStreamWaitEvent(s2, fork, 0));
  EXPECT(cudaErrorStreamCaptureUnmatched, cudaStreamEndCapture(s2, &graph));
  CHECK(status_of(s1) == cudaStreamCaptureStatusNone && status_of(s2) == cudaStreamCaptureStatusNone,
        "streams still capturing after an unmatched end");

  /* Two captures may not merge. */
  OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  OK(cudaStreamBeginCapture(s2, cudaStreamCaptureModeGlobal));
  OK(cudaEventRecord(fork, s1));
  EXPECT(cudaErrorStreamCaptureMerge, cudaStreamWaitEvent(s2, fork, 0));
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s1, &graph));
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s2, &graph));

  OK(cudaDeviceSynchronize());
  CHECK(atomic_load(&c.runs) == 0, "a captured task ran eagerly");
  CHECK(atomic_load(&c.releases) == 3, "captured task releases %d, expected 3", atomic_load(&c.releases));
  OK(cudaEventDestroy(fork));
  OK(cudaEventDestroy(join));
  OK(cudaEventDestroy(j2));
  OK(cudaStreamDestroy(s1));
  OK(cudaStreamDestroy(s2));
  OK(cudaStreamDestroy(s3));
  (void)cudaGetLastError();
}

struct uobj_state {
  atomic_int destroyed;
};

static void uobj_destroy(void *arg) { atomic_fetch_add(&((struct uobj_state *)arg)->destroyed, 1); }

static void test_graphs(void) {
  cudaStream_t s, run;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL, exec2 = NULL;
  struct counter c = {0};
  fake_task_t t = counter_task(&c, 2);
  int *host = calloc(4, sizeof(int)), *dev = NULL, *scratch = NULL;
  OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OK(cudaStreamCreateWithFlags(&run, cudaStreamNonBlocking));
  OK(cudaMalloc((void **)&dev, 4 * sizeof(int)));
  size_t base = fake_cuda_bytes_in_use();

  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  OK(fake_cuda_enqueue(s, &t));
  OK(cudaMallocAsync((void **)&scratch, 1024, s));
  OK(cudaMemsetAsync(scratch, 1, 1024, s));
  OK(cudaMemcpyAsync(dev, scratch, 4 * sizeof(int), cudaMemcpyDeviceToDevice, s));
  OK(cudaFreeAsync(scratch, s));
  OK(cudaMemcpyAsync(host, dev, 4 * sizeof(int), cudaMemcpyDeviceToHost, s));
  OK(cudaStreamEndCapture(s, &graph));
  CHECK(atomic_load(&c.runs) == 0 && host[0] == 0, "captured work ran at capture time");
  CHECK(fake_cuda_bytes_in_use() == base + 1024, "graph memory not accounted");

  struct uobj_state us = {0};
  cudaUserObject_t obj;
  EXPECT(cudaErrorInvalidValue, cudaUserObjectCreate(&obj, &us, uobj_destroy, 1, 0));
  OK(cudaUserObjectCreate(&obj, &us, uobj_destroy, 1, cudaUserObjectNoDestructorSync));
  int alive0 = fake_cuda_user_objects_alive();
  OK(cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove));

  OK(cudaGraphInstantiate(&exec, graph, 0));
  EXPECT(cudaErrorInvalidValue, cudaGraphInstantiate(&exec2, graph, 0)); /* memory nodes: one exec */
  OK(cudaGraphLaunch(exec, run));
  OK(cudaGraphLaunch(exec, run));
  OK(cudaStreamSynchronize(run));
  CHECK(atomic_load(&c.runs) == 2 && atomic_load(&c.resets) == 2, "two launches: runs %d resets %d",
        atomic_load(&c.runs), atomic_load(&c.resets));
  CHECK(host[0] == 0x01010101 && host[3] == 0x01010101, "replayed copies: %#x", (unsigned)host[0]);
  CHECK(atomic_load(&c.releases) == 0, "task released while its graph lives");

  /* Launching into a capture is refused. */
  cudaGraph_t bad = NULL;
  OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  EXPECT(cudaErrorStreamCaptureUnsupported, cudaGraphLaunch(exec, s));
  EXPECT(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &bad));

  /* The user object outlives the graph while the exec and its launch live. */
  atomic_int gate = 0;
  fake_task_t hold = gate_task(&gate);
  OK(fake_cuda_enqueue(run, &hold));
  OK(cudaGraphLaunch(exec, run));
  OK(cudaGraphDestroy(graph));
  CHECK(fake_cuda_user_objects_alive() == alive0, "user object died with its graph, an exec still lives");
  OK(cudaGraphExecDestroy(exec)); /* its launch still in flight */
  CHECK(atomic_load(&us.destroyed) == 0, "user object destroyed with a launch in flight");
  CHECK(atomic_load(&c.releases) == 0, "task released with a launch in flight");
  CHECK(fake_cuda_bytes_in_use() == base + 1024, "graph memory freed with a launch in flight");
  atomic_store(&gate, 1);
  OK(cudaStreamSynchronize(run));
  CHECK(atomic_load(&c.runs) == 3, "the launch in flight did not run (runs %d)", atomic_load(&c.runs));
  CHECK(atomic_load(&us.destroyed) == 1, "user object destructor ran %d times, expected 1",
        atomic_load(&us.destroyed));
  CHECK(fake_cuda_user_objects_alive() == alive0 - 1, "user objects alive %d", fake_cuda_user_objects_alive());
  CHECK(atomic_load(&c.releases) == 1, "task released %d times, expected 1", atomic_load(&c.releases));
  CHECK(fake_cuda_bytes_in_use() == base, "graph memory not freed with the graph");

  /* References: retain/release on the object and through a graph. */
  struct uobj_state us2 = {0};
  OK(cudaUserObjectCreate(&obj, &us2, uobj_destroy, 2, cudaUserObjectNoDestructorSync));
  OK(cudaGraphCreate(&graph, 0));
  OK(cudaGraphRetainUserObject(graph, obj, 2, 0));
  OK(cudaUserObjectRelease(obj, 2));
  CHECK(atomic_load(&us2.destroyed) == 0, "destroyed while a graph holds it");
  OK(cudaGraphReleaseUserObject(graph, obj, 1));
  EXPECT(cudaErrorInvalidValue, cudaGraphReleaseUserObject(graph, obj, 2));
  OK(cudaGraphDestroy(graph));
  CHECK(atomic_load(&us2.destroyed) == 1, "not destroyed with the last reference");

  OK(cudaFree(dev));
  OK(cudaStreamDestroy(s));
  OK(cudaStreamDestroy(run));
  free(host);
  (void)cudaGetLastError();
}

int main(void) {
  test_devices();
  test_event_ordering();
  test_queries();
  test_memory();
  test_capture_refusals();
  test_unsafe_calls();
  test_capture_joins();
  test_graphs();
  test_threads();
  OK(cudaDeviceSynchronize());
  CHECK(fake_cuda_bytes_in_use() == 0, "%zu bytes still in use at the end", fake_cuda_bytes_in_use());
  CHECK(fake_cuda_user_objects_alive() == 0, "%d user objects alive at the end", fake_cuda_user_objects_alive());
  if (failures) {
    fprintf(stderr, "selftest_cudart: %d check(s) failed\n", failures);
    return 1;
  }
  puts("selftest_cudart: all checks passed");
  return 0;
}
