/*
 * nccl_watch.c - completion and deadlines of CUDA ops.
 *
 * NCCL ops never time out by themselves: a peer that never joins leaves
 * the kernel spinning forever. One watchdog thread per communicator polls
 * the events of the ops in flight (and ncclCommGetAsyncError); a completed
 * op is finished (its callback releases the caller's tensors), an op past
 * its deadline fails with a message naming the op, the group and the rank,
 * the communicator is marked failed and the NCCL communicator is aborted,
 * which also ends the spinning kernels. The process is not killed.
 *
 * The thread switches itself to the relaxed capture mode, so its event
 * queries are legal while another thread captures a CUDA graph. Like the
 * engine's collective thread it polls for a while after the last submit
 * and then sleeps until a submit wakes it, so issuing an op costs no
 * thread wake-up in steady state.
 */
#include "nccl/nccl_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Ops in flight: polled every 0.2 ms after a submit or a completion,
 * backing off to 10 ms while nothing completes (host waiters poll their
 * own op: nccl_executor.c, so this only bounds callbacks and deadlines). */
#define WATCH_POLL_MIN_NS (200 * 1000LL)
#define WATCH_POLL_MAX_NS (10 * 1000 * 1000LL)
#define FAILURE_GRACE_NS (1000 * 1000 * 1000LL) /* see failure_grace */
#define WATCH_IDLE_POLL_NS (5 * 1000 * 1000LL)    /* nothing in flight: 5 ms */
#define WATCH_WINDOW_NS (2000 * 1000 * 1000LL)    /* then sleep until woken */

/* ---- event pool -------------------------------------------------------------- */

#define POOL_DEVICES 64
#define POOL_MAX 1024

static struct event_pool {
  pthread_mutex_t lock;
  cudaEvent_t events[POOL_MAX];
  int n;
} pools[POOL_DEVICES] = {[0 ... POOL_DEVICES - 1] = {PTHREAD_MUTEX_INITIALIZER, {0}, 0}};

cudaEvent_t tcc__cuda_event_get(int device, cudaError_t *e) {
  cudaEvent_t ev = NULL;
  *e = cudaSuccess;
  if (device >= 0 && device < POOL_DEVICES) {
    struct event_pool *p = &pools[device];
    pthread_mutex_lock(&p->lock);
    if (p->n > 0) ev = p->events[--p->n];
    pthread_mutex_unlock(&p->lock);
    if (ev) return ev;
  }
  /* No timing: cheaper to record, and all we ask is "done yet?". The
   * relaxed capture mode keeps the creation legal while this thread
   * captures a graph in the global mode (an op issued into a capture). */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  *e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  cudaThreadExchangeStreamCaptureMode(&mode);
  return *e == cudaSuccess ? ev : NULL;
}

void tcc__cuda_event_put(int device, cudaEvent_t ev) {
  if (!ev) return;
  if (device >= 0 && device < POOL_DEVICES) {
    struct event_pool *p = &pools[device];
    pthread_mutex_lock(&p->lock);
    int kept = p->n < POOL_MAX;
    if (kept) p->events[p->n++] = ev;
    pthread_mutex_unlock(&p->lock);
    if (kept) return;
  }
  cudaEventDestroy(ev);
}

/* ---- finishing ------------------------------------------------------------------- */

int tcc__cuda_ended_by_itself(struct tcc__cuda *c, cudaError_t q) {
  return q == cudaSuccess && !atomic_load(&c->nccl_aborted);
}

void tcc__cuda_finish(tcc_op_t *op, tcc_result_t r, const char *msg) {
  if (atomic_exchange(&nccl_op_of(op)->reaped, 1)) return;
  tcc__op_finish(op, r, msg);
}

void tcc__cuda_abort_nccl(tcc_comm_t *comm, struct tcc__cuda *c) {
  /* No lock: a thread issuing an op may be stuck inside NCCL holding the
   * issue lock, and this abort is what releases it (nccl_ncomm.c). */
  if (atomic_exchange(&c->nccl_aborted, 1)) return;
  /* Every slot, set up or not: one being set up sees the flag and fails. */
  tcc__ncomm_abort(&c->coll);
  (void)comm;
  for (int p = 0; p < c->size; p++) tcc__ncomm_abort(&c->pairs[p]);
}

/* The error policy (nccl_state.h), applied before a failed op is
 * finished, so the caller never sees the error and goes on: CUDA ops that
 * fail in flight leave buffers NCCL half wrote, and kernels the caller
 * queued after them will use those. Unless the user aborted, nothing but
 * ending the process keeps that from being taken for a result. */
static void apply_error_policy(tcc_comm_t *comm, struct tcc__cuda *c, int failed_ops) {
  char cause[TCC_ERRLEN];
  const tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
  if (!failed_ops || !c->tear_down || code == TCC_ERR_ABORTED) return;
  fprintf(stderr,
          "%s\n"
          "tccomm '%s' (rank %d): tearing the process down: %d CUDA op(s) failed in flight, and work queued "
          "after them on the device would run on incomplete data (TCCOMM_ASYNC_ERROR_HANDLING=2 raises the "
          "error and marks the group unusable instead)\n",
          cause, comm->name, comm->rank, failed_ops);
  fflush(stderr);
  abort();
}

/* The communicator failed: ops whose work the device already finished
 * complete (destroy waited for them; a failure since does not undo them);
 * then NCCL is aborted and the others fail. Returns how many failed. The
 * order matters: an aborted kernel ends too, and its event with it. */
static int fail_all(tcc_comm_t *comm, struct tcc__cuda *c, tcc_op_t *list) {
  tcc_op_t *pending = NULL, **tail = &pending;
  int left = 0;
  while (list) {
    tcc_op_t *op = list;
    list = op->next;
    op->next = NULL;
    if (tcc__cuda_ended_by_itself(c, cudaEventQuery(atomic_load(&nccl_op_of(op)->event)))) {
      tcc__cuda_finish(op, TCC_OK, NULL);
      tcc_op_release(op);
      continue;
    }
    *tail = op;
    tail = &op->next;
    left++;
  }
  apply_error_policy(comm, c, left);
  /* A destroy that drained everything leaves NCCL to the graphs (comm.c). */
  if (left || !atomic_load(&c->destroying)) tcc__cuda_abort_nccl(comm, c);
  char msg[TCC_ERRLEN], cause[TCC_ERRLEN];
  tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
  while (pending) {
    tcc_op_t *op = pending;
    pending = op->next;
    op->next = NULL;
    snprintf(msg, sizeof msg, "tccomm %s on '%s' (rank %d) did not complete: %.400s", tcc__op_name(op),
             comm->name, comm->rank, cause);
    tcc__cuda_finish(op, code, msg);
    tcc_op_release(op);
  }
  return left;
}

/* Checks the ops of `list` once; returns the ones still running, in order.
 * Adds the ops it failed to *failed (the communicator then failed). Once
 * NCCL was aborted, an op whose event completed is returned too: the abort
 * may be what ended it, and fail_all decides. */
static tcc_op_t *poll_ops(tcc_comm_t *comm, struct tcc__cuda *c, tcc_op_t *list, int *failed, int *completed) {
  tcc_op_t *keep = NULL, **tail = &keep;
  const int64_t now = tcc__now_ns();
  while (list) {
    tcc_op_t *op = list;
    list = op->next;
    op->next = NULL;
    const int reaped = atomic_load(&nccl_op_of(op)->reaped);
    cudaError_t q = reaped ? cudaSuccess : cudaEventQuery(atomic_load(&nccl_op_of(op)->event));
    if (q == cudaSuccess && !reaped && !tcc__cuda_ended_by_itself(c, q)) {
      *tail = op;
      tail = &op->next;
      continue;
    }
    if (q == cudaSuccess) {
      tcc__cuda_finish(op, TCC_OK, NULL);
      tcc_op_release(op);
      (*completed)++;
      continue;
    }
    char msg[TCC_ERRLEN];
    if (q != cudaErrorNotReady) {
      snprintf(msg, sizeof msg, "tccomm %s on '%s' (rank %d) failed on the device: %s", tcc__op_name(op),
               comm->name, comm->rank, cudaGetErrorString(q));
    } else if (now > op->deadline_ns) {
      snprintf(msg, sizeof msg,
               "tccomm %s on '%s' (rank %d) timed out after %lld ms: the CUDA operation did not complete "
               "(a peer may not have joined it); the NCCL communicator was aborted",
               tcc__op_name(op), comm->name, comm->rank, (long long)op->timeout_ms);
    } else {
      *tail = op;
      tail = &op->next;
      continue;
    }
    atomic_store(&c->device_failed, 1);
    tcc__comm_fail(comm, q == cudaErrorNotReady ? TCC_ERR_TIMEOUT : TCC_ERR_SYSTEM, msg);
    apply_error_policy(comm, c, 1);
    tcc__cuda_abort_nccl(comm, c);
    tcc__cuda_finish(op, q == cudaErrorNotReady ? TCC_ERR_TIMEOUT : TCC_ERR_SYSTEM, msg);
    tcc_op_release(op);
    (*failed)++;
  }
  *tail = list; /* nothing left here, but keeps the list whole if the loop changes */
  return keep;
}

/* Puts `list` (older ops) back in front of whatever was submitted meanwhile. */
static void requeue(struct tcc__cuda *c, tcc_op_t *list) {
  if (!list) return;
  tcc_op_t *last = list;
  while (last->next) last = last->next;
  last->next = c->head;
  if (!c->head) c->tail = last;
  c->head = list;
}

struct async_check {
  tcc_comm_t *comm;
  struct tcc__cuda *c;
  int reported;
};

static void check_one(tcc__ncomm_t *n, void *arg) {
  struct async_check *a = arg;
  if (a->reported || !tcc__ncomm_enter(n)) return;
  ncclComm_t nc = atomic_load(&n->nc);
  ncclResult_t ae = ncclSuccess;
  char last[256] = "";
  const int failed = n->nccl->CommGetAsyncError(nc, &ae) == ncclSuccess && ae != ncclSuccess && ae != ncclInProgress;
  /* Copied while the handle is held: the string is NCCL's and goes with it. */
  if (failed && n->nccl->GetLastError) snprintf(last, sizeof last, "%s", n->nccl->GetLastError(nc));
  tcc__ncomm_leave(n);
  if (!failed) return;
  char msg[TCC_ERRLEN];
  snprintf(msg, sizeof msg, "tccomm '%s' (rank %d): NCCL reported an error on %s: %s%s%.200s", a->comm->name,
           a->comm->rank, n->label, n->nccl->GetErrorString(ae), *last ? ": " : "", last);
  atomic_store(&a->c->device_failed, 1);
  tcc__comm_fail(a->comm, TCC_ERR_REMOTE, msg);
  a->reported = 1;
}

static void check_async_error(tcc_comm_t *comm, struct tcc__cuda *c) {
  if (atomic_load(&comm->aborted) || atomic_load(&c->nccl_aborted)) return;
  struct async_check a = {comm, c, 0};
  tcc__cuda_each_ncomm(comm, c, check_one, &a);
}

static void timed_wait(struct tcc__cuda *c, int64_t ns) {
  int64_t until = tcc__now_ns() + ns;
  struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
  pthread_cond_timedwait(&c->cv, &c->lock, &ts);
}

/* Whether ops in flight may still complete although the communicator
 * failed. A failure the device path saw itself (an NCCL error, a device
 * error, a deadline) or an abort (destroy, the user) ends them at once. One
 * that came from elsewhere, typically a peer that left through the host
 * path, gives them FAILURE_GRACE_NS first: a peer that finished its part of
 * a collective and then left does not break it here, and NCCL's kernels
 * still end it if it did. */
static int failure_grace(tcc_comm_t *comm, struct tcc__cuda *c) {
  if (atomic_load(&c->device_failed) || tcc__comm_failure(comm, NULL, 0) == TCC_ERR_ABORTED) return 0;
  const int64_t now = tcc__now_ns();
  if (!c->failure_seen_ns) c->failure_seen_ns = now;
  return now - c->failure_seen_ns < FAILURE_GRACE_NS;
}

static void *watch_main(void *arg) {
  tcc_comm_t *comm = arg;
  struct tcc__cuda *c = nccl_state_of(comm);
  cudaSetDevice(c->device);
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  pthread_mutex_lock(&c->lock);
  for (;;) {
    if (!c->head) {
      if (c->stopping) break;
      /* abort() with nothing in flight; not destroy, which drained the
       * device: NCCL then stays for graphs that hold captured work. */
      if (atomic_load(&comm->aborted) && !atomic_load(&c->nccl_aborted) && !atomic_load(&c->destroying)) {
        pthread_mutex_unlock(&c->lock);
        tcc__cuda_abort_nccl(comm, c);
        pthread_mutex_lock(&c->lock);
        continue;
      }
      if (tcc__now_ns() - c->last_submit_ns < WATCH_WINDOW_NS) {
        timed_wait(c, WATCH_IDLE_POLL_NS);
      } else {
        c->deep_sleep = 1;
        pthread_cond_wait(&c->cv, &c->lock);
        c->deep_sleep = 0;
      }
      continue;
    }
    tcc_op_t *list = c->head;
    c->head = c->tail = NULL;
    pthread_mutex_unlock(&c->lock);

    check_async_error(comm, c);
    int failed = 0, completed = 0;
    if (atomic_load(&comm->aborted) && !failure_grace(comm, c)) {
      failed = fail_all(comm, c, list);
      list = NULL;
    } else {
      list = poll_ops(comm, c, list, &failed, &completed);
      if (failed || (list && atomic_load(&c->nccl_aborted))) {
        failed += fail_all(comm, c, list);
        list = NULL;
      }
    }

    pthread_mutex_lock(&c->lock);
    requeue(c, list);
    if (completed) c->poll_ns = WATCH_POLL_MIN_NS;
    else if (c->poll_ns < WATCH_POLL_MAX_NS) c->poll_ns *= 2;
    if (c->head) timed_wait(c, c->poll_ns);
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

tcc_result_t tcc__cuda_watch_start(tcc_comm_t *comm, struct tcc__cuda *c, tcc_err_t *err) {
  pthread_mutex_init(&c->lock, NULL);
  tcc__cond_init_monotonic(&c->cv); /* timed waits on the tcc__now_ns clock */
  c->last_submit_ns = tcc__now_ns();
  c->poll_ns = WATCH_POLL_MIN_NS;
  int rc = pthread_create(&c->thread, NULL, watch_main, comm);
  if (rc != 0)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): cannot start the CUDA watchdog: %s",
                       comm->name, comm->rank, strerror(rc));
  c->thread_started = 1;
  return TCC_OK;
}

void tcc__cuda_watch(struct tcc__cuda *c, tcc_op_t *op) {
  tcc_op_retain(op);
  op->next = NULL;
  pthread_mutex_lock(&c->lock);
  if (c->tail) c->tail->next = op; else c->head = op;
  c->tail = op;
  c->last_submit_ns = tcc__now_ns();
  c->poll_ns = WATCH_POLL_MIN_NS;
  if (c->deep_sleep) pthread_cond_signal(&c->cv); /* see the file comment */
  pthread_mutex_unlock(&c->lock);
}

void tcc__cuda_watch_wake(struct tcc__cuda *c) {
  if (!c->thread_started) return;
  pthread_mutex_lock(&c->lock);
  pthread_cond_signal(&c->cv);
  pthread_mutex_unlock(&c->lock);
}

void tcc__cuda_watch_stop(struct tcc__cuda *c) {
  if (!c->thread_started) return;
  pthread_mutex_lock(&c->lock);
  c->stopping = 1;
  pthread_cond_signal(&c->cv);
  pthread_mutex_unlock(&c->lock);
  pthread_join(c->thread, NULL);
  c->thread_started = 0;
  pthread_mutex_destroy(&c->lock);
  pthread_cond_destroy(&c->cv);
}
