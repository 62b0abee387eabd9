/*
 * host_executor.c - the host executor's table (core/executor.h): lifecycle of
 * its threads, submitting and waiting. See host.h for how ops run.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "host/host.h"

static void host_stop(tcc_comm_t *comm);
static void host_release(tcc_comm_t *comm);

static tcc_result_t host_attach(tcc_comm_t *comm, tcc_err_t *err) {
  tcc_engine_t *e = calloc(1, sizeof *e);
  if (!e) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  e->peers = calloc((size_t)comm->size, sizeof *e->peers);
  e->waiter_want_write = calloc((size_t)comm->size, sizeof *e->waiter_want_write);
  if (!e->peers || !e->waiter_want_write) {
    free(e->peers);
    free(e->waiter_want_write);
    free(e);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  }
  pthread_mutex_init(&e->lock, NULL);
  pthread_mutex_init(&e->p2p_progress, NULL);
  tcc__cond_init_monotonic(&e->coll_cv); /* timed waits on the tcc__now_ns clock */
  tcc__cond_init_monotonic(&e->p2p_cv);
  tcc__cond_init_monotonic(&e->waiter_cv);
  atomic_store_explicit(&e->coll_next, 1, memory_order_relaxed); /* collectives are numbered from 1 */
  comm->engine = e;
  int rc = pthread_create(&e->coll_thread, NULL, tcc__host_coll_thread, comm);
  if (rc == 0) {
    e->coll_started = 1;
    rc = pthread_create(&e->p2p_thread, NULL, tcc__host_p2p_thread, comm);
    if (rc == 0) e->p2p_started = 1;
  }
  if (rc != 0) {
    host_stop(comm);
    host_release(comm);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s': cannot start engine threads: %s", comm->name,
                       strerror(rc));
  }
  return TCC_OK;
}

static tcc_result_t host_submit(tcc_comm_t *comm, tcc_op_t *op, void *stream, tcc_err_t *err) {
  (void)stream;
  (void)err;
  tcc_engine_t *e = comm->engine;
  /* The executor's reference. No other thread has the op before it is
   * queued below: a plain increment, not a locked one. */
  atomic_store_explicit(&op->refs, atomic_load_explicit(&op->refs, memory_order_relaxed) + 1, memory_order_relaxed);
  /* A p2p op's submitter runs the first round itself when nobody else
   * runs them (host.h): taking p2p_progress before the engine lock lets it
   * adopt its op directly, in the same locked section as the check below. */
  const bool p2p = op->kind != TCC_OP_COLL;
  const bool runs_round = p2p && pthread_mutex_trylock(&e->p2p_progress) == 0;
  pthread_mutex_lock(&e->lock);
  if (e->stopping) { /* destroy has begun: nothing runs any more */
    pthread_mutex_unlock(&e->lock);
    if (runs_round) pthread_mutex_unlock(&e->p2p_progress);
    char msg[TCC_ERRLEN];
    snprintf(msg, sizeof msg, "tccomm op on '%s' (rank %d) not run: the communicator is being destroyed",
             comm->name, comm->rank);
    tcc__op_finish(op, TCC_ERR_ABORTED, msg);
    tcc_op_release(op);
    return TCC_OK;
  }
  if (!p2p) {
    /* Numbered under the lock so numbers follow queue order; an atomic
     * increment, as a blocking call takes its number without the lock
     * (tcc__host_coll_run_now). */
    op->seq = atomic_fetch_add(&comm->coll_issued, 1) + 1;
    tcc__host_coll_push_locked(e, op);
    e->last_submit_ns = tcc__coarse_now_ns();
    if (e->coll_deep_sleep) pthread_cond_signal(&e->coll_cv); /* see host.h */
    pthread_mutex_unlock(&e->lock);
    return TCC_OK;
  }
  tcc__op_begin(op);
  /* Ops submitted earlier wait on p2p_new: this one goes behind them. */
  const bool adopt_now = runs_round && !e->p2p_new_head;
  if (!adopt_now) {
    tcc__queue_push(&e->p2p_new_head, &e->p2p_new_tail, op);
    atomic_store_explicit(&e->p2p_news, true, memory_order_release);
  }
  e->p2p_pending++;
  e->p2p_last_submit_ns = tcc__coarse_now_ns();
  pthread_mutex_unlock(&e->lock);
  /* The caller's round first; the p2p thread only when it must (host.h). */
  bool answer_due = false;
  if (runs_round && tcc__host_p2p_submitter_round(comm, op, adopt_now, &answer_due)) return TCC_OK;
  if (!runs_round && tcc__host_p2p_round_now(comm, op)) return TCC_OK;
  /* A send by reference whose frame went out, and a receive whose message
   * comes by reference, have no bytes for the thread to move: the
   * receiver reads them in one round, the answer is taken by whoever runs
   * rounds next (the thread's polls at the latest). Waking the thread for
   * the send cost 5-15 us a 128 KiB round trip through torch; for the
   * receive, 6-7 us of 32 in C (bench_mpi_pair pingpong ... handles). */
  if (op->bytes > P2P_EAGER_BYTES && !answer_due && !tcc__host_p2p_comes_by_ref(comm, op)) tcc__host_p2p_kick(comm);
  else tcc__host_p2p_wake(e, comm, false);
  return TCC_OK;
}

static void host_wake(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e) return;
  pthread_mutex_lock(&e->lock);
  pthread_cond_broadcast(&e->coll_cv);
  pthread_cond_broadcast(&e->p2p_cv);
  pthread_mutex_unlock(&e->lock);
  if (comm->ops) comm->ops->p2p_notify(comm);
}

static void host_stop(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e) return;
  pthread_mutex_lock(&e->lock);
  e->stopping = 1;
  atomic_store(&e->waiters_refused, true); /* before the look at the claim below (coll_queue.c) */
  atomic_store_explicit(&e->p2p_news, true, memory_order_release);
  pthread_cond_broadcast(&e->coll_cv);
  pthread_cond_broadcast(&e->p2p_cv);
  pthread_mutex_unlock(&e->lock);
  if (comm->ops) comm->ops->p2p_notify(comm);
  /* A thread running the queue from tcc_op_wait uses the transport: it
   * must be out before the transport goes (its op fails fast: the
   * communicator is failed before stop). A waiter giving the claim back
   * takes no lock; it wakes this wait when it sees the flag, and the wait
   * looks again every millisecond whether or not it did. */
  pthread_mutex_lock(&e->lock);
  while (atomic_load(&e->runner) == RUNNER_WAITER || e->p2p_waiter_runs) {
    const int64_t until = tcc__now_ns() + 1000000LL;
    const struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
    pthread_cond_timedwait(&e->waiter_cv, &e->lock, &ts);
  }
  pthread_mutex_unlock(&e->lock);
  /* A submitter's or poller's single round may still use the transport:
   * it holds p2p_progress, and any round after it sees `stopping`. */
  pthread_mutex_lock(&e->p2p_progress);
  pthread_mutex_unlock(&e->p2p_progress);
  if (e->coll_started) pthread_join(e->coll_thread, NULL);
  if (e->p2p_started) pthread_join(e->p2p_thread, NULL);
  e->coll_started = e->p2p_started = 0;
  tcc__host_free_unexpected(e, comm->size);
}

static void host_release(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e) return;
  pthread_mutex_destroy(&e->lock);
  pthread_mutex_destroy(&e->p2p_progress);
  pthread_cond_destroy(&e->coll_cv);
  pthread_cond_destroy(&e->p2p_cv);
  pthread_cond_destroy(&e->waiter_cv);
  free(e->peers);
  free(e->waiter_want_write);
  free(e);
  comm->engine = NULL;
}

static int host_test(tcc_op_t *op) {
  if (atomic_load(&op->finished)) return 1;
  /* A caller polling a p2p op runs its rounds, as a waiter does. */
  return op->kind != TCC_OP_COLL && op->comm->engine && tcc__host_p2p_round_now(op->comm, op);
}

static tcc_result_t host_wait(tcc_op_t *op, int64_t timeout_ms) {
  tcc_comm_t *comm = op->comm;
  /* Run the queue (p2p rounds) ourselves when nobody else is: see host.h.
   * A bounded wait must not run collectives: one, once started, runs until
   * it ends or its own deadline passes, which may be long after
   * timeout_ms. p2p rounds stop at any point, so it runs those. */
  tcc_engine_t *e = comm->engine;
  if (op->kind != TCC_OP_COLL && e) {
    const int64_t deadline_ns = timeout_ms < 0 ? INT64_MAX : tcc__deadline_after_ms(timeout_ms);
    tcc__host_drive_p2p(comm, op, deadline_ns);
    if (timeout_ms >= 0) {
      const int64_t left_ns = deadline_ns - tcc__now_ns();
      timeout_ms = left_ns > 0 ? left_ns / 1000000 : 0;
    }
  }
  if (op->kind == TCC_OP_COLL && e) {
    tcc_op_t *first;
    if (timeout_ms < 0 && tcc__host_claim_runner(e, op, &first)) {
      tcc__host_run_queue(comm, op, first);
      tcc__host_release_runner(e);
    } else if (timeout_ms >= 0) {
      op->exec->start(op);
    }
  }
  /* A waiter that ran the queue has usually finished its op by now. */
  if (atomic_load(&op->finished)) return op->result;
  return tcc__op_await(op, timeout_ms);
}

static void host_start(tcc_op_t *op) {
  /* (The engine's memory lives as long as any op of it.) */
  if (op->kind != TCC_OP_COLL) {
    if (op->comm->engine) tcc__host_p2p_kick(op->comm);
    return;
  }
  tcc_engine_t *e = op->comm->engine;
  pthread_mutex_lock(&e->lock);
  if (atomic_load(&e->runner) == RUNNER_FREE && tcc__host_coll_queued(e)) pthread_cond_signal(&e->coll_cv);
  pthread_mutex_unlock(&e->lock);
}

/* Host memory needs no stream ordering: the op is complete when it finished. */
static tcc_result_t host_stream_wait(tcc_op_t *op, void *stream) {
  (void)op;
  (void)stream;
  return TCC_OK;
}

static void host_op_free(tcc_op_t *op) { (void)op; }

/* Host ops run as they are issued; a group changes nothing for them. */
static tcc_result_t host_group_end(tcc_comm_t *comm, tcc_err_t *err) {
  (void)comm;
  (void)err;
  return TCC_OK;
}

const tcc__executor_t tcc__host_executor = {
    .name = "host",
    .memory_name = "host memory",
    .attach = host_attach,
    .submit = host_submit,
    .run_now = tcc__host_coll_run_now,
    .p2p_now = tcc__host_p2p_now,
    .p2p_move_now = tcc__host_p2p_move_now,
    .test = host_test,
    .wait = host_wait,
    .start = host_start,
    .stream_wait = host_stream_wait,
    .op_free = host_op_free,
    .wake = host_wake,
    .group_end = host_group_end,
    .stop = host_stop,
    .release = host_release,
};
