/*
 * nccl_ncomm.c - one NCCL communicator as the device executor uses it: created
 * nonblocking, every call bounded by a deadline, abortable from any thread
 * without a lock.
 *
 * Why nonblocking: a blocking NCCL communicator may block inside a call
 * for ever (ncclCommInitRank while a peer never joins, the first use of a
 * connection, an enqueue behind a stuck kernel), and the only way out,
 * ncclCommAbort, could then only come from another thread that must not
 * wait for any lock the stuck thread holds. With config.blocking = 0 every
 * call returns at once, ncclInProgress when NCCL still works on it in the
 * background; the caller then polls ncclCommGetAsyncError against its
 * deadline and the communicator's failure (tcc__ncomm_settle). The mode is
 * set explicitly, so NCCL_COMM_BLOCKING in the environment changes nothing.
 *
 * Abort needs no lock either: `users` counts the threads inside a call on
 * the handle, `aborted` stops new ones. tcc__ncomm_abort raises `aborted`,
 * gives the calls in flight a moment to return (nonblocking calls do), and
 * aborts NCCL, which also releases a call that is stuck inside NCCL anyway.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/idle_wait.h"
#include "core/log.h"
#include "nccl/nccl_state.h"

/* How long abort waits for the calls in flight to leave the handle before
 * it aborts under them (they return at once on a nonblocking communicator;
 * one that does not is stuck, and only the abort releases it). */
#define ABORT_GRACE_NS (100 * 1000 * 1000LL)

/* Naps between polls of a communicator that is still in progress, and of
 * calls that must leave before an abort. */
#define SETTLE_NAP_NS (50 * 1000LL)

static void nap(int64_t ns) {
  struct timespec ts = {0, (long)ns};
  nanosleep(&ts, NULL);
}

int tcc__ncomm_enter(tcc__ncomm_t *nc) {
  atomic_fetch_add(&nc->users, 1);
  if (!atomic_load(&nc->aborted) && atomic_load(&nc->nc)) return 1;
  atomic_fetch_sub(&nc->users, 1);
  return 0;
}

void tcc__ncomm_leave(tcc__ncomm_t *nc) { atomic_fetch_sub(&nc->users, 1); }

tcc_result_t tcc__ncomm_failed(tcc__ncomm_t *nc, const char *what, const char *call, ncclResult_t r, tcc_err_t *err) {
  char last[256] = ""; /* copied while the handle is held: the string goes with it */
  if (nc->nccl->GetLastError && tcc__ncomm_enter(nc)) {
    snprintf(last, sizeof last, "%s", nc->nccl->GetLastError(atomic_load(&nc->nc)));
    tcc__ncomm_leave(nc);
  }
  const tcc_result_t code = r == ncclInvalidArgument || r == ncclInvalidUsage ? TCC_ERR_INVALID : TCC_ERR_SYSTEM;
  return tcc__err_set(err, code, "tccomm %s on '%s' (rank %d): %s failed: %s%s%.200s", what, nc->comm->name,
                      nc->comm->rank, call, nc->nccl->GetErrorString(r), *last ? ": " : "", last);
}

/* What tcc__ncomm_settle polls: NCCL's state of the communicator. */
typedef struct settle {
  tcc__ncomm_t *nc;
  int entered;         /* 0: aborted under us */
  ncclResult_t query;  /* ncclCommGetAsyncError's own result */
  ncclResult_t state;  /* the communicator's */
} settle_t;

static bool settled(void *arg) {
  settle_t *s = arg;
  s->entered = tcc__ncomm_enter(s->nc);
  if (!s->entered) return true;
  s->query = s->nc->nccl->CommGetAsyncError(atomic_load(&s->nc->nc), &s->state);
  tcc__ncomm_leave(s->nc);
  return s->query != ncclSuccess || s->state != ncclInProgress;
}

static tcc_result_t still_usable(void *arg, int64_t now) {
  (void)now;
  const tcc__ncomm_t *nc = ((settle_t *)arg)->nc;
  return atomic_load(&nc->aborted) || atomic_load(&nc->comm->aborted) ? TCC_ERR_ABORTED : TCC_OK;
}

tcc_result_t tcc__ncomm_settle(tcc__ncomm_t *nc, const char *what, const char *call, int64_t deadline_ns,
                              tcc_err_t *err) {
  tcc_comm_t *comm = nc->comm;
  settle_t s = {nc, 1, ncclSuccess, ncclSuccess};
  atomic_uint never_woken = 0; /* NCCL signals nothing: bounded naps */
  const tcc__idle_wait_t w = {.ready = settled, .check = still_usable, .arg = &s, .max_nap_ns = SETTLE_NAP_NS,
                              .deadline_ns = deadline_ns, .word = &never_woken};
  const tcc_result_t r = tcc__idle_wait(&w);
  if (r == TCC_ERR_TIMEOUT)
    return tcc__err_set(err, TCC_ERR_TIMEOUT,
                        "tccomm %s on '%s' (rank %d): %s did not complete in time (%s): a peer may not have "
                        "joined it",
                        what, comm->name, comm->rank, call, nc->label);
  if (r != TCC_OK || !s.entered || still_usable(&s, 0) != TCC_OK) {
    char cause[TCC_ERRLEN];
    tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
    return tcc__err_set(err, code != TCC_OK ? code : TCC_ERR_ABORTED,
                        "tccomm %s on '%s' (rank %d): %s did not complete: %.400s", what, comm->name, comm->rank,
                        call, *cause ? cause : "the communicator was aborted");
  }
  if (s.query != ncclSuccess) return tcc__ncomm_failed(nc, what, "ncclCommGetAsyncError", s.query, err);
  if (s.state != ncclSuccess) return tcc__ncomm_failed(nc, what, call, s.state, err);
  return TCC_OK;
}

/* The first step of making nc: its identity and its stream. The stream
 * exists before NCCL does, so a failed setup leaves nothing else to undo. */
static tcc_result_t ncomm_begin(tcc__ncomm_t *nc, tcc_comm_t *comm, const tcc__nccl_lib_t *lib, const char *label,
                                const char *what, tcc_err_t *err) {
  /* No memset: an abort racing with this setup may already have raised
   * nc->aborted, and the setup must then fail, not forget it. */
  nc->nccl = lib;
  nc->comm = comm;
  snprintf(nc->label, sizeof nc->label, "%s", label);
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t e = cudaStreamCreateWithFlags(&nc->stream, cudaStreamNonBlocking);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): creating the stream of %s failed: %s",
                        what, comm->name, comm->rank, label, cudaGetErrorString(e));
  return TCC_OK;
}

/* Undoes ncomm_begin and whatever NCCL made of `handle`. Not
 * tcc__ncomm_abort: an abort that ran before the handle was published
 * found none, and this one must still go. */
static void ncomm_undo(tcc__ncomm_t *nc, ncclComm_t handle) {
  atomic_store(&nc->aborted, 1);
  ncclComm_t published = atomic_exchange(&nc->nc, NULL);
  if (published) handle = published;
  if (handle) nc->nccl->CommAbort(handle);
  cudaStreamDestroy(nc->stream);
  nc->stream = NULL;
}

/* The last step: publishes the handle NCCL returned (r) for `call` and
 * waits until NCCL finished making it. */
static tcc_result_t ncomm_finish(tcc__ncomm_t *nc, ncclComm_t handle, ncclResult_t r, const char *call,
                                 const char *what, int64_t deadline_ns, tcc_err_t *err) {
  tcc_comm_t *comm = nc->comm;
  if (r != ncclSuccess && r != ncclInProgress) {
    ncomm_undo(nc, handle);
    return tcc__err_set(err, r == ncclInvalidArgument || r == ncclInvalidUsage ? TCC_ERR_INVALID : TCC_ERR_SYSTEM,
                        "tccomm %s on '%s' (rank %d): %s for %s failed: %s", what, comm->name, comm->rank, call,
                        nc->label, nc->nccl->GetErrorString(r));
  }
  atomic_store(&nc->nc, handle);
  const tcc_result_t res = tcc__ncomm_settle(nc, what, call, deadline_ns, err);
  if (res != TCC_OK) ncomm_undo(nc, NULL);
  else TCC_LOG_INFO(comm->rank, "communicator '%s': %s made %s (%s) for %s", comm->name, call, nc->label,
                    nc->nonblocking ? "nonblocking" : "blocking", what);
  return res;
}

tcc_result_t tcc__ncomm_create(tcc__ncomm_t *nc, tcc_comm_t *comm, const tcc__nccl_lib_t *lib, const char *label,
                              int nranks, const ncclUniqueId *id, int rank, const char *what, int64_t deadline_ns,
                              tcc_err_t *err) {
  if (ncomm_begin(nc, comm, lib, label, what, err) != TCC_OK) return err->code;
  ncclComm_t handle = NULL;
  ncclResult_t r;
  const char *call;
  if (lib->CommInitRankConfig) {
    call = "ncclCommInitRankConfig";
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    r = lib->CommInitRankConfig(&handle, nranks, *id, rank, &config);
    nc->nonblocking = 1;
  } else {
    /* NCCL < 2.14 has no nonblocking communicators: setup may block on a
     * peer that never joins (said in the README's CUDA section). */
    call = "ncclCommInitRank";
    r = lib->CommInitRank(&handle, nranks, *id, rank);
  }
  return ncomm_finish(nc, handle, r, call, what, deadline_ns, err);
}

tcc_result_t tcc__ncomm_split(tcc__ncomm_t *parent, tcc__ncomm_t *nc, tcc_comm_t *comm, const char *label, int color,
                             int key, const char *what, int64_t deadline_ns, tcc_err_t *err) {
  const char *call = "ncclCommSplit";
  tcc_comm_t *pcomm = parent->comm;
  if (nc && ncomm_begin(nc, comm, parent->nccl, label, what, err) != TCC_OK) return err->code;
  if (!tcc__ncomm_enter(parent)) {
    if (nc) ncomm_undo(nc, NULL);
    char cause[TCC_ERRLEN];
    const tcc_result_t code = tcc__comm_failure(pcomm, cause, sizeof cause);
    return tcc__err_set(err, code != TCC_OK ? code : TCC_ERR_ABORTED,
                        "tccomm %s on '%s' (rank %d): cannot split %s: it was aborted%s%.400s", what, pcomm->name,
                        pcomm->rank, parent->label, *cause ? ": " : "", cause);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = parent->nonblocking ? 0 : 1; /* as the parent: NCCL_COMM_BLOCKING changes nothing */
  ncclComm_t handle = NULL;
  ncclResult_t r = parent->nccl->CommSplit(atomic_load(&parent->nc), color, key, &handle, &config);
  tcc__ncomm_leave(parent);
  if (r != ncclSuccess && r != ncclInProgress) {
    tcc__ncomm_failed(parent, what, call, r, err);
    if (nc) ncomm_undo(nc, handle);
    return err->code;
  }
  /* NCCL works on the split in the background: the parent takes no other
   * call until it is done (as ProcessGroupNCCL waits on it), and neither
   * does the child. */
  if (r == ncclInProgress && tcc__ncomm_settle(parent, what, call, deadline_ns, err) != TCC_OK) {
    if (nc) ncomm_undo(nc, handle);
    return err->code;
  }
  if (!nc) return TCC_OK;
  nc->nonblocking = parent->nonblocking;
  if (ncomm_finish(nc, handle, ncclSuccess, call, what, deadline_ns, err) != TCC_OK) return err->code;
  /* The ranks that gave this color must be the child's, in its order. */
  int n = -1, rank = -1;
  if (tcc__ncomm_enter(nc)) {
    nc->nccl->CommCount(atomic_load(&nc->nc), &n);
    nc->nccl->CommUserRank(atomic_load(&nc->nc), &rank);
    tcc__ncomm_leave(nc);
  }
  if (n == comm->size && rank == key) return TCC_OK;
  ncomm_undo(nc, NULL);
  return tcc__err_set(err, TCC_ERR_MISMATCH,
                      "tccomm %s on '%s' (rank %d): the ranks disagree on the split: color %d gave an NCCL "
                      "communicator of %d rank(s) in which this one is %d, but '%s' has %d rank(s) and this one is %d",
                      what, pcomm->name, pcomm->rank, color, n, rank, comm->name, comm->size, key);
}

void tcc__ncomm_abort(tcc__ncomm_t *nc) {
  if (atomic_exchange(&nc->aborted, 1)) return;
  const int64_t until = tcc__now_ns() + ABORT_GRACE_NS;
  while (atomic_load(&nc->users) > 0 && tcc__now_ns() < until) nap(SETTLE_NAP_NS);
  ncclComm_t handle = atomic_exchange(&nc->nc, NULL);
  if (handle) nc->nccl->CommAbort(handle);
}

void tcc__ncomm_free(tcc__ncomm_t *nc, int graceful) {
  ncclComm_t handle = atomic_load(&nc->aborted) ? NULL : atomic_exchange(&nc->nc, NULL);
  if (handle) {
    /* Nothing is in flight (the watchdog drained it): a clean destroy. */
    if (graceful) nc->nccl->CommDestroy(handle);
    else nc->nccl->CommAbort(handle);
  }
  if (nc->stream) {
    cudaStreamSynchronize(nc->stream);
    cudaStreamDestroy(nc->stream);
    nc->stream = NULL;
  }
}
