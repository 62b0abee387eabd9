/*
 * fake_cudart.c - a test double of the CUDA runtime, built as
 * libcudart.so.13 against the real cuda_runtime_api.h, so that the core's
 * CUDA path runs (and its ordering and capture bugs show) on machines
 * without a GPU. It never ships. The seams it adds are in fake_gpu.h.
 *
 * The model:
 *
 * - Device memory is host memory (256-byte aligned), kept in a registry so
 *   that a bad pointer is an error code rather than a crash, and accounted
 *   (fake_cuda_bytes_in_use, fake_cuda_set_memory_limit).
 *
 * - A stream is a FIFO of entries run, strictly in order, by the stream's
 *   own worker thread, which sleeps a random delay before each entry: work
 *   completes late and at varying times, so a missing event or wait shows
 *   up as wrong data or a hang instead of passing by luck. The legacy
 *   default stream (NULL) is an ordinary stream per device, made on first
 *   use, that can never be captured.
 *
 * - An event record is a "mark": a small refcounted flag the stream sets
 *   when it reaches the record. The event points at its latest mark; a
 *   stream wait holds the mark it waits for. So an event can be destroyed
 *   or re-recorded while records and waits are in flight.
 *
 * - Stream capture is a state machine. A capture has an origin stream, a
 *   mode and an owner thread, and builds a graph: work on its streams is
 *   appended to the graph's node list instead of running. Other streams
 *   join it by waiting on an event recorded in it. Whether every forked
 *   stream has been joined back into the origin is tracked with vector
 *   clocks: each stream in the capture counts its own nodes and knows, for
 *   every other stream, how many of that stream's nodes it depends on; an
 *   event recorded in the capture snapshots the recording stream's clock,
 *   and a wait merges that snapshot. This makes joins transitive, as in
 *   real CUDA (A joins B, B joins the origin: A is joined too).
 *
 * - A graph's nodes live in a refcounted "body" shared by the graph and
 *   the execs made from it (plus each launch in flight, through its exec);
 *   when the last reference goes, the tasks are released and the memory
 *   the capture allocated is freed. A launch enqueues the nodes in capture
 *   order (a valid linearization of the graph) and a final internal entry
 *   that drops the launch's reference.
 *
 * Locking: one mutex (g.lock) guards everything; g.done_cv is broadcast
 * whenever an entry finishes, and each stream's work_cv wakes its worker.
 * Tasks, host functions, copies, task releases and user-object destructors
 * run with the lock released (they may call back into this library); code
 * that drops references under the lock collects such callbacks in a
 * "later" list and runs them after unlocking.
 *
 * Internal bookkeeping that cannot be allocated aborts the process (this
 * is a test double); only device allocations report cudaErrorMemoryAllocation.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "fake_gpu.h"

#define MAX_DEVICES 64
#define REG_BUCKETS 4096
#define MEM_ALIGN 256
#define FAKE_VERSION 13000

_Static_assert(cudaStreamCaptureModeGlobal == 0, "a zeroed thread-local mode must mean global");

/* ---- types --------------------------------------------------------------- */

/* One event record: set when the stream reaches it. Refs: the event while
 * it is the event's latest record, the queued record entry, each wait. */
struct mark {
  int done;
  int refs;
};

enum entry_kind { E_TASK, E_COPY, E_SET, E_HOST, E_RECORD, E_WAIT, E_FREE, E_LAUNCH_END };

/* A stream entry; also a graph node (kinds E_TASK, E_COPY, E_SET, E_HOST). */
struct entry {
  struct entry *next;
  enum entry_kind kind;
  unsigned long long stamp; /* global enqueue order, for synchronize */
  fake_task_t task;
  int owns_task; /* eager task: released after its run; graph tasks by the body */
  void *dst;
  const void *src;
  size_t bytes;
  int value;
  cudaHostFn_t fn;
  void *arg;
  struct mark *mark;
  struct CUgraphExec_st *exec;
};

/* A graph's content, shared by the graph and its execs. */
struct body {
  struct entry *nodes;
  size_t n, cap;
  int refs;
  int mem_nodes; /* captured cudaMallocAsync/cudaFreeAsync: one exec at a time */
  int execs;     /* exec handles alive */
};

/* References a graph or exec holds on a user object. */
struct uref {
  struct uref *next;
  struct CUuserObject_st *obj;
  unsigned count;
};

struct CUgraph_st {
  struct body *body;
  struct uref *urefs;
  int capturing; /* still being built by a capture: not the user's to use yet */
};

struct CUgraphExec_st {
  struct body *body;
  struct uref *urefs;
  int refs;          /* the handle, plus one per launch in flight */
  struct mark *last; /* end of the latest launch: launches of one exec never overlap */
};

struct CUuserObject_st {
  void *ptr;
  cudaHostFn_t destroy;
  unsigned refs;
};

struct capture {
  struct capture *next;
  unsigned long long id;
  enum cudaStreamCaptureMode mode;
  unsigned owner; /* thread id (my_id) of the thread that began it */
  int invalidated;
  struct CUstream_st *origin;
  struct CUstream_st **streams; /* index = cap_idx; NULL once destroyed */
  int n, vlen;                  /* streams, and the length of every vector clock */
  struct CUgraph_st *graph;
};

struct CUstream_st {
  struct CUstream_st *all_next; /* g.all: every stream not yet freed */
  int device;
  unsigned flags;
  int priority;
  int legacy;
  int destroyed;
  int refs; /* the handle, the worker, each synchronizing thread */
  struct entry *head, *tail;
  int pending; /* entries queued or running */
  pthread_cond_t work_cv;
  uint64_t rng; /* the worker's alone once it runs */
  struct capture *cap;
  int cap_idx;
  int *vc; /* vector clock while in a capture, length cap->vlen */
};

struct CUevent_st {
  int device;
  unsigned flags;
  struct mark *mark;          /* latest eager record, NULL if none or captured */
  unsigned long long cap_id;  /* latest record was captured in this capture */
  int *cap_vc;                /* recording stream's clock then */
  int cap_n;
};

enum reg_kind { R_MEM, R_STREAM, R_EVENT, R_GRAPH, R_EXEC, R_UOBJ };

/* Registry of live handles and allocations: a bad handle or pointer is
 * answered with an error instead of undefined behaviour. */
struct reg {
  struct reg *next;
  const void *key;
  enum reg_kind kind;
  size_t size;        /* R_MEM: bytes asked for */
  int device;         /* R_MEM */
  struct body *owner; /* R_MEM: graph that owns it, NULL when eager */
  int freeing;        /* R_MEM: a free is queued or captured */
};

/* A callback to run once the lock is released. */
struct later {
  struct later *next;
  void (*fn)(void *);
  void *arg;
};

static struct {
  pthread_mutex_t lock;
  pthread_cond_t done_cv;
  int ndev, delay_us;
  uint64_t seed;
  size_t limit, bytes;
  unsigned long long stamp, stream_serial, next_cap_id;
  struct CUstream_st *all;
  struct CUstream_st *legacy[MAX_DEVICES];
  struct capture *captures; /* active or invalidated, not yet ended */
  struct reg *buckets[REG_BUCKETS];
} g = {.lock = PTHREAD_MUTEX_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static atomic_int uobj_alive;
static atomic_uint next_tid;

static _Thread_local int tls_device;
static _Thread_local enum cudaStreamCaptureMode tls_mode;
static _Thread_local cudaError_t tls_last;
static _Thread_local unsigned tls_id;

/* ---- small helpers ------------------------------------------------------- */

static void *xalloc(void *old, size_t n) {
  void *p = realloc(old, n ? n : 1);
  if (!p) {
    fputs("fake_cudart: out of host memory for bookkeeping\n", stderr);
    abort();
  }
  return p;
}

static void *xzalloc(size_t n) { return memset(xalloc(NULL, n), 0, n); }

static long env_long(const char *name, long dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  long x = strtol(v, &end, 10);
  return *end ? dflt : x;
}

static void init_env(void) {
  long n = env_long("FAKE_CUDA_DEVICES", 8);
  g.ndev = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : (int)n;
  long d = env_long("FAKE_CUDA_DELAY_US", 200);
  g.delay_us = d < 0 ? 0 : d > 1000000 ? 1000000 : (int)d;
  g.seed = (uint64_t)env_long("FAKE_CUDA_SEED", 1);
}

static void lock(void) {
  pthread_once(&g_once, init_env);
  pthread_mutex_lock(&g.lock);
}

static void unlock(void) { pthread_mutex_unlock(&g.lock); }

/* Every public call returns through here: failures become the thread's
 * last error, as in the real runtime (cudaErrorNotReady is not a failure). */
static cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess && e != cudaErrorNotReady) tls_last = e;
  return e;
}

static unsigned my_id(void) {
  if (!tls_id) tls_id = atomic_fetch_add(&next_tid, 1) + 1;
  return tls_id;
}

static uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

static uint64_t next_rand(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

static void defer(struct later **l, void (*fn)(void *), void *arg) {
  struct later *x = xalloc(NULL, sizeof *x);
  x->fn = fn;
  x->arg = arg;
  x->next = *l;
  *l = x;
}

static void run_later(struct later *l) {
  while (l) {
    struct later *next = l->next;
    l->fn(l->arg);
    free(l);
    l = next;
  }
}

/* ---- registry ------------------------------------------------------------ */

static struct reg **reg_slot(const void *key) {
  uint64_t x = (uint64_t)(uintptr_t)key;
  x = (x ^ (x >> 29)) * 0x9E3779B97F4A7C15ull;
  return &g.buckets[(x >> 40) % REG_BUCKETS];
}

static struct reg *reg_add(const void *key, enum reg_kind kind) {
  struct reg **slot = reg_slot(key);
  struct reg *r = xzalloc(sizeof *r);
  r->key = key;
  r->kind = kind;
  r->next = *slot;
  *slot = r;
  return r;
}

static struct reg *reg_find(const void *key, enum reg_kind kind) {
  if (!key) return NULL;
  for (struct reg *r = *reg_slot(key); r; r = r->next)
    if (r->key == key && r->kind == kind) return r;
  return NULL;
}

static void reg_del(const void *key, enum reg_kind kind) {
  for (struct reg **pp = reg_slot(key); *pp; pp = &(*pp)->next) {
    if ((*pp)->key == key && (*pp)->kind == kind) {
      struct reg *r = *pp;
      *pp = r->next;
      free(r);
      return;
    }
  }
}

/* ---- device memory ------------------------------------------------------- */

static cudaError_t mem_alloc(void **out, size_t size, struct body *owner) {
  *out = NULL;
  if (size == 0) return cudaSuccess; /* as cudaMalloc: success, NULL */
  if (size > SIZE_MAX - MEM_ALIGN) return cudaErrorMemoryAllocation;
  if (g.limit && (size > g.limit || g.bytes > g.limit - size)) return cudaErrorMemoryAllocation;
  void *p = aligned_alloc(MEM_ALIGN, (size + MEM_ALIGN - 1) / MEM_ALIGN * MEM_ALIGN);
  if (!p) return cudaErrorMemoryAllocation;
  struct reg *r = reg_add(p, R_MEM);
  r->size = size;
  r->device = tls_device;
  r->owner = owner;
  g.bytes += size;
  *out = p;
  return cudaSuccess;
}

static void mem_release(void *p) {
  struct reg *r = reg_find(p, R_MEM);
  if (!r) return;
  g.bytes -= r->size;
  reg_del(p, R_MEM);
  free(p);
}

/* Frees what a graph's capture allocated, with the graph's last reference. */
static void mem_release_owned(struct body *b) {
  for (int i = 0; i < REG_BUCKETS; i++) {
    for (struct reg **pp = &g.buckets[i]; *pp;) {
      struct reg *r = *pp;
      if (r->kind == R_MEM && r->owner == b) {
        *pp = r->next;
        g.bytes -= r->size;
        free((void *)r->key);
        free(r);
      } else {
        pp = &r->next;
      }
    }
  }
}

/* ---- references: marks, user objects, graphs ----------------------------- */

static struct mark *mark_new(int refs) {
  struct mark *m = xzalloc(sizeof *m);
  m->refs = refs;
  return m;
}

static void mark_unref(struct mark *m) {
  if (m && --m->refs == 0) free(m);
}

static void uobj_finish(void *arg) {
  struct CUuserObject_st *o = arg;
  o->destroy(o->ptr);
  free(o);
  atomic_fetch_sub(&uobj_alive, 1);
}

static void uobj_release(struct CUuserObject_st *o, unsigned n, struct later **l) {
  o->refs -= n;
  if (o->refs == 0) {
    reg_del(o, R_UOBJ);
    defer(l, uobj_finish, o); /* the destructor may take its time: not under the lock */
  }
}

static void urefs_release(struct uref *u, struct later **l) {
  while (u) {
    struct uref *next = u->next;
    if (u->count) uobj_release(u->obj, u->count, l);
    free(u);
    u = next;
  }
}

static void uref_add(struct uref **list, struct CUuserObject_st *o, unsigned count) {
  for (struct uref *u = *list; u; u = u->next) {
    if (u->obj == o) {
      u->count += count;
      return;
    }
  }
  struct uref *u = xzalloc(sizeof *u);
  u->obj = o;
  u->count = count;
  u->next = *list;
  *list = u;
}

static void release_task(void *arg) {
  fake_task_t *t = arg;
  t->release(t->arg);
  free(t);
}

static void body_unref(struct body *b, struct later **l) {
  if (--b->refs) return;
  for (size_t i = 0; i < b->n; i++) {
    if (b->nodes[i].kind == E_TASK && b->nodes[i].task.release) {
      fake_task_t *t = xalloc(NULL, sizeof *t);
      *t = b->nodes[i].task;
      defer(l, release_task, t);
    }
  }
  if (b->mem_nodes) mem_release_owned(b);
  free(b->nodes);
  free(b);
}

static struct CUgraph_st *graph_new(void) {
  struct CUgraph_st *gr = xzalloc(sizeof *gr);
  gr->body = xzalloc(sizeof *gr->body);
  gr->body->refs = 1;
  reg_add(gr, R_GRAPH);
  return gr;
}

static void graph_free(struct CUgraph_st *gr, struct later **l) {
  reg_del(gr, R_GRAPH);
  urefs_release(gr->urefs, l);
  body_unref(gr->body, l);
  free(gr);
}

static void exec_unref(struct CUgraphExec_st *x, struct later **l) {
  if (--x->refs) return;
  urefs_release(x->urefs, l);
  body_unref(x->body, l);
  mark_unref(x->last);
  free(x);
}

/* ---- streams and their workers ------------------------------------------- */

static void stream_unref(struct CUstream_st *s) {
  if (--s->refs) return;
  for (struct CUstream_st **pp = &g.all; *pp; pp = &(*pp)->all_next) {
    if (*pp == s) {
      *pp = s->all_next;
      break;
    }
  }
  pthread_cond_destroy(&s->work_cv);
  free(s);
}

/* Runs one entry; called and returns with the lock held. */
static void run_entry(struct CUstream_st *s, struct entry *e, struct later **l) {
  switch (e->kind) {
    case E_TASK:
      unlock();
      if (e->task.reset) e->task.reset(e->task.arg);
      while (!e->task.step(e->task.arg)) sleep_us(20 + (long)(next_rand(&s->rng) % 31)); /* never spin */
      if (e->owns_task && e->task.release) e->task.release(e->task.arg);
      lock();
      break;
    case E_COPY:
      unlock();
      if (e->bytes) memmove(e->dst, e->src, e->bytes);
      lock();
      break;
    case E_SET:
      unlock();
      if (e->bytes) memset(e->dst, e->value, e->bytes);
      lock();
      break;
    case E_HOST:
      unlock();
      e->fn(e->arg);
      lock();
      break;
    case E_RECORD:
      e->mark->done = 1;
      mark_unref(e->mark);
      break;
    case E_WAIT:
      while (!e->mark->done) pthread_cond_wait(&g.done_cv, &g.lock);
      mark_unref(e->mark);
      break;
    case E_FREE:
      mem_release(e->dst);
      break;
    case E_LAUNCH_END:
      e->mark->done = 1;
      mark_unref(e->mark);
      exec_unref(e->exec, l);
      break;
  }
}

static void *worker_main(void *arg) {
  struct CUstream_st *s = arg;
  lock();
  for (;;) {
    while (!s->head && !s->destroyed) pthread_cond_wait(&s->work_cv, &g.lock);
    struct entry *e = s->head;
    if (!e) break; /* destroyed and drained */
    if (e->kind != E_LAUNCH_END && g.delay_us > 0) {
      long us = (long)(next_rand(&s->rng) % ((uint64_t)g.delay_us + 1));
      unlock();
      sleep_us(us);
      lock();
    }
    struct later *later = NULL;
    run_entry(s, e, &later);
    if (later) {
      /* Before the entry leaves the queue: once a synchronize returns, the
       * destructors and releases this entry set off have run. */
      unlock();
      run_later(later);
      lock();
    }
    s->head = e->next;
    if (!s->head) s->tail = NULL;
    s->pending--;
    pthread_cond_broadcast(&g.done_cv);
    free(e);
  }
  stream_unref(s);
  unlock();
  return NULL;
}

static struct CUstream_st *stream_new(int device, unsigned flags, int priority, int legacy, cudaError_t *err) {
  struct CUstream_st *s = xzalloc(sizeof *s);
  s->device = device;
  s->flags = flags;
  s->priority = priority;
  s->legacy = legacy;
  s->refs = 2; /* the handle and the worker */
  pthread_cond_init(&s->work_cv, NULL);
  uint64_t serial = ++g.stream_serial;
  s->rng = splitmix(splitmix(g.seed) ^ ((uint64_t)getpid() << 32) ^ splitmix(serial));
  if (!s->rng) s->rng = 1;
  pthread_attr_t a;
  pthread_t t;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &a, worker_main, s);
  pthread_attr_destroy(&a);
  if (rc) {
    pthread_cond_destroy(&s->work_cv);
    free(s);
    *err = cudaErrorMemoryAllocation;
    return NULL;
  }
  s->all_next = g.all;
  g.all = s;
  if (!legacy) reg_add(s, R_STREAM);
  return s;
}

static cudaError_t device_ok(int device) {
  if (g.ndev == 0) return cudaErrorNoDevice;
  return device >= 0 && device < g.ndev ? cudaSuccess : cudaErrorInvalidDevice;
}

/* The current device, if it (still) exists. */
static cudaError_t need_device(void) { return device_ok(tls_device); }

/* The stream a handle names: NULL and the special handles mean the current
 * device's legacy stream (cudaStreamPerThread too: no per-thread streams here). */
static struct CUstream_st *stream_of(cudaStream_t h, cudaError_t *err) {
  if (h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    *err = need_device();
    if (*err != cudaSuccess) return NULL;
    if (!g.legacy[tls_device]) g.legacy[tls_device] = stream_new(tls_device, 0, 0, 1, err);
    return g.legacy[tls_device];
  }
  if (!reg_find(h, R_STREAM)) {
    *err = cudaErrorInvalidResourceHandle;
    return NULL;
  }
  return h;
}

static struct CUevent_st *event_of(cudaEvent_t h, cudaError_t *err) {
  if (!reg_find(h, R_EVENT)) {
    *err = cudaErrorInvalidResourceHandle;
    return NULL;
  }
  return h;
}

static struct entry *entry_new(enum entry_kind kind) {
  struct entry *e = xzalloc(sizeof *e);
  e->kind = kind;
  return e;
}

static void push(struct CUstream_st *s, struct entry *e) {
  e->next = NULL;
  e->stamp = ++g.stamp;
  if (s->tail)
    s->tail->next = e;
  else
    s->head = e;
  s->tail = e;
  s->pending++;
  pthread_cond_signal(&s->work_cv);
}

static int busy_until(const struct CUstream_st *s, unsigned long long stamp) {
  return s->head && s->head->stamp <= stamp;
}

/* Waits until `s` ran everything enqueued up to `stamp`. */
static void wait_stream(struct CUstream_st *s, unsigned long long stamp) {
  s->refs++; /* it may be destroyed meanwhile */
  while (busy_until(s, stamp)) pthread_cond_wait(&g.done_cv, &g.lock);
  stream_unref(s);
}

/* ---- capture ------------------------------------------------------------- */

static struct capture *cap_find(unsigned long long id) {
  for (struct capture *c = g.captures; c; c = c->next)
    if (c->id == id) return c;
  return NULL;
}

static void cap_add_stream(struct capture *c, struct CUstream_st *s) {
  if (c->n == c->vlen) {
    int nl = c->vlen ? 2 * c->vlen : 4;
    c->streams = xalloc(c->streams, (size_t)nl * sizeof *c->streams);
    for (int i = 0; i < c->n; i++) {
      struct CUstream_st *x = c->streams[i];
      if (!x) continue;
      x->vc = xalloc(x->vc, (size_t)nl * sizeof(int));
      memset(x->vc + c->vlen, 0, (size_t)(nl - c->vlen) * sizeof(int));
    }
    c->vlen = nl;
  }
  s->cap = c;
  s->cap_idx = c->n;
  s->vc = xzalloc((size_t)c->vlen * sizeof(int));
  c->streams[c->n++] = s;
}

static void cap_leave(struct CUstream_st *s) {
  s->cap = NULL;
  free(s->vc);
  s->vc = NULL;
}

/* Ends a capture: every stream leaves it. Returns its graph. */
static struct CUgraph_st *cap_end(struct capture *c) {
  for (int i = 0; i < c->n; i++)
    if (c->streams[i]) cap_leave(c->streams[i]);
  for (struct capture **pp = &g.captures; *pp; pp = &(*pp)->next) {
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  }
  struct CUgraph_st *gr = c->graph;
  gr->capturing = 0;
  free(c->streams);
  free(c);
  return gr;
}

static void vc_merge(struct CUstream_st *s, const int *v, int n) {
  for (int i = 0; i < n && i < s->cap->n; i++)
    if (v[i] > s->vc[i]) s->vc[i] = v[i];
}

static int cap_unjoined(const struct capture *c) {
  for (int i = 0; i < c->n; i++) {
    const struct CUstream_st *x = c->streams[i];
    if (x && x != c->origin && c->origin->vc[i] < x->vc[i]) return 1;
  }
  return 0;
}

/* Appends a node (NULL: a memory node, nothing to replay) to the capture of
 * `s`, which counts as new work on that stream (it is unjoined again). */
static void cap_node(struct CUstream_st *s, const struct entry *node) {
  if (node) {
    struct body *b = s->cap->graph->body;
    if (b->n == b->cap) {
      b->cap = b->cap ? 2 * b->cap : 16;
      b->nodes = xalloc(b->nodes, b->cap * sizeof *b->nodes);
    }
    b->nodes[b->n] = *node;
    b->nodes[b->n].next = NULL;
    b->nodes[b->n].owns_task = 0;
    b->n++;
  }
  s->vc[s->cap_idx]++;
}

/* The check of a capture-unsafe call (a synchronizing or allocating one):
 * refused, and the captures it would break invalidated, unless this
 * thread is in relaxed mode. A capture begun in relaxed mode forbids
 * nothing; one begun by this thread forbids unless this thread is relaxed;
 * another thread's forbids only when both it and this thread are in the
 * global mode. */
static cudaError_t unsafe_check(void) {
  if (tls_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  int hit = 0;
  for (struct capture *c = g.captures; c; c = c->next) {
    if (c->invalidated || c->mode == cudaStreamCaptureModeRelaxed) continue;
    if (c->owner == my_id() || (tls_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal)) {
      c->invalidated = 1;
      hit = 1;
    }
  }
  return hit ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

/* Enqueues a copy of `tmpl` on the stream, or records it into its capture. */
static cudaError_t submit(cudaStream_t h, const struct entry *tmpl) {
  cudaError_t err = cudaSuccess;
  struct CUstream_st *s = stream_of(h, &err);
  if (!s) return err;
  if (s->cap) {
    if (s->cap->invalidated) return cudaErrorStreamCaptureInvalidated;
    cap_node(s, tmpl);
    return cudaSuccess;
  }
  struct entry *e = entry_new(tmpl->kind);
  *e = *tmpl;
  push(s, e);
  return cudaSuccess;
}

/* ---- errors and versions ------------------------------------------------- */

#define ERRORS(X)                                                                                      \
  X(cudaSuccess, "no error")                                                                          \
  X(cudaErrorInvalidValue, "invalid argument")                                                        \
  X(cudaErrorMemoryAllocation, "out of memory")                                                       \
  X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                          \
  X(cudaErrorInvalidDevice, "invalid device ordinal")                                                 \
  X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                        \
  X(cudaErrorIllegalState, "the operation cannot be performed in the present state")                  \
  X(cudaErrorNotReady, "device not ready")                                                            \
  X(cudaErrorNotSupported, "operation not supported")                                                 \
  X(cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing")            \
  X(cudaErrorStreamCaptureInvalidated, "operation failed due to a previous error during capture")     \
  X(cudaErrorStreamCaptureMerge, "operation would result in a merge of separate capture sequences")   \
  X(cudaErrorStreamCaptureUnmatched, "capture was not ended in the same stream as it began")          \
  X(cudaErrorStreamCaptureUnjoined, "capturing stream has unjoined work")                             \
  X(cudaErrorStreamCaptureIsolation, "dependency created on uncaptured work in another stream")       \
  X(cudaErrorStreamCaptureImplicit, "operation would make the legacy stream depend on a capturing blocking stream") \
  X(cudaErrorCapturedEvent, "operation not permitted on an event last recorded in a capturing stream") \
  X(cudaErrorStreamCaptureWrongThread, "attempt to terminate a thread-local capture sequence from another thread") \
  X(cudaErrorUnknown, "unknown error")

const char *cudaGetErrorString(cudaError_t error) {
#define AS_STRING(code, text) \
  case code:                  \
    return text;
  switch (error) { ERRORS(AS_STRING) default: return "unrecognized error code"; }
#undef AS_STRING
}

const char *cudaGetErrorName(cudaError_t error) {
#define AS_NAME(code, text) \
  case code:                \
    return #code;
  switch (error) { ERRORS(AS_NAME) default: return "unrecognized error code"; }
#undef AS_NAME
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = tls_last;
  tls_last = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return tls_last; }

cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
  if (!runtimeVersion) return ret(cudaErrorInvalidValue);
  *runtimeVersion = FAKE_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *driverVersion) {
  if (!driverVersion) return ret(cudaErrorInvalidValue);
  *driverVersion = FAKE_VERSION;
  return cudaSuccess;
}

/* ---- devices ------------------------------------------------------------- */

cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return ret(cudaErrorInvalidValue);
  lock();
  *count = g.ndev;
  unlock();
  return ret(*count ? cudaSuccess : cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  lock();
  cudaError_t e = device_ok(device);
  unlock();
  if (e == cudaSuccess) tls_device = device;
  return ret(e);
}

cudaError_t cudaGetDevice(int *device) {
  if (!device) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = g.ndev == 0 ? cudaErrorNoDevice : cudaSuccess;
  unlock();
  if (e == cudaSuccess) *device = tls_device;
  return ret(e);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  if (!prop) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = device_ok(device);
  size_t total = g.limit ? g.limit : (size_t)80 << 30;
  unlock();
  if (e != cudaSuccess) return ret(e);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "tccomm fake GPU %d", device);
  prop->totalGlobalMem = total;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->pciBusID = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
  if (leastPriority) *leastPriority = 0;
  if (greatestPriority) *greatestPriority = -5;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  lock();
  cudaError_t e = need_device();
  if (e == cudaSuccess) e = unsafe_check();
  if (e == cudaSuccess) {
    const unsigned long long stamp = g.stamp;
    for (;;) {
      int busy = 0;
      for (struct CUstream_st *s = g.all; s && !busy; s = s->all_next)
        busy = s->device == tls_device && busy_until(s, stamp);
      if (!busy) break;
      pthread_cond_wait(&g.done_cv, &g.lock);
    }
  }
  unlock();
  return ret(e);
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  if (!free_bytes || !total) return ret(cudaErrorInvalidValue);
  lock();
  *total = g.limit ? g.limit : (size_t)80 << 30;
  *free_bytes = *total > g.bytes ? *total - g.bytes : 0;
  unlock();
  return cudaSuccess;
}

/* ---- memory -------------------------------------------------------------- */

cudaError_t cudaMalloc(void **devPtr, size_t size) {
  if (!devPtr) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = need_device();
  if (e == cudaSuccess) e = unsafe_check();
  if (e == cudaSuccess) e = mem_alloc(devPtr, size, NULL);
  unlock();
  return ret(e);
}

cudaError_t cudaFree(void *devPtr) {
  lock();
  cudaError_t e = unsafe_check();
  struct reg *r = e == cudaSuccess && devPtr ? reg_find(devPtr, R_MEM) : NULL;
  if (e == cudaSuccess && devPtr) {
    if (!r || r->owner || r->freeing) {
      e = cudaErrorInvalidValue; /* unknown, the graph's, or already being freed */
    } else {
      /* cudaFree synchronizes the device: work still using the memory finishes first. */
      const unsigned long long stamp = g.stamp;
      const int dev = r->device;
      r->freeing = 1;
      for (;;) {
        int busy = 0;
        for (struct CUstream_st *s = g.all; s && !busy; s = s->all_next)
          busy = s->device == dev && busy_until(s, stamp);
        if (!busy) break;
        pthread_cond_wait(&g.done_cv, &g.lock);
      }
      mem_release(devPtr);
    }
  }
  unlock();
  return ret(e);
}

cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream) {
  if (!devPtr) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(hStream, &e);
  if (s && s->cap) {
    if (s->cap->invalidated) {
      e = cudaErrorStreamCaptureInvalidated;
    } else {
      /* Allocated now, owned by the graph: the same memory at every replay. */
      struct body *b = s->cap->graph->body;
      e = mem_alloc(devPtr, size, b);
      if (e == cudaSuccess) {
        b->mem_nodes = 1;
        cap_node(s, NULL);
      }
    }
  } else if (s) {
    e = mem_alloc(devPtr, size, NULL); /* stream order is kept trivially: it exists from now on */
  }
  unlock();
  return ret(e);
}

cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(hStream, &e);
  struct reg *r = s && devPtr ? reg_find(devPtr, R_MEM) : NULL;
  if (!s || !devPtr) {
    /* an invalid stream, or nothing to free */
  } else if (!r || r->freeing) {
    e = cudaErrorInvalidValue;
  } else if (s->cap) {
    struct body *b = s->cap->graph->body;
    if (s->cap->invalidated) {
      e = cudaErrorStreamCaptureInvalidated;
    } else if (r->owner && r->owner != b) {
      e = cudaErrorInvalidValue;
    } else {
      /* A free node does nothing at replay: the memory goes with the graph. */
      r->owner = b;
      r->freeing = 1;
      b->mem_nodes = 1;
      cap_node(s, NULL);
    }
  } else if (r->owner) {
    e = cudaErrorInvalidValue; /* a graph's memory is freed with the graph */
  } else {
    struct entry *en = entry_new(E_FREE);
    en->dst = devPtr;
    r->freeing = 1;
    push(s, en);
  }
  unlock();
  return ret(e);
}

static int bad_kind(enum cudaMemcpyKind kind) {
  return (int)kind < (int)cudaMemcpyHostToHost || (int)kind > (int)cudaMemcpyDefault;
}

/* A synchronous copy or fill: on the legacy stream, waited for. */
static cudaError_t sync_op(const struct entry *tmpl) {
  lock();
  cudaError_t e = unsafe_check();
  struct CUstream_st *s = e == cudaSuccess ? stream_of(NULL, &e) : NULL;
  if (s && tmpl->bytes) {
    e = submit(NULL, tmpl);
    if (e == cudaSuccess) wait_stream(s, g.stamp);
  }
  unlock();
  return ret(e);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  if (bad_kind(kind) || (count && (!dst || !src))) return ret(cudaErrorInvalidValue);
  struct entry t = {.kind = E_COPY, .dst = dst, .src = src, .bytes = count};
  return sync_op(&t);
}

cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  if (count && !devPtr) return ret(cudaErrorInvalidValue);
  struct entry t = {.kind = E_SET, .dst = devPtr, .value = value, .bytes = count};
  return sync_op(&t);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
  if (bad_kind(kind) || (count && (!dst || !src))) return ret(cudaErrorInvalidValue);
  struct entry t = {.kind = E_COPY, .dst = dst, .src = src, .bytes = count};
  lock();
  cudaError_t e = submit(stream, &t);
  unlock();
  return ret(e);
}

cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
  if (count && !devPtr) return ret(cudaErrorInvalidValue);
  struct entry t = {.kind = E_SET, .dst = devPtr, .value = value, .bytes = count};
  lock();
  cudaError_t e = submit(stream, &t);
  unlock();
  return ret(e);
}

/* ---- streams ------------------------------------------------------------- */

static cudaError_t stream_create(cudaStream_t *pStream, unsigned int flags, int priority) {
  if (!pStream || (flags & ~(unsigned)cudaStreamNonBlocking)) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = need_device();
  if (e == cudaSuccess) e = unsafe_check();
  struct CUstream_st *s = e == cudaSuccess ? stream_new(tls_device, flags, priority, 0, &e) : NULL;
  unlock();
  if (s) *pStream = s;
  return ret(e);
}

cudaError_t cudaStreamCreate(cudaStream_t *pStream) { return stream_create(pStream, cudaStreamDefault, 0); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
  return stream_create(pStream, flags, 0);
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags, int priority) {
  return stream_create(pStream, flags, priority < -5 ? -5 : priority > 0 ? 0 : priority);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  struct later *later = NULL;
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(stream, R_STREAM)) {
    e = cudaErrorInvalidResourceHandle; /* including the legacy stream */
  } else {
    struct CUstream_st *s = stream;
    if (s->cap) {
      struct capture *c = s->cap;
      if (c->origin == s) {
        graph_free(cap_end(c), &later); /* nobody can end it any more */
      } else {
        c->invalidated = 1;
        c->streams[s->cap_idx] = NULL;
        cap_leave(s);
      }
    }
    reg_del(s, R_STREAM);
    s->destroyed = 1; /* the worker drains the queue, then exits */
    pthread_cond_signal(&s->work_cv);
    stream_unref(s);
  }
  unlock();
  run_later(later);
  return ret(e);
}

/* The stream for a call that observes it from the host (synchronize,
 * query): refused on a capturing stream, which it invalidates, and where
 * the capture rules forbid such calls. Caller holds the lock. */
static struct CUstream_st *observed_stream(cudaStream_t stream, cudaError_t *e) {
  struct CUstream_st *s = stream_of(stream, e);
  if (s && s->cap) {
    s->cap->invalidated = 1;
    *e = cudaErrorStreamCaptureUnsupported;
  }
  if (s && *e == cudaSuccess) *e = unsafe_check();
  return *e == cudaSuccess ? s : NULL;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = observed_stream(stream, &e);
  if (s) wait_stream(s, g.stamp);
  unlock();
  return ret(e);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = observed_stream(stream, &e);
  if (s && s->pending) e = cudaErrorNotReady;
  unlock();
  return ret(e);
}

cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int *device) {
  if (!device) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(hStream, &e);
  if (s) *device = s->device;
  unlock();
  return ret(e);
}

cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int *flags) {
  if (!flags) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(hStream, &e);
  if (s) *flags = s->flags;
  unlock();
  return ret(e);
}

cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int *priority) {
  if (!priority) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(hStream, &e);
  if (s) *priority = s->priority;
  unlock();
  return ret(e);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
  if (!fn) return ret(cudaErrorInvalidValue);
  struct entry t = {.kind = E_HOST, .fn = fn, .arg = userData};
  lock();
  cudaError_t e = submit(stream, &t);
  unlock();
  return ret(e);
}

cudaError_t fake_cuda_enqueue(cudaStream_t stream, const fake_task_t *task) {
  if (!task || !task->step) return ret(cudaErrorInvalidValue);
  struct entry t = {.kind = E_TASK, .task = *task, .owns_task = 1};
  lock();
  cudaError_t e = submit(stream, &t);
  unlock();
  return ret(e);
}

/* ---- events -------------------------------------------------------------- */

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (!event || (flags & ~known) || ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)))
    return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = need_device();
  if (e == cudaSuccess) e = unsafe_check();
  if (e == cudaSuccess) {
    struct CUevent_st *ev = xzalloc(sizeof *ev);
    ev->device = tls_device;
    ev->flags = flags;
    reg_add(ev, R_EVENT);
    *event = ev;
  }
  unlock();
  return ret(e);
}

cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUevent_st *ev = event_of(event, &e);
  if (ev) {
    /* A pending record holds its mark, not the event: destroying is legal. */
    reg_del(ev, R_EVENT);
    mark_unref(ev->mark);
    free(ev->cap_vc);
    free(ev);
  }
  unlock();
  return ret(e);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  struct CUevent_st *ev = s ? event_of(event, &e) : NULL;
  if (!ev) {
    /* e says why */
  } else if (ev->device != s->device) {
    e = cudaErrorInvalidResourceHandle; /* an event records only on its own device's streams */
  } else if (s->cap && s->cap->invalidated) {
    e = cudaErrorStreamCaptureInvalidated;
  } else {
    mark_unref(ev->mark);
    ev->mark = NULL;
    free(ev->cap_vc);
    ev->cap_vc = NULL;
    ev->cap_id = 0;
    if (s->cap) {
      /* Nothing at replay: the record only carries the position in the capture. */
      ev->cap_id = s->cap->id;
      ev->cap_n = s->cap->n;
      ev->cap_vc = xalloc(NULL, (size_t)ev->cap_n * sizeof(int));
      memcpy(ev->cap_vc, s->vc, (size_t)ev->cap_n * sizeof(int));
    } else {
      struct entry *en = entry_new(E_RECORD);
      en->mark = ev->mark = mark_new(2);
      push(s, en);
    }
  }
  unlock();
  return ret(e);
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  if (flags & ~(unsigned)cudaEventRecordExternal) return ret(cudaErrorInvalidValue);
  return cudaEventRecord(event, stream); /* external record nodes are not modelled */
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUevent_st *ev = event_of(event, &e);
  if (ev) e = unsafe_check();
  if (ev && e == cudaSuccess) {
    if (ev->cap_id)
      e = cudaErrorCapturedEvent;
    else if (ev->mark && !ev->mark->done)
      e = cudaErrorNotReady;
  }
  unlock();
  return ret(e);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUevent_st *ev = event_of(event, &e);
  if (ev) e = unsafe_check();
  if (ev && e == cudaSuccess) {
    if (ev->cap_id) {
      e = cudaErrorCapturedEvent;
    } else if (ev->mark && !ev->mark->done) {
      struct mark *m = ev->mark;
      m->refs++; /* the event may be destroyed or re-recorded meanwhile */
      while (!m->done) pthread_cond_wait(&g.done_cv, &g.lock);
      mark_unref(m);
    }
  }
  unlock();
  return ret(e);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (flags & ~(unsigned)cudaEventWaitExternal) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  struct CUevent_st *ev = s ? event_of(event, &e) : NULL;
  struct capture *c = s ? s->cap : NULL;
  if (!ev) {
    /* e says why */
  } else if (c && c->invalidated) {
    e = cudaErrorStreamCaptureInvalidated;
  } else if (ev->cap_id) {
    struct capture *ec = cap_find(ev->cap_id);
    if (c && ec == c) {
      vc_merge(s, ev->cap_vc, ev->cap_n); /* a dependency inside the capture */
    } else if (c) {
      c->invalidated = 1;
      if (ec) ec->invalidated = 1;
      e = ec ? cudaErrorStreamCaptureMerge : cudaErrorStreamCaptureIsolation;
    } else if (!ec) {
      e = cudaErrorCapturedEvent; /* its capture has ended */
    } else if (ec->invalidated) {
      e = cudaErrorStreamCaptureInvalidated;
    } else if (s->legacy) {
      ec->invalidated = 1;
      e = cudaErrorStreamCaptureUnsupported;
    } else {
      /* A fork: `s` joins the capture, unjoined until the origin waits on it. */
      cap_add_stream(ec, s);
      vc_merge(s, ev->cap_vc, ev->cap_n);
      s->vc[s->cap_idx] = 1;
    }
  } else if (!ev->mark) {
    /* never recorded: nothing to wait for */
  } else if (c) {
    c->invalidated = 1;
    e = cudaErrorStreamCaptureIsolation;
  } else if (!ev->mark->done) {
    struct entry *en = entry_new(E_WAIT);
    en->mark = ev->mark;
    ev->mark->refs++;
    push(s, en);
  }
  unlock();
  return ret(e);
}

/* ---- capture ------------------------------------------------------------- */

static int bad_mode(enum cudaStreamCaptureMode m) {
  return m != cudaStreamCaptureModeGlobal && m != cudaStreamCaptureModeThreadLocal &&
         m != cudaStreamCaptureModeRelaxed;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  if (!mode || bad_mode(*mode)) return ret(cudaErrorInvalidValue);
  enum cudaStreamCaptureMode old = tls_mode;
  tls_mode = *mode;
  *mode = old;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  if (bad_mode(mode)) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  if (s && s->legacy) {
    e = cudaErrorStreamCaptureUnsupported;
  } else if (s && s->cap) {
    e = cudaErrorIllegalState;
  } else if (s) {
    struct capture *c = xzalloc(sizeof *c);
    c->id = ++g.next_cap_id;
    c->mode = mode;
    c->owner = my_id();
    c->origin = s;
    c->graph = graph_new();
    c->graph->capturing = 1;
    cap_add_stream(c, s);
    c->next = g.captures;
    g.captures = c;
  }
  unlock();
  return ret(e);
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph) {
  if (!pGraph) return ret(cudaErrorInvalidValue);
  *pGraph = NULL;
  struct later *later = NULL;
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  struct capture *c = s ? s->cap : NULL;
  if (s && !c) {
    e = cudaErrorIllegalState;
  } else if (c && c->mode != cudaStreamCaptureModeRelaxed && c->owner != my_id()) {
    e = cudaErrorStreamCaptureWrongThread; /* the capture goes on */
  } else if (c) {
    if (c->origin != s)
      e = cudaErrorStreamCaptureUnmatched;
    else if (c->invalidated)
      e = cudaErrorStreamCaptureInvalidated;
    else if (cap_unjoined(c))
      e = cudaErrorStreamCaptureUnjoined;
    struct CUgraph_st *gr = cap_end(c); /* in every case */
    if (e == cudaSuccess)
      *pGraph = gr;
    else
      graph_free(gr, &later);
  }
  unlock();
  run_later(later);
  return ret(e);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *pCaptureStatus) {
  if (!pCaptureStatus) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  if (s)
    *pCaptureStatus = !s->cap               ? cudaStreamCaptureStatusNone
                      : s->cap->invalidated ? cudaStreamCaptureStatusInvalidated
                                            : cudaStreamCaptureStatusActive;
  unlock();
  return ret(e);
}

/* The graph being built is reported; its dependency set is not (NULL, 0). */
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus *captureStatus_out,
                                     unsigned long long *id_out, cudaGraph_t *graph_out,
                                     const cudaGraphNode_t **dependencies_out, const cudaGraphEdgeData **edgeData_out,
                                     size_t *numDependencies_out) {
  if (!captureStatus_out) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  if (s) {
    struct capture *c = s->cap;
    *captureStatus_out = !c                ? cudaStreamCaptureStatusNone
                         : c->invalidated ? cudaStreamCaptureStatusInvalidated
                                          : cudaStreamCaptureStatusActive;
    if (id_out) *id_out = c ? c->id : 0;
    if (graph_out) *graph_out = c ? c->graph : NULL;
    if (dependencies_out) *dependencies_out = NULL;
    if (edgeData_out) *edgeData_out = NULL;
    if (numDependencies_out) *numDependencies_out = 0;
  }
  unlock();
  return ret(e);
}

/* ---- graphs -------------------------------------------------------------- */

cudaError_t cudaGraphCreate(cudaGraph_t *pGraph, unsigned int flags) {
  if (!pGraph || flags) return ret(cudaErrorInvalidValue);
  lock();
  *pGraph = graph_new();
  unlock();
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  struct later *later = NULL;
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(graph, R_GRAPH))
    e = cudaErrorInvalidValue;
  else if (graph->capturing)
    e = cudaErrorIllegalState; /* still owned by its capture */
  else
    graph_free(graph, &later);
  unlock();
  run_later(later);
  return ret(e);
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph, unsigned long long flags) {
  (void)flags;
  if (!pGraphExec) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(graph, R_GRAPH) || graph->capturing) {
    e = cudaErrorInvalidValue;
  } else if (graph->body->mem_nodes && graph->body->execs) {
    e = cudaErrorInvalidValue; /* with memory nodes, one exec at a time */
  } else {
    struct CUgraphExec_st *x = xzalloc(sizeof *x);
    x->body = graph->body;
    x->body->refs++;
    x->body->execs++;
    x->refs = 1;
    /* The exec's own references: the objects outlive the graph while it exists. */
    for (struct uref *u = graph->urefs; u; u = u->next) {
      if (!u->count) continue;
      u->obj->refs += u->count;
      uref_add(&x->urefs, u->obj, u->count);
    }
    reg_add(x, R_EXEC);
    *pGraphExec = x;
  }
  unlock();
  return ret(e);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  struct later *later = NULL;
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(graphExec, R_EXEC)) {
    e = cudaErrorInvalidValue;
  } else {
    reg_del(graphExec, R_EXEC);
    graphExec->body->execs--;
    exec_unref(graphExec, &later); /* launches in flight keep it until they end */
  }
  unlock();
  run_later(later);
  return ret(e);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  struct CUgraphExec_st *x = graphExec;
  if (s && !reg_find(x, R_EXEC)) {
    e = cudaErrorInvalidValue;
  } else if (s && s->cap) {
    /* Child graphs are not modelled: launching into a capture is refused. */
    e = s->cap->invalidated ? cudaErrorStreamCaptureInvalidated : cudaErrorStreamCaptureUnsupported;
    s->cap->invalidated = 1;
  } else if (s) {
    if (x->last && !x->last->done) { /* after the exec's previous launch, wherever it runs */
      struct entry *w = entry_new(E_WAIT);
      w->mark = x->last;
      x->last->refs++;
      push(s, w);
    }
    for (size_t i = 0; i < x->body->n; i++) {
      struct entry *en = entry_new(x->body->nodes[i].kind);
      *en = x->body->nodes[i]; /* owns_task is 0: the body releases the task */
      push(s, en);
    }
    struct entry *end = entry_new(E_LAUNCH_END);
    end->mark = mark_new(2);
    end->exec = x;
    x->refs++;
    mark_unref(x->last);
    x->last = end->mark;
    push(s, end);
  }
  unlock();
  return ret(e);
}

/* ---- user objects -------------------------------------------------------- */

cudaError_t cudaUserObjectCreate(cudaUserObject_t *object_out, void *ptr, cudaHostFn_t destroy,
                                 unsigned int initialRefcount, unsigned int flags) {
  if (!object_out || !destroy || !initialRefcount || flags != cudaUserObjectNoDestructorSync)
    return ret(cudaErrorInvalidValue);
  lock();
  struct CUuserObject_st *o = xzalloc(sizeof *o);
  o->ptr = ptr;
  o->destroy = destroy;
  o->refs = initialRefcount;
  reg_add(o, R_UOBJ);
  atomic_fetch_add(&uobj_alive, 1);
  *object_out = o;
  unlock();
  return cudaSuccess;
}

cudaError_t cudaUserObjectRetain(cudaUserObject_t object, unsigned int count) {
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(object, R_UOBJ))
    e = cudaErrorInvalidResourceHandle;
  else if (!count)
    e = cudaErrorInvalidValue;
  else
    object->refs += count;
  unlock();
  return ret(e);
}

cudaError_t cudaUserObjectRelease(cudaUserObject_t object, unsigned int count) {
  struct later *later = NULL;
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(object, R_UOBJ))
    e = cudaErrorInvalidResourceHandle;
  else if (!count || count > object->refs)
    e = cudaErrorInvalidValue;
  else
    uobj_release(object, count, &later);
  unlock();
  run_later(later);
  return ret(e);
}

cudaError_t cudaGraphRetainUserObject(cudaGraph_t graph, cudaUserObject_t object, unsigned int count,
                                      unsigned int flags) {
  if (!count || (flags & ~(unsigned)cudaGraphUserObjectMove)) return ret(cudaErrorInvalidValue);
  lock();
  cudaError_t e = cudaSuccess;
  if (!reg_find(graph, R_GRAPH)) {
    e = cudaErrorInvalidValue;
  } else if (!reg_find(object, R_UOBJ)) {
    e = cudaErrorInvalidResourceHandle;
  } else if ((flags & cudaGraphUserObjectMove) && count > object->refs) {
    e = cudaErrorInvalidValue; /* cannot move references the caller does not have */
  } else {
    if (!(flags & cudaGraphUserObjectMove)) object->refs += count;
    uref_add(&graph->urefs, object, count);
  }
  unlock();
  return ret(e);
}

cudaError_t cudaGraphReleaseUserObject(cudaGraph_t graph, cudaUserObject_t object, unsigned int count) {
  struct later *later = NULL;
  lock();
  cudaError_t e = cudaErrorInvalidValue;
  if (count && reg_find(graph, R_GRAPH)) {
    for (struct uref *u = graph->urefs; u; u = u->next) {
      if (u->obj == object && u->count >= count) {
        u->count -= count;
        uobj_release(object, count, &later);
        e = cudaSuccess;
        break;
      }
    }
  }
  unlock();
  run_later(later);
  return ret(e);
}

/* ---- the controls of fake_gpu.h ------------------------------------------ */

void fake_cuda_set_device_count(int n) {
  lock();
  g.ndev = n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
  unlock();
}

void fake_cuda_set_delay_us(int max_us) {
  lock();
  g.delay_us = max_us < 0 ? 0 : max_us;
  unlock();
}

size_t fake_cuda_bytes_in_use(void) {
  lock();
  size_t n = g.bytes;
  unlock();
  return n;
}

void fake_cuda_set_memory_limit(size_t bytes) {
  lock();
  g.limit = bytes;
  unlock();
}

int fake_cuda_user_objects_alive(void) { return atomic_load(&uobj_alive); }

int fake_cuda_stream_pending(cudaStream_t stream) {
  lock();
  cudaError_t e = cudaSuccess;
  struct CUstream_st *s = stream_of(stream, &e);
  int n = s ? s->pending : 0;
  unlock();
  return n;
}
