/*
 * coll_queue.c - the host executor's collective queue (see host.h): ops
 * run one at a time in issue order, by the collective thread or by a
 * thread waiting on one of them.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/log.h"
#include "core/mutation.h"
#include "host/host.h"

#define COLL_POLL_NS (5 * 1000 * 1000LL)               /* 5 ms */
#define COLL_POLL_WINDOW_NS (2000 * 1000 * 1000LL) /* 2 s */
/* Output the algorithms hold back (tcc__coll_holds_output) is sent by the
 * collective thread once no op was submitted for this long: a peer may
 * wait for it (it reads what it was owed before it goes on), and the
 * next op of a program that went quiet may be far off. */
#define COLL_HELD_IDLE_NS (1000 * 1000LL) /* 1 ms */

static void execute_collective(tcc_comm_t *comm, tcc_op_t *op) {
  if (atomic_load(&comm->aborted)) {
    char msg[TCC_ERRLEN], cause[TCC_ERRLEN];
    tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
    snprintf(msg, sizeof msg, "tccomm %s on '%s' (rank %d) not run: %.400s", tcc__coll_name(op->coll.kind),
             comm->name, comm->rank, cause);
    tcc__op_finish(op, code, msg);
    return;
  }
  tcc_err_t err;
  tcc__err_reset(&err);
  tcc__op_begin(op);
  tcc_coll_t *c = &op->coll; /* for the mutation sites */
  if (TCC_MUTANT(BROADCAST_WRONG_ROOT) && c->kind == TCC_COLL_BROADCAST) c->root = (c->root + 1) % comm->size; /* MUTATION SITE */
  if (TCC_MUTANT(REDUCE_SCATTER_SWAP) && c->kind == TCC_COLL_REDUCE_SCATTER && comm->size > 1) { void *t = c->sends[0]; c->sends[0] = c->sends[1]; c->sends[1] = t; } /* MUTATION SITE */
  tcc_result_t r = tcc__coll_run(comm, &op->coll, op->seq, op->deadline_ns, &err);
  if (TCC_MUTANT(ALLGATHER_CORRUPT_BYTE) && r == TCC_OK && c->kind == TCC_COLL_ALLGATHER && c->count) ((unsigned char *)c->recvs[(comm->rank + 1) % comm->size])[c->count * tcc_dtype_size(c->dtype) / 2] ^= 1; /* MUTATION SITE */
  if (r != TCC_OK && err.msg[0] == 0)
    tcc__err_set(&err, r, "tccomm %s on '%s' (rank %d) failed: %s", tcc__coll_name(op->coll.kind),
                comm->name, comm->rank, tcc_result_string(r));
  /* Transports do not know the op's own timeout (per-op or the default). */
  if (r == TCC_ERR_TIMEOUT) {
    size_t len = strlen(err.msg);
    snprintf(err.msg + len, sizeof err.msg - len, " [op timeout %lld ms]", (long long)op->timeout_ms);
  }
  /* A mismatch is detected by every rank before data moves, so the
   * communicator stays usable; anything else leaves ranks out of step
   * (and so does a mismatch found after some ranks went on: the
   * algorithm that found it failed the communicator already). */
  if (r != TCC_OK && r != TCC_ERR_MISMATCH && r != TCC_ERR_INVALID && r != TCC_ERR_UNSUPPORTED)
    tcc__comm_fail(comm, r, err.msg);
  else if (r != TCC_OK && !atomic_load(&comm->aborted))
    TCC_LOG_WARN(comm->rank, "%s (the communicator stays usable)", err.msg);
  tcc__op_finish(op, r, err.msg);
}

/* The queue's first op, taken off it; NULL when empty. Caller holds the lock. */
static tcc_op_t *pop_locked(tcc_engine_t *e) {
  tcc_op_t *op = e->coll_head;
  if (op) {
    e->coll_head = op->next;
    if (!e->coll_head) e->coll_tail = NULL;
    op->next = NULL;
  }
  return op;
}

/* Runs `first` (already taken off the queue, or NULL), then queued
 * collectives in order until the queue is empty, or until `until` has
 * finished. Caller holds the runner claim. */
void tcc__host_run_queue(tcc_comm_t *comm, tcc_op_t *until, tcc_op_t *first) {
  tcc_engine_t *e = comm->engine;
  for (tcc_op_t *op = first;;) {
    if (!op) {
      if (until && atomic_load(&until->finished)) return;
      pthread_mutex_lock(&e->lock);
      op = pop_locked(e);
      pthread_mutex_unlock(&e->lock);
      if (!op) return;
    }
    execute_collective(comm, op);
    tcc_op_release(op);
    op = NULL;
  }
}

/* A waiter claims the right to run the collective queue; at most one
 * thread holds it, so ops run one at a time in queue order. Refused once
 * destroy has begun: the stopping engine finishes the op then. With the
 * claim it takes the queue's first op in the same critical section (one
 * lock round per op fewer), unless `until` has finished already. */
int tcc__host_claim_runner(tcc_engine_t *e, tcc_op_t *until, tcc_op_t **first) {
  *first = NULL;
  pthread_mutex_lock(&e->lock);
  int got = !e->runner_busy && !e->stopping;
  if (got) {
    e->runner_busy = e->waiter_runs = 1;
    if (!atomic_load(&until->finished)) *first = pop_locked(e);
  }
  pthread_mutex_unlock(&e->lock);
  return got;
}

/* Gives the queue back; wakes the collective thread if work is left (a
 * waiter stops running the queue once its own op is done), and a destroy
 * that waits for the waiter to be out of the transport. */
void tcc__host_release_runner(tcc_engine_t *e) {
  pthread_mutex_lock(&e->lock);
  e->runner_busy = 0;
  if (e->waiter_runs && e->stopping) pthread_cond_broadcast(&e->waiter_cv);
  e->waiter_runs = 0;
  if (e->coll_head || e->stopping) pthread_cond_signal(&e->coll_cv);
  pthread_mutex_unlock(&e->lock);
}

/* The collective thread, lock held, queue empty or not: sends what the
 * algorithms held back once the communicator has been quiet for
 * COLL_HELD_IDLE_NS, with the runner claim (the transport's streams are
 * the runner's). */
static void send_held_when_idle(tcc_comm_t *comm, tcc_engine_t *e) {
  if (e->coll_head || e->runner_busy || e->stopping || !tcc__coll_holds_output(comm) ||
      tcc__coarse_now_ns() - e->last_submit_ns < COLL_HELD_IDLE_NS)
    return;
  e->runner_busy = 1;
  pthread_mutex_unlock(&e->lock);
  tcc__coll_idle(comm);
  pthread_mutex_lock(&e->lock);
  e->runner_busy = 0;
}

void *tcc__host_coll_thread(void *arg) {
  tcc_comm_t *comm = arg;
  tcc_engine_t *e = comm->engine;
  pthread_mutex_lock(&e->lock);
  for (;;) {
    while (!(e->coll_head && !e->runner_busy) && !(e->stopping && !e->coll_head)) {
      int64_t now = tcc__now_ns();
      if (now - e->last_submit_ns < COLL_POLL_WINDOW_NS) {
        int64_t until = now + COLL_POLL_NS;
        struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
        pthread_cond_timedwait(&e->coll_cv, &e->lock, &ts);
        send_held_when_idle(comm, e);
      } else {
        e->coll_deep_sleep = 1;
        pthread_cond_wait(&e->coll_cv, &e->lock);
        e->coll_deep_sleep = 0;
      }
    }
    if (!e->coll_head) break; /* stopping, nothing left */
    e->runner_busy = 1;
    tcc_op_t *first = pop_locked(e);
    pthread_mutex_unlock(&e->lock);
    tcc__host_run_queue(comm, NULL, first);
    tcc__host_release_runner(e);
    pthread_mutex_lock(&e->lock);
  }
  pthread_mutex_unlock(&e->lock);
  return NULL;
}
