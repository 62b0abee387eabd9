/*
 * cuda_comm.c - a communicator's CUDA side: the NCCL communicator, issuing
 * CUDA ops on its stream, NCCL groups, and the public CUDA calls.
 *
 * Bootstrap: rank 0 creates the ncclUniqueId and broadcasts it over the
 * group's own host communicator (the engine), so NCCL needs no store of its
 * own and the exchange is bounded by the group's timeout.
 *
 * Issuing (the caller's thread, under comm->cuda_lock): record an event on
 * the caller's stream, make the NCCL stream wait for it, make the NCCL
 * calls, record the op's completion event on the NCCL stream. Outside a
 * graph capture the op is then handed to the watchdog (cuda_watch.c);
 * inside one it is complete at once from the host's view: the graph owns
 * the work, nothing queries its event and no host callback waits for it.
 */
#include "cuda.h"
#include "cuda_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef TCC_WITH_CUDA

int tcc_cuda_built(void) { return 1; }
int tcc_nccl_header_version(void) { return NCCL_VERSION_CODE; }

tcc_result_t tcc_nccl_runtime_version(int *version, char *errbuf, size_t errlen) {
  tcc_err_t err = {TCC_OK, {0}};
  const tcc_nccl_lib_t *lib = tcc_nccl_lib(&err);
  *version = lib ? lib->version : 0;
  if (!lib && errbuf && errlen) snprintf(errbuf, errlen, "%s", err.msg);
  return lib ? TCC_OK : err.code;
}

/* Makes `device` current for the calling thread; *prev gets the old one. */
static cudaError_t enter_device(int device, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e != cudaSuccess) return e;
  return *prev == device ? cudaSuccess : cudaSetDevice(device);
}

static void leave_device(int device, int prev) {
  if (prev != device) cudaSetDevice(prev);
}

/* Shares rank 0's ncclUniqueId (with a status byte: rank 0 may fail to
 * make one, and the others must hear that rather than time out). */
static tcc_result_t share_unique_id(tcc_comm_t *comm, const tcc_nccl_lib_t *lib, ncclUniqueId *id,
                                    tcc_err_t *err) {
  uint8_t msg[1 + sizeof(ncclUniqueId)];
  memset(msg, 0, sizeof msg);
  ncclResult_t nr = ncclSuccess;
  if (comm->rank == 0) {
    nr = lib->GetUniqueId(id);
    msg[0] = nr == ncclSuccess ? 1 : 0;
    if (nr == ncclSuccess) memcpy(msg + 1, id, sizeof *id);
  }
  tcc_buf_t b = {msg, sizeof msg, TCC_UINT8, -1, NULL};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_broadcast(comm, b, 0, NULL, &op);
  if (r != TCC_OK)
    return tcc_err_set(err, r, "tccomm '%s' (rank %d): sharing the NCCL unique id failed: %s", comm->name,
                       comm->rank, tcc_comm_last_error(comm));
  r = tcc_op_wait(op, -1);
  if (r != TCC_OK)
    tcc_err_set(err, r, "tccomm '%s' (rank %d): sharing the NCCL unique id failed: %s", comm->name, comm->rank,
                tcc_op_error(op));
  tcc_op_release(op);
  if (r != TCC_OK) return r;
  if (msg[0] != 1)
    return tcc_err_set(err, TCC_ERR_REMOTE, "tccomm '%s' (rank %d): rank 0 could not create an NCCL unique id%s%s",
                       comm->name, comm->rank, comm->rank == 0 ? ": " : "",
                       comm->rank == 0 ? lib->GetErrorString(nr) : "");
  memcpy(id, msg + 1, sizeof *id);
  return TCC_OK;
}

static void free_state(struct tcc_cuda *c) {
  if (c->order_event) cudaEventDestroy(c->order_event);
  if (c->stream) cudaStreamDestroy(c->stream);
  free(c);
}

/* Creates comm->cuda for `device`. Caller holds cuda_lock. Collective. */
static tcc_result_t cuda_init_locked(tcc_comm_t *comm, int device, tcc_err_t *err) {
  const tcc_nccl_lib_t *lib = tcc_nccl_lib(err);
  if (!lib) return err->code;
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0)
    return tcc_err_set(err, TCC_ERR_UNSUPPORTED, "tccomm '%s' (rank %d): no usable CUDA device: %s", comm->name,
                       comm->rank, e != cudaSuccess ? cudaGetErrorString(e) : "the device count is 0");
  if (device < 0 || device >= ndev)
    return tcc_err_set(err, TCC_ERR_INVALID, "tccomm '%s' (rank %d): CUDA device %d does not exist (%d visible)",
                       comm->name, comm->rank, device, ndev);
  ncclUniqueId id;
  tcc_result_t r = share_unique_id(comm, lib, &id, err);
  if (r != TCC_OK) return r;

  struct tcc_cuda *c = calloc(1, sizeof *c);
  if (!c) return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  c->nccl = lib;
  c->device = device;
  int prev = device;
  e = enter_device(device, &prev);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->order_event, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    leave_device(device, prev);
    free_state(c);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): setting up CUDA device %d failed: %s",
                       comm->name, comm->rank, device, cudaGetErrorString(e));
  }
  ncclResult_t nr = lib->CommInitRank(&c->nc, comm->size, id, comm->rank);
  leave_device(device, prev);
  if (nr != ncclSuccess) {
    free_state(c);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): ncclCommInitRank on CUDA device %d failed: %s",
                       comm->name, comm->rank, device, lib->GetErrorString(nr));
  }
  atomic_store(&comm->cuda, c); /* before the watchdog starts: it reads it */
  r = tcc_cuda_watch_start(comm, c, err);
  if (r != TCC_OK) {
    atomic_store(&comm->cuda, NULL);
    lib->CommDestroy(c->nc);
    free_state(c);
  }
  return r;
}

/* The communicator's CUDA state for `device`, created on first use. */
static struct tcc_cuda *state_for(tcc_comm_t *comm, int device, const char *what, tcc_err_t *err) {
  struct tcc_cuda *c = atomic_load(&comm->cuda);
  if (!c) {
    if (cuda_init_locked(comm, device, err) != TCC_OK) return NULL;
    c = atomic_load(&comm->cuda);
  }
  if (c->device != device) {
    tcc_err_set(err, TCC_ERR_INVALID,
                "tccomm %s on '%s' (rank %d): the buffers are on CUDA device %d but this group uses device %d "
                "(one device per process and group)",
                what, comm->name, comm->rank, device, c->device);
    return NULL;
  }
  return c;
}

/* Records the op's completion event and hands it on (see the file comment).
 * A captured op is finished by the caller once cuda_lock is released: its
 * completion callback may issue the next op. */
static tcc_result_t complete_enqueue(tcc_comm_t *comm, struct tcc_cuda *c, tcc_op_t *op, int captured,
                                     tcc_err_t *err) {
  tcc_result_t r = tcc_cuda_post(comm, c, op, err);
  if (r != TCC_OK) return r;
  cudaError_t e;
  cudaEvent_t ev = tcc_cuda_event_get(c->device, &e);
  if (ev) e = cudaEventRecord(ev, c->stream);
  if (e != cudaSuccess) {
    tcc_cuda_event_put(c->device, ev);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): recording its completion failed: %s",
                       tcc_cuda_op_name(op), comm->name, comm->rank, cudaGetErrorString(e));
  }
  op->deadline_ns = tcc_deadline_after_ms(op->timeout_ms);
  op->cuda_captured = captured;
  atomic_store(&op->cuda_event, (void *)ev); /* after the fields its readers check */
  if (!captured) tcc_cuda_watch(c, op);
  return TCC_OK;
}

tcc_result_t tcc_cuda_submit(tcc_comm_t *comm, tcc_op_t *op, int device, void *stream, tcc_err_t *err) {
  const char *what = tcc_cuda_op_name(op);
  op->cuda_device = device;
  pthread_mutex_lock(&comm->cuda_lock);
  int prev = device;
  tcc_result_t r = TCC_OK;
  struct tcc_cuda *c = state_for(comm, device, what, err);
  if (!c) {
    r = err->code;
    goto out;
  }
  if (atomic_load(&comm->aborted) || c->nccl_aborted) {
    pthread_mutex_lock(&comm->fail_lock);
    r = tcc_err_set(err, comm->fail_code ? comm->fail_code : TCC_ERR_ABORTED,
                    "tccomm %s on '%s' (rank %d): communicator is no longer usable: %.400s", what, comm->name,
                    comm->rank, comm->fail_msg);
    pthread_mutex_unlock(&comm->fail_lock);
    goto out;
  }
  cudaStream_t s = (cudaStream_t)stream;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaError_t e = enter_device(device, &prev);
  if (e == cudaSuccess) e = cudaStreamIsCapturing(s, &cs);
  /* The NCCL stream follows the caller's stream (and joins its capture). */
  if (e == cudaSuccess) e = cudaEventRecord(c->order_event, s);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(c->stream, c->order_event, 0);
  if (e != cudaSuccess) {
    r = tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): ordering after the caller's stream failed: %s",
                    what, comm->name, comm->rank, cudaGetErrorString(e));
    goto out;
  }
  const int captured = cs == cudaStreamCaptureStatusActive;
  if (comm->group_depth > 0 && !c->nccl_group_open) {
    ncclResult_t nr = c->nccl->GroupStart();
    if (nr != ncclSuccess) {
      r = tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): ncclGroupStart failed: %s", what,
                      comm->name, comm->rank, c->nccl->GetErrorString(nr));
      goto out;
    }
    c->nccl_group_open = 1;
  }
  r = tcc_cuda_issue(comm, c, op, err);
  if (r != TCC_OK) goto out;
  if (c->nccl_group_open) {
    /* Its kernel launches at the group's end: the event is recorded then. */
    tcc_op_retain(op);
    op->cuda_next = NULL;
    if (c->group_tail) c->group_tail->cuda_next = op; else c->group_head = op;
    c->group_tail = op;
    c->group_captured |= captured;
  } else {
    r = complete_enqueue(comm, c, op, captured, err);
  }
out:
  /* On success, staging memory is freed by tcc_cuda_post: already, or at
   * the group's end (an allgather in a group copies out of it then). */
  if (r != TCC_OK && op->cuda_tmp) {
    if (c) cudaFreeAsync(op->cuda_tmp, c->stream);
    op->cuda_tmp = NULL;
  }
  if (c) leave_device(device, prev);
  pthread_mutex_unlock(&comm->cuda_lock);
  if (r != TCC_OK) tcc_op_release(op);
  else if (op->cuda_captured) tcc_cuda_finish(op, TCC_OK, NULL);
  return r;
}

/* ---- groups -------------------------------------------------------------- */

tcc_result_t tcc_comm_group_end(tcc_comm_t *comm) {
  pthread_mutex_lock(&comm->cuda_lock);
  if (comm->group_depth == 0) {
    pthread_mutex_unlock(&comm->cuda_lock);
    snprintf(comm->last_error, sizeof comm->last_error, "tccomm '%s': group end without a group start",
             comm->name);
    return TCC_ERR_INVALID;
  }
  struct tcc_cuda *c = atomic_load(&comm->cuda);
  if (--comm->group_depth > 0 || !c || !c->nccl_group_open) {
    pthread_mutex_unlock(&comm->cuda_lock);
    return TCC_OK;
  }
  int prev = c->device;
  enter_device(c->device, &prev);
  c->nccl_group_open = 0;
  ncclResult_t nr = c->nccl->GroupEnd();
  tcc_op_t *list = c->group_head;
  const int captured = c->group_captured;
  c->group_head = c->group_tail = NULL;
  c->group_captured = 0;
  tcc_result_t first = TCC_OK;
  tcc_op_t *done = NULL; /* finished once cuda_lock is released (callbacks may issue ops) */
  while (list) {
    tcc_op_t *op = list;
    list = op->cuda_next;
    op->cuda_next = NULL;
    tcc_err_t err = {TCC_OK, {0}};
    tcc_result_t r;
    if (nr != ncclSuccess && nr != ncclInProgress)
      r = tcc_err_set(&err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): ncclGroupEnd failed: %s",
                      tcc_cuda_op_name(op), comm->name, comm->rank, c->nccl->GetErrorString(nr));
    else
      r = complete_enqueue(comm, c, op, captured, &err);
    if (r != TCC_OK) {
      /* Kept for the message: the op is failed below, after the unlock. */
      op->result = r;
      snprintf(op->error, sizeof op->error, "%s", err.msg);
      if (first == TCC_OK) {
        first = r;
        snprintf(comm->last_error, sizeof comm->last_error, "%s", err.msg);
      }
    }
    if (r != TCC_OK || op->cuda_captured) {
      op->cuda_next = done;
      done = op; /* keeps the group's reference */
    } else {
      tcc_op_release(op); /* the group's reference; the watchdog holds its own */
    }
  }
  leave_device(c->device, prev);
  pthread_mutex_unlock(&comm->cuda_lock);
  while (done) {
    tcc_op_t *op = done;
    done = op->cuda_next;
    op->cuda_next = NULL;
    if (op->result == TCC_ERR_INPROGRESS) tcc_cuda_finish(op, TCC_OK, NULL);
    else {
      char msg[TCC_ERRLEN]; /* tcc_op_finish writes op->error */
      snprintf(msg, sizeof msg, "%s", op->error);
      tcc_cuda_finish(op, op->result, msg);
    }
    tcc_op_release(op);
  }
  return first;
}

/* ---- public calls ---------------------------------------------------------- */

tcc_result_t tcc_comm_cuda_init(tcc_comm_t *comm, int device) {
  tcc_err_t err = {TCC_OK, {0}};
  pthread_mutex_lock(&comm->cuda_lock);
  struct tcc_cuda *c = state_for(comm, device, "cuda_init", &err);
  pthread_mutex_unlock(&comm->cuda_lock);
  if (!c) snprintf(comm->last_error, sizeof comm->last_error, "%s", err.msg);
  return c ? TCC_OK : err.code;
}

int tcc_comm_cuda_device(const tcc_comm_t *comm) {
  struct tcc_cuda *c = atomic_load(&((tcc_comm_t *)comm)->cuda);
  return c ? c->device : -1;
}

void *tcc_comm_cuda_stream(const tcc_comm_t *comm) {
  struct tcc_cuda *c = atomic_load(&((tcc_comm_t *)comm)->cuda);
  return c ? (void *)c->stream : NULL;
}

int tcc_op_is_cuda(const tcc_op_t *op) { return op->cuda_device >= 0; }

tcc_result_t tcc_op_stream_wait(tcc_op_t *op, void *stream) {
  if (op->cuda_device < 0) return TCC_OK;
  cudaEvent_t ev = (cudaEvent_t)atomic_load(&op->cuda_event);
  if (!ev) {
    /* Still inside an open group, or it failed before being enqueued. */
    return atomic_load(&op->finished) ? op->result : TCC_ERR_INVALID;
  }
  return cudaStreamWaitEvent((cudaStream_t)stream, ev, 0) == cudaSuccess
             ? TCC_OK
             : TCC_ERR_SYSTEM;
}

int tcc_cuda_op_test(tcc_op_t *op) {
  if (atomic_load(&op->finished)) return 1;
  cudaEvent_t ev = (cudaEvent_t)atomic_load(&op->cuda_event);
  if (!ev || op->cuda_captured) return 0;
  /* Relaxed capture mode: legal even while this thread captures a graph. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t q = cudaEventQuery(ev);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (q == cudaSuccess) tcc_cuda_finish(op, TCC_OK, NULL); /* the watchdog drops it later */
  return atomic_load(&op->finished);
}

void tcc_cuda_op_free(tcc_op_t *op) {
  cudaEvent_t ev = (cudaEvent_t)atomic_exchange(&op->cuda_event, NULL);
  if (ev) tcc_cuda_event_put(op->cuda_device, ev);
}

void tcc_cuda_destroy(tcc_comm_t *comm) {
  struct tcc_cuda *c = atomic_load(&comm->cuda);
  if (!c) return;
  /* Ops left in a group nobody ended were never launched. */
  tcc_op_t *list = c->group_head;
  c->group_head = c->group_tail = NULL;
  if (c->nccl_group_open) c->nccl->GroupEnd();
  while (list) {
    tcc_op_t *op = list;
    list = op->cuda_next;
    tcc_cuda_finish(op, TCC_ERR_ABORTED, "tccomm: the communicator was destroyed inside an open group");
    tcc_op_release(op);
  }
  tcc_cuda_watch_stop(c); /* waits for the ops in flight (each bounded by its deadline) */
  int prev = c->device;
  enter_device(c->device, &prev);
  if (c->nccl_aborted || atomic_load(&comm->aborted)) {
    if (!c->nccl_aborted) c->nccl->CommAbort(c->nc);
  } else {
    c->nccl->CommDestroy(c->nc);
  }
  const int device = c->device;
  cudaStreamSynchronize(c->stream);
  atomic_store(&comm->cuda, NULL);
  free_state(c);
  leave_device(device, prev);
}

#else /* !TCC_WITH_CUDA: the host-only core */

int tcc_cuda_built(void) { return 0; }
int tcc_nccl_header_version(void) { return 0; }

tcc_result_t tcc_nccl_runtime_version(int *version, char *errbuf, size_t errlen) {
  *version = 0;
  if (errbuf && errlen) snprintf(errbuf, errlen, "tccomm was built without CUDA");
  return TCC_ERR_UNSUPPORTED;
}

tcc_result_t tcc_cuda_submit(tcc_comm_t *comm, tcc_op_t *op, int device, void *stream, tcc_err_t *err) {
  (void)stream;
  tcc_op_release(op);
  return tcc_err_set(err, TCC_ERR_UNSUPPORTED, "tccomm on '%s': buffers on CUDA device %d, but tccomm was built "
                     "without CUDA", comm->name, device);
}

tcc_result_t tcc_comm_cuda_init(tcc_comm_t *comm, int device) {
  snprintf(comm->last_error, sizeof comm->last_error,
           "tccomm '%s': cannot use CUDA device %d: tccomm was built without CUDA", comm->name, device);
  return TCC_ERR_UNSUPPORTED;
}

int tcc_comm_cuda_device(const tcc_comm_t *comm) { (void)comm; return -1; }
void *tcc_comm_cuda_stream(const tcc_comm_t *comm) { (void)comm; return NULL; }

tcc_result_t tcc_comm_group_end(tcc_comm_t *comm) {
  pthread_mutex_lock(&comm->cuda_lock);
  int ok = comm->group_depth > 0;
  if (ok) comm->group_depth--;
  pthread_mutex_unlock(&comm->cuda_lock);
  if (ok) return TCC_OK;
  snprintf(comm->last_error, sizeof comm->last_error, "tccomm '%s': group end without a group start", comm->name);
  return TCC_ERR_INVALID;
}

int tcc_op_is_cuda(const tcc_op_t *op) { (void)op; return 0; }
tcc_result_t tcc_op_stream_wait(tcc_op_t *op, void *stream) { (void)op; (void)stream; return TCC_OK; }
int tcc_cuda_op_test(tcc_op_t *op) { return atomic_load(&op->finished); }
void tcc_cuda_op_free(tcc_op_t *op) { (void)op; }
void tcc_cuda_wake(tcc_comm_t *comm) { (void)comm; }
void tcc_cuda_destroy(tcc_comm_t *comm) { (void)comm; }

#endif /* TCC_WITH_CUDA */

/* Both builds count group depth the same way; only the end differs. */
tcc_result_t tcc_comm_group_start(tcc_comm_t *comm) {
  pthread_mutex_lock(&comm->cuda_lock);
  comm->group_depth++;
  pthread_mutex_unlock(&comm->cuda_lock);
  return TCC_OK;
}
