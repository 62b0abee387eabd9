/*
 * nccl_executor.c - the device executor (core/executor.h) for CUDA buffers:
 * ops become NCCL calls on the communicator's stream.
 *
 * Issuing (the caller's thread, under the communicator's issue lock, which
 * neither the watchdog nor an abort takes): record an event on the
 * caller's stream, make the NCCL stream wait for it, make the NCCL calls
 * (between tcc__ncomm_enter and leave), wait until a nonblocking NCCL has
 * really enqueued them (tcc__ncomm_settle, bounded by the op's deadline),
 * record the op's completion event on the NCCL stream. Outside a graph capture the op is then handed to the watchdog
 * (nccl_watch.c); inside one it is complete at once from the host's view: the
 * graph owns the work, nothing queries its event and no host callback
 * waits for it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/idle_wait.h"
#include "nccl/nccl_state.h"

/* NCCL's groups are per thread: once any communicator's group is open on
 * a thread, every NCCL call that thread makes, on any communicator, is
 * launched only at the thread's outermost ncclGroupEnd. So the ops whose
 * completion events wait for that launch are kept per thread too, not per
 * communicator: an op issued on one group while another group coalesces
 * on the same thread would otherwise record its event before its kernel
 * exists, and look complete at once. */
static _Thread_local struct thread_group {
  int depth;              /* communicators with an NCCL group open on this thread */
  tcc_op_t *head, *tail;  /* ops issued since the first one opened, in issue order */
} thread_group;

/* Records the op's completion event and hands it on (see the file comment).
 * A captured op is finished by the caller once the lock is released: its
 * completion callback may issue the next op. */
static tcc_result_t complete_enqueue(tcc_comm_t *comm, struct tcc__cuda *c, tcc_op_t *op, tcc_err_t *err) {
  const int captured = nccl_op_of(op)->captured;
  tcc__ncomm_t *n = nccl_op_of(op)->ncomm;
  tcc_result_t r = tcc__cuda_post(comm, n, op, err);
  if (r != TCC_OK) return r;
  cudaError_t e;
  cudaEvent_t ev = tcc__cuda_event_get(c->device, &e);
  if (ev) e = cudaEventRecord(ev, n->stream);
  if (e != cudaSuccess) {
    tcc__cuda_event_put(c->device, ev);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): recording its completion failed: %s",
                       tcc__op_name(op), comm->name, comm->rank, cudaGetErrorString(e));
  }
  if (captured && tcc__cuda_keep_for_graph(c, n->stream) != TCC_OK) {
    tcc__cuda_event_put(c->device, ev);
    return tcc__err_set(err, TCC_ERR_SYSTEM,
                        "tccomm %s on '%s' (rank %d): cannot tie the NCCL communicator to the CUDA graph being "
                        "captured (cudaGraphRetainUserObject)",
                        tcc__op_name(op), comm->name, comm->rank);
  }
  tcc__op_begin(op);
  atomic_store(&nccl_op_of(op)->event, ev); /* after the fields its readers check */
  if (!captured) tcc__cuda_watch(c, op);
  return TCC_OK;
}

/* An NCCL call that did not settle leaves the communicator in an unknown
 * state (partly enqueued work, NCCL stuck): it fails, and the watchdog
 * aborts NCCL. Bad arguments fail only the op. */
static tcc_result_t fail_comm_unless_invalid(tcc_comm_t *comm, tcc_result_t r, const tcc_err_t *err) {
  if (r != TCC_OK && r != TCC_ERR_INVALID && r != TCC_ERR_UNSUPPORTED && !atomic_load(&comm->aborted))
    tcc__comm_fail(comm, r, err->msg);
  return r;
}

static tcc_result_t unusable(tcc_comm_t *comm, const char *what, tcc_err_t *err) {
  char cause[TCC_ERRLEN];
  tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
  return tcc__err_set(err, code != TCC_OK ? code : TCC_ERR_ABORTED,
                      "tccomm %s on '%s' (rank %d): communicator is no longer usable: %.400s", what, comm->name,
                      comm->rank, *cause ? cause : "its NCCL communicator was aborted");
}

static tcc_result_t nccl_submit(tcc_comm_t *comm, tcc_op_t *op, void *stream, tcc_err_t *err) {
  const char *what = tcc__op_name(op);
  const int device = op->device;
  nccl_op_t *st = calloc(1, sizeof *st);
  if (!st) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): out of memory", what, comm->name, comm->rank);
  op->exec_state = st;
  const int64_t deadline = tcc__deadline_after_ms(op->timeout_ms);
  pthread_mutex_lock(&nccl_comm_of(comm)->lock);
  int prev = device;
  tcc_result_t r = TCC_OK;
  struct tcc__cuda *c = NULL;
  tcc__ncomm_t *n = NULL;
  if (atomic_load(&comm->aborted)) {
    r = unusable(comm, what, err);
    goto out;
  }
  c = tcc__cuda_state_for(comm, device, what, err);
  if (!c) {
    r = err->code;
    goto out;
  }
  cudaStream_t s = (cudaStream_t)stream;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  cudaError_t e = tcc__cuda_enter_device(device, &prev);
  if (e == cudaSuccess) e = cudaStreamIsCapturing(s, &cs);
  if (e != cudaSuccess) {
    r = tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): cannot use the caller's stream: %s", what,
                     comm->name, comm->rank, cudaGetErrorString(e));
    goto out;
  }
  st->captured = cs == cudaStreamCaptureStatusActive;
  const int pairwise = op->kind != TCC_OP_COLL && !tcc__comm_in_group(comm) && op->peer != comm->rank;
  if (st->captured && !(pairwise ? atomic_load(&c->pair_ready[op->peer]) : atomic_load(&c->coll_ready))) {
    /* Setup talks to the peers and makes NCCL allocate device memory: it
     * has no place in a graph (it would run once, at capture, or fail). */
    r = tcc__err_set(err, TCC_ERR_INVALID,
                     "tccomm %s on '%s' (rank %d): the caller's stream is capturing a CUDA graph, and %s needs its "
                     "NCCL communicator set up first, which cannot happen during capture: issue one such op before "
                     "capturing (or pass device_id to init_process_group for collectives)",
                     what, comm->name, comm->rank, pairwise ? "a send/recv with this peer" : "this collective");
    goto out;
  }
  n = pairwise ? tcc__cuda_pair_ncomm(comm, c, op->peer, what, deadline, err)
               : tcc__cuda_group_ncomm(comm, c, what, deadline, err);
  if (!n) {
    /* A setup that failed half way leaves the peers' NCCL in an unknown
     * state: no later op may retry it out of step with them. */
    r = fail_comm_unless_invalid(comm, err->code, err);
    goto out;
  }
  st->ncomm = n;
  st->nccl_peer = !pairwise ? op->peer : comm->rank < op->peer ? 1 : 0; /* the lower rank is 0 in a pair */
  if (atomic_load(&comm->aborted) || atomic_load(&c->nccl_aborted)) {
    r = unusable(comm, what, err);
    goto out;
  }
  /* The NCCL stream follows the caller's stream (and joins its capture). */
  e = cudaEventRecord(c->order_event, s);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(n->stream, c->order_event, 0);
  if (e != cudaSuccess) {
    r = tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): ordering after the caller's stream failed: %s",
                    what, comm->name, comm->rank, cudaGetErrorString(e));
    goto out;
  }
  if (tcc__comm_in_group(comm) && !c->nccl_group_open) {
    ncclResult_t nr = c->nccl->GroupStart();
    if (nr != ncclSuccess) {
      r = tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): ncclGroupStart failed: %s", what,
                      comm->name, comm->rank, c->nccl->GetErrorString(nr));
      goto out;
    }
    c->nccl_group_open = 1;
    thread_group.depth++;
  }
  if (!tcc__ncomm_enter(n)) {
    r = unusable(comm, what, err);
    goto out;
  }
  r = tcc__cuda_issue(comm, n, op, err);
  tcc__ncomm_leave(n);
  if (r != TCC_OK) goto out;
  if (thread_group.depth > 0) {
    /* Its kernel launches at this thread's outermost group end (whichever
     * communicator's): the event is recorded then. */
    tcc_op_retain(op);
    tcc__queue_push(&thread_group.head, &thread_group.tail, op);
  } else {
    /* A nonblocking NCCL may still be enqueueing: the completion event
     * must not be recorded before its kernels are. */
    if (n->nonblocking) r = fail_comm_unless_invalid(comm, tcc__ncomm_settle(n, what, "enqueueing", deadline, err), err);
    if (r == TCC_OK) r = complete_enqueue(comm, c, op, err);
  }
out:
  /* On success, staging memory is freed by tcc__cuda_post: already, or at
   * the group's end (an allgather in a group copies out of it then). */
  if (r != TCC_OK && n) tcc__cuda_stage_free(op, n);
  if (c) tcc__cuda_leave_device(device, prev);
  pthread_mutex_unlock(&nccl_comm_of(comm)->lock);
  if (r == TCC_OK && st->captured && atomic_load(&st->event)) tcc__cuda_finish(op, TCC_OK, NULL);
  return r;
}

/* ---- groups -------------------------------------------------------------- */

/* The communicator's outermost group ended: close its NCCL group; when
 * that was the thread's last open one, NCCL launched everything issued on
 * this thread since, and those ops are handed on. */
static tcc_result_t nccl_group_end(tcc_comm_t *comm, tcc_err_t *first_err) {
  pthread_mutex_lock(&nccl_comm_of(comm)->lock);
  struct tcc__cuda *c = nccl_state_of(comm);
  if (!c || !c->nccl_group_open) {
    pthread_mutex_unlock(&nccl_comm_of(comm)->lock);
    return TCC_OK;
  }
  int prev = c->device;
  tcc__cuda_enter_device(c->device, &prev);
  c->nccl_group_open = 0;
  const ncclResult_t nr = c->nccl->GroupEnd();
  if (--thread_group.depth > 0) {
    /* Another communicator's group is still open on this thread: nothing
     * was launched yet. A failed end is reported by the outermost one. */
    tcc__cuda_leave_device(c->device, prev);
    pthread_mutex_unlock(&nccl_comm_of(comm)->lock);
    return TCC_OK;
  }
  tcc_op_t *list = thread_group.head;
  thread_group.head = thread_group.tail = NULL;
  tcc_result_t first = TCC_OK;
  tcc_op_t *done = NULL; /* finished once the lock is released (callbacks may issue ops) */
  while (list) {
    tcc_op_t *op = list;
    list = op->next;
    op->next = NULL;
    tcc_comm_t *oc = op->comm;
    tcc__ncomm_t *n = nccl_op_of(op)->ncomm;
    tcc_err_t err = {TCC_OK, {0}};
    tcc_result_t r;
    if (nr != ncclSuccess && nr != ncclInProgress)
      r = tcc__err_set(&err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): ncclGroupEnd failed: %s",
                      tcc__op_name(op), oc->name, oc->rank, c->nccl->GetErrorString(nr));
    else if (n->nonblocking)
      /* Cheap once settled: one query per op, the first one waits. */
      r = fail_comm_unless_invalid(
          oc, tcc__ncomm_settle(n, tcc__op_name(op), "ncclGroupEnd", tcc__deadline_after_ms(op->timeout_ms), &err), &err);
    else
      r = TCC_OK;
    if (r == TCC_OK) r = complete_enqueue(oc, nccl_state_of(oc), op, &err);
    if (r != TCC_OK) {
      /* Staging memory of a group that never launched: freed in order on its stream. */
      tcc__cuda_stage_free(op, n);
      /* Kept for the message: the op is failed below, after the unlock. */
      op->result = r;
      snprintf(op->error, sizeof op->error, "%s", err.msg);
      if (first == TCC_OK) {
        first = r;
        tcc__err_set(first_err, r, "%s", err.msg);
      }
    }
    if (r != TCC_OK || nccl_op_of(op)->captured) {
      op->next = done;
      done = op; /* keeps the group's reference */
    } else {
      tcc_op_release(op); /* the group's reference; the watchdog holds its own */
    }
  }
  tcc__cuda_leave_device(c->device, prev);
  pthread_mutex_unlock(&nccl_comm_of(comm)->lock);
  while (done) {
    tcc_op_t *op = done;
    done = op->next;
    op->next = NULL;
    if (op->result == TCC_ERR_INPROGRESS) tcc__cuda_finish(op, TCC_OK, NULL);
    else {
      char msg[TCC_ERRLEN]; /* tcc__op_finish writes op->error */
      snprintf(msg, sizeof msg, "%s", op->error);
      tcc__cuda_finish(op, op->result, msg);
    }
    tcc_op_release(op);
  }
  return first;
}

static int nccl_test(tcc_op_t *op) {
  if (atomic_load(&op->finished)) return 1;
  nccl_op_t *st = nccl_op_of(op);
  cudaEvent_t ev = atomic_load(&st->event);
  if (!ev || st->captured) return 0;
  /* Relaxed capture mode: legal even while this thread captures a graph. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t q = cudaEventQuery(ev);
  cudaThreadExchangeStreamCaptureMode(&mode);
  /* An event that completed because NCCL was aborted is no result: the
   * watchdog fails that op. */
  if (tcc__cuda_ended_by_itself(nccl_state_of(op->comm), q)) tcc__cuda_finish(op, TCC_OK, NULL);
  return atomic_load(&op->finished);
}

static bool event_done(void *op) { return nccl_test(op); }

/* Polls the op's own event (the watchdog backs off while nothing
 * completes, so waiting for it would add its period to every wait); the
 * futex wakes it at once when the watchdog finishes the op first. */
static tcc_result_t nccl_wait(tcc_op_t *op, int64_t timeout_ms) {
  const tcc__idle_wait_t w = {.ready = event_done, .arg = op, .max_nap_ns = 1000 * 1000LL,
                              .deadline_ns = timeout_ms < 0 ? INT64_MAX : tcc__deadline_after_ms(timeout_ms),
                              .word = &op->finished_futex, .sleepers = &op->finished_sleepers};
  return tcc__idle_wait(&w) == TCC_OK ? op->result : TCC_ERR_INPROGRESS;
}

/* Enqueued ops progress on the device by themselves. */
static void nccl_start(tcc_op_t *op) { (void)op; }

static tcc_result_t nccl_stream_wait(tcc_op_t *op, void *stream) {
  cudaEvent_t ev = op->exec_state ? atomic_load(&nccl_op_of(op)->event) : NULL;
  if (!ev) {
    /* Still inside an open group, or it failed before being enqueued. */
    return atomic_load(&op->finished) ? op->result : TCC_ERR_INVALID;
  }
  return cudaStreamWaitEvent((cudaStream_t)stream, ev, 0) == cudaSuccess ? TCC_OK : TCC_ERR_SYSTEM;
}

static void *nccl_work_stream(const tcc_op_t *op) {
  const nccl_op_t *st = op->exec_state;
  return st && st->ncomm ? (void *)st->ncomm->stream : NULL;
}

static void nccl_op_free(tcc_op_t *op) {
  nccl_op_t *st = nccl_op_of(op);
  if (!st) return;
  cudaEvent_t ev = atomic_exchange(&st->event, NULL);
  if (ev) tcc__cuda_event_put(op->device, ev);
  free(st);
  op->exec_state = NULL;
}

static tcc_result_t nccl_attach(tcc_comm_t *comm, tcc_err_t *err) {
  nccl_comm_t *nc = calloc(1, sizeof *nc);
  if (!nc) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  pthread_mutex_init(&nc->lock, NULL);
  comm->device_state = nc;
  return TCC_OK;
}

static void nccl_wake(tcc_comm_t *comm) {
  struct tcc__cuda *c = comm->device_state ? nccl_state_of(comm) : NULL;
  if (c) tcc__cuda_watch_wake(c);
}

/* Ops of this communicator left in a group nobody ended were never
 * launched (destroy is called on the thread that opened the group); the
 * ops in flight end or fail by their deadlines; then NCCL goes. */
static void nccl_stop(tcc_comm_t *comm) {
  struct tcc__cuda *c = comm->device_state ? nccl_state_of(comm) : NULL;
  if (!c) return;
  if (c->nccl_group_open) {
    c->nccl->GroupEnd();
    c->nccl_group_open = 0;
    thread_group.depth--;
  }
  tcc_op_t *keep = NULL, **tail = &keep, *list = thread_group.head;
  thread_group.head = thread_group.tail = NULL;
  while (list) {
    tcc_op_t *op = list;
    list = op->next;
    op->next = NULL;
    if (op->comm != comm) {
      *tail = op; /* another communicator's: still waits for its group's end */
      thread_group.tail = op;
      tail = &op->next;
      continue;
    }
    tcc__cuda_finish(op, TCC_ERR_ABORTED, "tccomm: the communicator was destroyed inside an open group");
    tcc_op_release(op);
  }
  thread_group.head = keep;
  tcc__cuda_watch_stop(c);
  tcc__cuda_state_free(comm, c);
}

static void nccl_release(tcc_comm_t *comm) {
  nccl_comm_t *nc = comm->device_state;
  if (!nc) return;
  pthread_mutex_destroy(&nc->lock);
  free(nc);
  comm->device_state = NULL;
}

/* An op issued inside an open group launches at the group's end, which
 * this thread can only reach after the blocking call returned. */
static const char *nccl_cannot_block(tcc_comm_t *comm) {
  (void)comm;
  return thread_group.depth > 0 ? "an NCCL group is open on this thread (tcc_comm_group_start), and its ops launch only "
                                  "at its end: issue the op with a handle and wait after tcc_comm_group_end"
                                : NULL;
}

const tcc__executor_t tcc__device_executor = {
    .name = "nccl",
    .memory_name = "CUDA device",
    .attach = nccl_attach,
    .submit = nccl_submit,
    .cannot_block = nccl_cannot_block,
    .test = nccl_test,
    .wait = nccl_wait,
    .start = nccl_start,
    .stream_wait = nccl_stream_wait,
    .work_stream = nccl_work_stream,
    .op_free = nccl_op_free,
    .wake = nccl_wake,
    .group_end = nccl_group_end,
    .drain = tcc__cuda_drain,
    .stop = nccl_stop,
    .release = nccl_release,
};
