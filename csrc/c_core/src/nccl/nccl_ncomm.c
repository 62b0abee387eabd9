/*
 * ncomm.c - one NCCL communicator as the device executor uses it: created
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

tcc_result_t tcc__ncomm_create(tcc__ncomm_t *nc, tcc_comm_t *comm, const tcc__nccl_lib_t *lib, const char *label,
                              int nranks, const ncclUniqueId *id, int rank, const char *what, int64_t deadline_ns,
                              tcc_err_t *err) {
  /* No memset: an abort racing with this setup may already have raised
   * nc->aborted, and the setup must then fail, not forget it. */
  nc->nccl = lib;
  nc->comm = comm;
  snprintf(nc->label, sizeof nc->label, "%s", label);
  /* The stream exists before NCCL does, so a failed setup leaves nothing else to undo. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t e = cudaStreamCreateWithFlags(&nc->stream, cudaStreamNonBlocking);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (e != cudaSuccess)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): creating the stream of %s failed: %s",
                        what, comm->name, comm->rank, label, cudaGetErrorString(e));
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
  if (r != ncclSuccess && r != ncclInProgress) {
    if (handle) lib->CommAbort(handle);
    cudaStreamDestroy(nc->stream);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): %s for %s failed: %s", what, comm->name,
                        comm->rank, call, label, lib->GetErrorString(r));
  }
  atomic_store(&nc->nc, handle);
  tcc_result_t res = tcc__ncomm_settle(nc, what, call, deadline_ns, err);
  if (res != TCC_OK) {
    /* Not tcc__ncomm_abort: an abort that ran before the store above found
     * no handle, and this one must still go. */
    atomic_store(&nc->aborted, 1);
    ncclComm_t h = atomic_exchange(&nc->nc, NULL);
    if (h) lib->CommAbort(h);
    cudaStreamDestroy(nc->stream);
    nc->stream = NULL;
  }
  return res;
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
