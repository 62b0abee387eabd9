/*
 * comm.c - the NCCL side of a communicator: its per-communicator state,
 * setting NCCL up on the first CUDA op, tearing it down, and the public
 * CUDA calls.
 *
 * The state is made at the first CUDA op and holds no NCCL communicator
 * yet. The group's communicator is made at the first collective (or group
 * of ops, or tcc_comm_cuda_init): rank 0 creates the ncclUniqueId and
 * broadcasts it over the group's own host path (the host executor), so
 * NCCL needs no store of its own. A send/recv outside a group uses a
 * two-rank communicator with its peer instead, made at their first one:
 * the lower rank sends the id over the host path, so ranks that take no
 * part are not needed. Every setup is bounded by the op's deadline.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/idle_wait.h"
#include "nccl/nccl_state.h"

int tcc_cuda_built(void) { return 1; }
int tcc_nccl_header_version(void) { return NCCL_VERSION_CODE; }

tcc_result_t tcc_nccl_runtime_version(int *version) {
  tcc_err_t err = {TCC_OK, {0}};
  const tcc__nccl_lib_t *lib = tcc__nccl_lib(&err);
  *version = lib ? lib->version : 0;
  return lib ? TCC_OK : tcc__fail_with(&err, err.code);
}

cudaError_t tcc__cuda_enter_device(int device, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e != cudaSuccess) return e;
  return *prev == device ? cudaSuccess : cudaSetDevice(device);
}

void tcc__cuda_leave_device(int device, int prev) {
  if (prev != device) cudaSetDevice(prev);
}

#define PAIR_ID_TAG 0xFFFFFFFFFFFF0C1DULL /* the core's own tag: user tags are torch ints */

/* Shares a fresh ncclUniqueId made by one rank, over the host path: rank 0
 * broadcasts it to the group (peer < 0), or the lower rank of a pair sends
 * it to `peer`. A status byte goes with it: the maker may fail to make
 * one, and the others must hear that rather than time out. */
static tcc_result_t share_id(tcc_comm_t *comm, const tcc__nccl_lib_t *lib, int peer, int64_t deadline_ns,
                             ncclUniqueId *id, tcc_err_t *err) {
  const int maker = peer < 0 ? 0 : comm->rank < peer ? comm->rank : peer;
  char with[32] = "";
  if (peer >= 0) snprintf(with, sizeof with, " with rank %d", peer);
  uint8_t msg[1 + sizeof(ncclUniqueId)];
  memset(msg, 0, sizeof msg);
  ncclResult_t nr = ncclSuccess;
  if (comm->rank == maker) {
    nr = lib->GetUniqueId(id);
    msg[0] = nr == ncclSuccess ? 1 : 0;
    if (nr == ncclSuccess) memcpy(msg + 1, id, sizeof *id);
  }
  tcc_buf_t b = {msg, sizeof msg, TCC_UINT8, -1, NULL};
  const int64_t left_ms = (deadline_ns - tcc__now_ns()) / 1000000;
  tcc_op_opts_t opts = {.timeout_ms = left_ms > 0 ? left_ms : 1, .premul_factor = 0};
  tcc_op_t *op = NULL;
  tcc_result_t r = peer < 0             ? tcc_broadcast(comm, b, 0, &opts, &op)
                   : comm->rank == maker ? tcc_send(comm, b, peer, PAIR_ID_TAG, &opts, &op)
                                         : tcc_recv(comm, b, peer, PAIR_ID_TAG, &opts, &op);
  if (r != TCC_OK)
    return tcc__err_set(err, r, "tccomm '%s' (rank %d): sharing the NCCL unique id%s failed: %s", comm->name,
                        comm->rank, with, tcc_last_error());
  r = tcc_op_wait(op, -1);
  if (r != TCC_OK)
    tcc__err_set(err, r, "tccomm '%s' (rank %d): sharing the NCCL unique id%s failed: %s", comm->name, comm->rank,
                 with, tcc_op_error(op));
  tcc_op_release(op);
  if (r != TCC_OK) return r;
  if (msg[0] != 1)
    return tcc__err_set(err, TCC_ERR_REMOTE, "tccomm '%s' (rank %d): rank %d could not create an NCCL unique id%s%s",
                        comm->name, comm->rank, maker, comm->rank == maker ? ": " : "",
                        comm->rank == maker ? lib->GetErrorString(nr) : "");
  memcpy(id, msg + 1, sizeof *id);
  return TCC_OK;
}

static void free_state(struct tcc__cuda *c) {
  if (c->order_event) cudaEventDestroy(c->order_event);
  free(c->pairs);
  free(c->pair_ready);
  free(c);
}

/* The local part of the CUDA state: device checks, the ordering event,
 * the watchdog. Caller holds the issue lock. */
static tcc_result_t cuda_state_create(tcc_comm_t *comm, int device, tcc_err_t *err) {
  const tcc__nccl_lib_t *lib = tcc__nccl_lib(err);
  if (!lib) return err->code;
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0)
    return tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm '%s' (rank %d): no usable CUDA device: %s", comm->name,
                       comm->rank, e != cudaSuccess ? cudaGetErrorString(e) : "the device count is 0");
  if (device < 0 || device >= ndev)
    return tcc__err_set(err, TCC_ERR_INVALID, "tccomm '%s' (rank %d): CUDA device %d does not exist (%d visible)",
                       comm->name, comm->rank, device, ndev);
  struct tcc__cuda *c = calloc(1, sizeof *c);
  if (c) c->pairs = calloc((size_t)comm->size, sizeof *c->pairs);
  if (c) c->pair_ready = calloc((size_t)comm->size, sizeof *c->pair_ready);
  if (!c || !c->pairs || !c->pair_ready) {
    if (c) free_state(c);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  }
  c->nccl = lib;
  c->device = device;
  c->size = comm->size;
  atomic_init(&c->refs, 1);
  const char *policy = getenv("TCCOMM_ASYNC_ERROR_HANDLING");
  c->tear_down = !(policy && (strcmp(policy, "0") == 0 || strcmp(policy, "2") == 0));
  int prev = device;
  e = tcc__cuda_enter_device(device, &prev);
  if (e == cudaSuccess) {
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed; /* legal while the caller captures */
    cudaThreadExchangeStreamCaptureMode(&mode);
    e = cudaEventCreateWithFlags(&c->order_event, cudaEventDisableTiming);
    cudaThreadExchangeStreamCaptureMode(&mode);
  }
  tcc__cuda_leave_device(device, prev);
  if (e != cudaSuccess) {
    free_state(c);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): setting up CUDA device %d failed: %s",
                       comm->name, comm->rank, device, cudaGetErrorString(e));
  }
  atomic_store(&nccl_comm_of(comm)->state, c); /* before the watchdog starts: it reads it */
  tcc_result_t r = tcc__cuda_watch_start(comm, c, err);
  if (r != TCC_OK) {
    atomic_store(&nccl_comm_of(comm)->state, NULL);
    free_state(c);
  }
  return r;
}

struct tcc__cuda *tcc__cuda_state_for(tcc_comm_t *comm, int device, const char *what, tcc_err_t *err) {
  struct tcc__cuda *c = nccl_state_of(comm);
  if (!c) {
    if (cuda_state_create(comm, device, err) != TCC_OK) return NULL;
    c = nccl_state_of(comm);
  }
  if (c->device != device) {
    tcc__err_set(err, TCC_ERR_INVALID,
                "tccomm %s on '%s' (rank %d): the buffers are on CUDA device %d but this group uses device %d "
                "(one device per process and group)",
                what, comm->name, comm->rank, device, c->device);
    return NULL;
  }
  return c;
}

static tcc_result_t ncomm_setup(tcc_comm_t *comm, struct tcc__cuda *c, tcc__ncomm_t *nc, const char *label, int nranks,
                                const ncclUniqueId *id, int rank, const char *what, int64_t deadline_ns,
                                tcc_err_t *err) {
  int prev = c->device;
  cudaError_t e = tcc__cuda_enter_device(c->device, &prev);
  if (e != cudaSuccess)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): cannot use CUDA device %d: %s", what,
                        comm->name, comm->rank, c->device, cudaGetErrorString(e));
  tcc_result_t r = tcc__ncomm_create(nc, comm, c->nccl, label, nranks, id, rank, what, deadline_ns, err);
  tcc__cuda_leave_device(c->device, prev);
  return r;
}

tcc__ncomm_t *tcc__cuda_group_ncomm(tcc_comm_t *comm, struct tcc__cuda *c, const char *what, int64_t deadline_ns,
                                  tcc_err_t *err) {
  if (atomic_load(&c->coll_ready)) return &c->coll;
  ncclUniqueId id;
  if (share_id(comm, c->nccl, -1, deadline_ns, &id, err) != TCC_OK) return NULL;
  char label[64];
  snprintf(label, sizeof label, "the group's NCCL communicator");
  if (ncomm_setup(comm, c, &c->coll, label, comm->size, &id, comm->rank, what, deadline_ns, err) != TCC_OK) return NULL;
  atomic_store(&c->coll_ready, 1);
  return &c->coll;
}

tcc__ncomm_t *tcc__cuda_pair_ncomm(tcc_comm_t *comm, struct tcc__cuda *c, int peer, const char *what, int64_t deadline_ns,
                                 tcc_err_t *err) {
  if (atomic_load(&c->pair_ready[peer])) return &c->pairs[peer];
  ncclUniqueId id;
  if (share_id(comm, c->nccl, peer, deadline_ns, &id, err) != TCC_OK) return NULL;
  char label[64];
  snprintf(label, sizeof label, "the NCCL communicator with rank %d", peer);
  if (ncomm_setup(comm, c, &c->pairs[peer], label, 2, &id, comm->rank < peer ? 0 : 1, what, deadline_ns, err) != TCC_OK)
    return NULL;
  atomic_store(&c->pair_ready[peer], 1);
  return &c->pairs[peer];
}

/* Why the split cannot be made, or NULL: the caller's arguments. */
static const char *split_misuse(tcc_comm_t *parent, int color, tcc_comm_t *child) {
  if (color < TCC_SPLIT_NOCOLOR) return "the color must be >= 0, or TCC_SPLIT_NOCOLOR";
  if ((color == TCC_SPLIT_NOCOLOR) != (child == NULL))
    return child ? "a rank with a child must give it a color" : "a rank with a color must give its child";
  if (child == parent) return "the child is the parent itself";
  return NULL;
}

tcc_result_t tcc_comm_cuda_split(tcc_comm_t *parent, int color, tcc_comm_t *child, int *split_done) {
  const char *what = "cuda_split";
  tcc_err_t err = {TCC_OK, {0}};
  if (split_done) *split_done = 0;
  const char *misuse = split_misuse(parent, color, child);
  if (misuse)
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s' (rank %d): %s (color %d)", what, parent->name, parent->rank,
                     misuse, color);
  pthread_mutex_lock(&nccl_comm_of(parent)->lock);
  struct tcc__cuda *pc = nccl_state_of(parent);
  /* Every rank agrees on this: the group communicator is made by the same
   * collective op on every rank, and ops are issued in the same order. */
  if (!pc || !atomic_load(&pc->coll_ready) || !pc->nccl->CommSplit) {
    pthread_mutex_unlock(&nccl_comm_of(parent)->lock);
    return TCC_OK;
  }
  tcc_result_t r = TCC_OK;
  if (pc->nccl_group_open)
    r = tcc__err_set(&err, TCC_ERR_INVALID, "tccomm %s on '%s' (rank %d): a group of ops is open on it", what,
                     parent->name, parent->rank);
  struct tcc__cuda *cc = NULL;
  if (r == TCC_OK && child) {
    pthread_mutex_lock(&nccl_comm_of(child)->lock);
    cc = tcc__cuda_state_for(child, pc->device, what, &err);
    if (cc && atomic_load(&cc->coll_ready))
      tcc__err_set(&err, TCC_ERR_INVALID, "tccomm %s: '%s' (rank %d) already has its NCCL communicator", what,
                   child->name, child->rank);
    r = cc && !atomic_load(&cc->coll_ready) ? TCC_OK : err.code;
  }
  if (r == TCC_OK) {
    int prev = pc->device;
    cudaError_t e = tcc__cuda_enter_device(pc->device, &prev);
    if (e != cudaSuccess)
      r = tcc__err_set(&err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): cannot use CUDA device %d: %s", what,
                       parent->name, parent->rank, pc->device, cudaGetErrorString(e));
    else
      r = tcc__ncomm_split(&pc->coll, cc ? &cc->coll : NULL, child, "the group's NCCL communicator (split)", color,
                           child ? child->rank : 0, what, tcc__deadline_after_ms(atomic_load(&parent->timeout_ms)),
                           &err);
    tcc__cuda_leave_device(pc->device, prev);
    /* A split NCCL started and did not finish leaves the parent's
     * communicator in the middle of it: the parent is unusable. */
    if (e == cudaSuccess && r != TCC_OK && r != TCC_ERR_INVALID && r != TCC_ERR_MISMATCH)
      tcc__comm_fail(parent, r, err.msg);
    if (r == TCC_OK && cc) atomic_store(&cc->coll_ready, 1);
  }
  if (child) pthread_mutex_unlock(&nccl_comm_of(child)->lock);
  pthread_mutex_unlock(&nccl_comm_of(parent)->lock);
  if (r == TCC_OK && split_done) *split_done = 1;
  return r == TCC_OK ? TCC_OK : tcc__fail_with(&err, r);
}

void tcc__cuda_each_ncomm(tcc_comm_t *comm, struct tcc__cuda *c, void (*fn)(tcc__ncomm_t *nc, void *arg), void *arg) {
  (void)comm; /* may be gone: a graph can hold the state longer */
  if (atomic_load(&c->coll_ready)) fn(&c->coll, arg);
  for (int p = 0; p < c->size; p++)
    if (atomic_load(&c->pair_ready[p])) fn(&c->pairs[p], arg);
}

static void free_one(tcc__ncomm_t *nc, void *graceful) { tcc__ncomm_free(nc, *(int *)graceful); }

/* NCCL, the streams and the events; no communicator needed any more. */
static void free_cuda(struct tcc__cuda *c) {
  int prev = c->device;
  tcc__cuda_enter_device(c->device, &prev);
  const int device = c->device;
  tcc__cuda_each_ncomm(NULL, c, free_one, &c->graceful);
  free_state(c);
  tcc__cuda_leave_device(device, prev);
}

static void free_detached(void *arg) { free_cuda(arg); }

/* A graph's user object went (on a CUDA thread, which must make no CUDA
 * call): the last reference hands the freeing to a thread of the core. */
static void graph_released(void *arg) {
  struct tcc__cuda *c = arg;
  if (atomic_fetch_sub(&c->refs, 1) == 1 && tcc_run_detached(free_detached, c) != TCC_OK) {
    /* No thread to run it: NCCL stays for the rest of the process. */
  }
}

tcc_result_t tcc__cuda_keep_for_graph(struct tcc__cuda *c, cudaStream_t stream) {
  enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamGetCaptureInfo(stream, &status, NULL, &graph, NULL, NULL, NULL);
  if (e == cudaSuccess && (status != cudaStreamCaptureStatusActive || !graph)) e = cudaErrorStreamCaptureInvalidated;
  if (e != cudaSuccess) return TCC_ERR_SYSTEM;
  atomic_fetch_add(&c->refs, 1);
  cudaUserObject_t object;
  e = cudaUserObjectCreate(&object, c, graph_released, 1, cudaUserObjectNoDestructorSync);
  if (e != cudaSuccess) {
    atomic_fetch_sub(&c->refs, 1);
    return TCC_ERR_SYSTEM;
  }
  /* The graph takes over our reference; on failure releasing it drops c's. */
  e = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (e != cudaSuccess) {
    cudaUserObjectRelease(object, 1);
    return TCC_ERR_SYSTEM;
  }
  return TCC_OK;
}

void tcc__cuda_state_free(tcc_comm_t *comm, struct tcc__cuda *c) {
  /* Destroyed when NCCL is healthy (destroy always fails the communicator
   * itself, so that says nothing); aborted when something aborted it. */
  c->graceful = !atomic_load(&c->nccl_aborted);
  atomic_store(&nccl_comm_of(comm)->state, NULL);
  if (atomic_fetch_sub(&c->refs, 1) == 1) free_cuda(c);
}

/* ---- public calls ---------------------------------------------------------- */

tcc_result_t tcc_comm_cuda_init(tcc_comm_t *comm, int device) {
  tcc_err_t err = {TCC_OK, {0}};
  pthread_mutex_lock(&nccl_comm_of(comm)->lock);
  struct tcc__cuda *c = tcc__cuda_state_for(comm, device, "cuda_init", &err);
  tcc__ncomm_t *nc = c ? tcc__cuda_group_ncomm(comm, c, "cuda_init", tcc__deadline_after_ms(comm->timeout_ms), &err) : NULL;
  pthread_mutex_unlock(&nccl_comm_of(comm)->lock);
  return nc ? TCC_OK : tcc__fail_with(&err, err.code);
}

int tcc_comm_cuda_device(const tcc_comm_t *comm) {
  struct tcc__cuda *c = nccl_state_of((tcc_comm_t *)comm);
  return c ? c->device : -1;
}

void *tcc_comm_cuda_stream(const tcc_comm_t *comm) {
  struct tcc__cuda *c = nccl_state_of((tcc_comm_t *)comm);
  return c && atomic_load(&c->coll_ready) ? (void *)c->coll.stream : NULL;
}

/* What wait_idle polls: every NCCL stream of the communicator. */
typedef struct idle_check {
  tcc_comm_t *comm;
  struct tcc__cuda *c;
  int stop_on_failure;
  int busy;
  cudaError_t error;
} idle_check_t;

static void check_idle(tcc__ncomm_t *n, void *arg) {
  idle_check_t *check = arg;
  cudaError_t q = cudaStreamQuery(n->stream);
  if (q == cudaErrorNotReady) check->busy = 1;
  else if (q != cudaSuccess && check->error == cudaSuccess) check->error = q;
}

static bool streams_idle(void *arg) {
  idle_check_t *check = arg;
  check->busy = 0;
  tcc__cuda_each_ncomm(check->comm, check->c, check_idle, check);
  return check->error != cudaSuccess || !check->busy;
}

static tcc_result_t comm_usable(void *arg, int64_t now) {
  (void)now;
  const idle_check_t *check = arg;
  return check->stop_on_failure && atomic_load(&check->comm->aborted) ? tcc__comm_failure(check->comm, NULL, 0)
                                                                      : TCC_OK;
}

/* Waits until every NCCL stream of the communicator is idle: TCC_OK, the
 * communicator's failure (if stop_on_failure), TCC_ERR_TIMEOUT at
 * deadline_ns, or TCC_ERR_SYSTEM (*cuda_error says why). Records no error. */
static tcc_result_t wait_idle(tcc_comm_t *comm, struct tcc__cuda *c, int64_t deadline_ns, int stop_on_failure,
                              cudaError_t *cuda_error) {
  int prev = c->device;
  tcc__cuda_enter_device(c->device, &prev);
  /* Relaxed: a stream query is legal while this thread captures a graph. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  idle_check_t check = {comm, c, stop_on_failure, 0, cudaSuccess};
  atomic_uint never_woken = 0; /* streams signal nothing: bounded naps */
  const tcc__idle_wait_t w = {.ready = streams_idle, .check = comm_usable, .arg = &check,
                              .max_nap_ns = 1000 * 1000LL, .deadline_ns = deadline_ns, .word = &never_woken};
  tcc_result_t r = tcc__idle_wait(&w);
  if (r == TCC_OK && check.error != cudaSuccess) {
    *cuda_error = check.error;
    r = TCC_ERR_SYSTEM;
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  tcc__cuda_leave_device(c->device, prev);
  return r;
}

tcc_result_t tcc_comm_cuda_synchronize(tcc_comm_t *comm, int64_t timeout_ms) {
  struct tcc__cuda *c = nccl_state_of(comm);
  if (!c) return TCC_OK;
  const int64_t deadline = tcc__deadline_after_ms(timeout_ms > 0 ? timeout_ms : atomic_load(&comm->timeout_ms));
  cudaError_t e = cudaSuccess;
  const tcc_result_t r = wait_idle(comm, c, deadline, 1, &e);
  if (r == TCC_OK) return TCC_OK;
  if (r == TCC_ERR_SYSTEM)
    return tcc__fail(r, "tccomm '%s' (rank %d): waiting for its CUDA work failed: %s", comm->name, comm->rank,
                     cudaGetErrorString(e));
  if (r == TCC_ERR_TIMEOUT)
    return tcc__fail(r, "tccomm '%s' (rank %d): its CUDA work did not complete in time", comm->name, comm->rank);
  char cause[TCC_ERRLEN];
  tcc__comm_failure(comm, cause, sizeof cause);
  return tcc__fail(r, "tccomm '%s' (rank %d): its CUDA work did not complete: %.400s", comm->name, comm->rank, cause);
}

/* Not stopped by a failure: one that is real makes the watchdog abort
 * NCCL, which idles the streams; one that is not (a peer that finished and
 * left first) must not cut short work that can still complete. */
void tcc__cuda_drain(tcc_comm_t *comm, int64_t grace_ms) {
  struct tcc__cuda *c = comm->device_state ? nccl_state_of(comm) : NULL;
  cudaError_t e = cudaSuccess;
  if (!c) return;
  atomic_store(&c->destroying, 1);
  wait_idle(comm, c, tcc__deadline_after_ms(grace_ms), 0, &e);
}
