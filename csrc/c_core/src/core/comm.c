/*
 * comm.c - the communicator: creation, failure, groups, destroy.
 *
 * A communicator holds its transport (transport/) and both executors
 * (core/executor.h); the public op entry points are in ops_api.c.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/executor.h"
#include "core/log.h"
#include "transport/transport.h"

/* ---- failure state ---------------------------------------------------- */

/* Records the communicator's first failure and wakes every thread; 1 when
 * this call was the first. `announce`: the transport tells the peers. */
static int record_failure(tcc_comm_t *comm, tcc_result_t code, const char *msg, bool announce) {
  pthread_mutex_lock(&comm->fail_lock);
  int first = !atomic_load(&comm->aborted);
  if (first) {
    comm->fail_code = code;
    snprintf(comm->fail_msg, sizeof comm->fail_msg, "%s", msg ? msg : tcc_result_string(code));
    atomic_store(&comm->aborted, 1);
  }
  pthread_mutex_unlock(&comm->fail_lock);
  if (first) {
    /* The transport first: a thread waiting inside one of its views is
     * then released by the wakes below. */
    if (comm->ops && comm->ops->failed) comm->ops->failed(comm, announce);
    tcc__host_executor.wake(comm);
    tcc__device_executor.wake(comm); /* aborts what cannot end otherwise */
  }
  return first;
}

void tcc__comm_fail(tcc_comm_t *comm, tcc_result_t code, const char *msg) {
  /* Only the first failure: the ones after it are its consequences. */
  if (record_failure(comm, code, msg, true))
    TCC_LOG_WARN(comm->rank, "communicator '%s' failed (%s): %s", comm->name, tcc_result_string(code),
                 msg ? msg : tcc_result_string(code));
}

tcc_result_t tcc__comm_failure(tcc_comm_t *comm, char *msg, size_t len) {
  if (!atomic_load(&comm->aborted)) {
    if (len) msg[0] = '\0';
    return TCC_OK;
  }
  pthread_mutex_lock(&comm->fail_lock);
  tcc_result_t code = comm->fail_code;
  snprintf(msg, len, "%s", comm->fail_msg);
  pthread_mutex_unlock(&comm->fail_lock);
  return code;
}

tcc_result_t tcc_comm_status(const tcc_comm_t *comm) {
  return atomic_load(&((tcc_comm_t *)comm)->aborted) ? comm->fail_code : TCC_OK;
}

const char *tcc_comm_failure(const tcc_comm_t *comm) {
  /* fail_msg is written once, before `aborted` is set, and never again. */
  return atomic_load(&((tcc_comm_t *)comm)->aborted) ? comm->fail_msg : "";
}

/* ---- creation --------------------------------------------------------- */

tcc_result_t tcc_comm_create(const tcc_comm_config_t *cfg, tcc_endpoint_t *ep,
                             const uint8_t *blobs_raw, tcc_comm_t **out) {
  tcc_err_t err = {TCC_OK, {0}};
  tcc_blob_t *blobs = NULL;
  tcc_comm_t *comm = NULL;
  *out = NULL;
  tcc__log_setup();
  if (!cfg || !ep || !blobs_raw || cfg->size < 1 || cfg->size > TCC_MAX_RANKS || cfg->rank < 0 ||
      cfg->rank >= cfg->size) {
    tcc__err_set(&err, TCC_ERR_INVALID, "tccomm: invalid communicator config (rank %d, size %d)",
                cfg ? cfg->rank : -1, cfg ? cfg->size : -1);
    goto fail;
  }
  blobs = calloc((size_t)cfg->size, sizeof *blobs);
  if (!blobs) {
    tcc__err_set(&err, TCC_ERR_SYSTEM, "tccomm: out of memory");
    goto fail;
  }
  if (tcc__blobs_decode(blobs_raw, cfg->size, blobs, &err) != TCC_OK) goto fail;
  if (memcmp(blobs[cfg->rank].token, ep->blob.token, TCC_TOKEN_BYTES) != 0) {
    tcc__err_set(&err, TCC_ERR_INVALID, "tccomm: the blob at index %d is not this rank's endpoint",
                cfg->rank);
    goto fail;
  }
  if (tcc__env_check_switches(&err) != TCC_OK) goto fail;
  tcc_transport_t transport = TCC_TRANSPORT_AUTO;
  if (tcc__comm_choose_transport(cfg, blobs, &transport, &err) != TCC_OK) goto fail;

  comm = calloc(1, sizeof *comm);
  if (!comm) {
    tcc__err_set(&err, TCC_ERR_SYSTEM, "tccomm: out of memory");
    goto fail;
  }
  atomic_store(&comm->refs, 1);
  comm->owner_pid = getpid();
  comm->rank = cfg->rank;
  comm->size = cfg->size;
  snprintf(comm->name, sizeof comm->name, "%s", cfg->name && *cfg->name ? cfg->name : "tccomm");
  atomic_store(&comm->timeout_ms, cfg->timeout_ms > 0 ? cfg->timeout_ms : 30 * 60 * 1000LL);
  pthread_mutex_init(&comm->fail_lock, NULL);
  pthread_mutex_init(&comm->group_lock, NULL);

  tcc_result_t r = tcc__transport_setup(comm, transport, ep, blobs, &err);
  ep = NULL; /* closed by the setup */
  if (r != TCC_OK) goto fail;
  if (tcc__coll_attach(comm, &err) != TCC_OK) goto fail;
  if (tcc__host_executor.attach(comm, &err) != TCC_OK) goto fail;
  if (tcc__device_executor.attach(comm, &err) != TCC_OK) {
    tcc__host_executor.stop(comm);
    tcc__host_executor.release(comm);
    goto fail;
  }
  free(blobs);
  TCC_LOG_INFO(comm->rank, "communicator '%s' created: rank %d of %d, transport %s, timeout %lld ms", comm->name,
               comm->rank, comm->size, comm->ops->name, (long long)atomic_load(&comm->timeout_ms));
  *out = comm;
  return TCC_OK;

fail:
  if (ep) tcc_endpoint_close(ep);
  if (comm) {
    if (comm->ops) comm->ops->destroy(comm);
    tcc__coll_release(comm);
    pthread_mutex_destroy(&comm->fail_lock);
    pthread_mutex_destroy(&comm->group_lock);
    free(comm);
  }
  free(blobs);
  TCC_LOG_WARN(cfg ? cfg->rank : -1, "communicator '%s' could not be created: %s",
               cfg && cfg->name && *cfg->name ? cfg->name : "tccomm", err.msg[0] ? err.msg : "unknown cause");
  return tcc__fail_with(&err, err.code != TCC_OK ? err.code : TCC_ERR_SYSTEM);
}

int tcc_comm_rank(const tcc_comm_t *comm) { return comm->rank; }
int tcc_comm_size(const tcc_comm_t *comm) { return comm->size; }
const char *tcc_comm_name(const tcc_comm_t *comm) { return comm->name; }
const char *tcc_comm_transport_name(const tcc_comm_t *comm) { return comm->ops->name; }
uint64_t tcc_comm_collective_count(const tcc_comm_t *comm) {
  return atomic_load(&((tcc_comm_t *)comm)->coll_issued);
}
void tcc_comm_set_timeout(tcc_comm_t *comm, int64_t timeout_ms) {
  if (timeout_ms > 0) atomic_store(&comm->timeout_ms, timeout_ms);
}

void tcc_comm_abort(tcc_comm_t *comm) {
  char msg[TCC_ERRLEN];
  snprintf(msg, sizeof msg, "communicator '%s' was aborted on rank %d", comm->name, comm->rank);
  tcc__comm_fail(comm, TCC_ERR_ABORTED, msg);
}

/* How long destroy lets device work in flight finish before aborting it. */
#define DESTROY_DEVICE_GRACE_MS 10000
/* How long destroy waits for its peers' frames of the ops in which it
 * only sent (tcc__coll_settle). */
#define DESTROY_SETTLE_MS 10000

void tcc_comm_destroy(tcc_comm_t *comm) {
  if (!comm) return;
  /* In a forked child the threads, descriptors and mappings are the
   * parent's (or gone: see forksafe.c, MADV_DONTFORK): touch nothing. */
  if (getpid() != comm->owner_pid) return;
  const bool healthy = tcc_comm_status(comm) == TCC_OK;
  /* Device work in flight finishes first, within a bound: a caller that
   * only made its stream wait for an op may destroy right after, and the
   * device is still working for it. */
  if (tcc__device_executor.drain) tcc__device_executor.drain(comm, DESTROY_DEVICE_GRACE_MS);
  /* Ops still pending fail now rather than hold destroy (and the threads
   * waiting on them) until their timeouts; peers blocked on this rank learn
   * that it left from its transport. */
  char msg[TCC_ERRLEN];
  snprintf(msg, sizeof msg, "communicator '%s' was destroyed on rank %d while the op was pending",
           comm->name, comm->rank);
  /* Not a failure (no warning): the owner is done with the communicator. */
  record_failure(comm, TCC_ERR_ABORTED, msg, false);
  TCC_LOG_INFO(comm->rank, "communicator '%s' destroyed: rank %d of %d, %llu collectives issued", comm->name,
               comm->rank, comm->size, (unsigned long long)atomic_load(&comm->coll_issued));
  /* The device first: its watchdog may still fail ops that reach the host side. */
  tcc__device_executor.stop(comm);
  tcc__host_executor.stop(comm);
  if (healthy) tcc__coll_settle(comm, DESTROY_SETTLE_MS);
  if (comm->ops) comm->ops->destroy(comm);
  tcc__comm_release(comm);
}

void tcc__comm_release(tcc_comm_t *comm) {
  if (atomic_fetch_sub(&comm->refs, 1) != 1) return;
  tcc__device_executor.release(comm);
  tcc__host_executor.release(comm);
  tcc__coll_release(comm);
  pthread_mutex_destroy(&comm->fail_lock);
  pthread_mutex_destroy(&comm->group_lock);
  free(comm);
}

/* ---- groups ------------------------------------------------------------- */

tcc_result_t tcc_comm_group_start(tcc_comm_t *comm) {
  pthread_mutex_lock(&comm->group_lock);
  atomic_fetch_add(&comm->group_depth, 1);
  pthread_mutex_unlock(&comm->group_lock);
  return TCC_OK;
}

tcc_result_t tcc_comm_group_end(tcc_comm_t *comm) {
  pthread_mutex_lock(&comm->group_lock);
  int depth = atomic_load(&comm->group_depth);
  if (depth > 0) atomic_store(&comm->group_depth, depth - 1);
  pthread_mutex_unlock(&comm->group_lock);
  if (depth == 0) return tcc__fail(TCC_ERR_INVALID, "tccomm '%s': group end without a group start", comm->name);
  if (depth > 1) return TCC_OK;
  /* Outside the lock: ending the group finishes ops whose callbacks may
   * start the next group. */
  tcc_err_t err = {TCC_OK, {0}};
  tcc_result_t r = tcc__device_executor.group_end(comm, &err);
  if (r == TCC_OK) r = tcc__host_executor.group_end(comm, &err);
  return r == TCC_OK ? TCC_OK : tcc__fail_with(&err, r);
}
