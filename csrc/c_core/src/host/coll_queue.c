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

/* Runs collective c, numbered seq, until it ends or deadline_ns passes;
 * on failure err says why. What a failure leaves behind is decided here
 * for every way a collective runs (queued or at once). */
static tcc_result_t run_collective(tcc_comm_t *comm, tcc_coll_t *c, uint64_t seq, int64_t timeout_ms,
                                   int64_t deadline_ns, tcc_err_t *err) {
  if (TCC_MUTANT(BROADCAST_WRONG_ROOT) && c->kind == TCC_COLL_BROADCAST) c->root = (c->root + 1) % comm->size; /* MUTATION SITE */
  if (TCC_MUTANT(REDUCE_SCATTER_SWAP) && c->kind == TCC_COLL_REDUCE_SCATTER && comm->size > 1) { void *t = c->sends[0]; c->sends[0] = c->sends[1]; c->sends[1] = t; } /* MUTATION SITE */
  tcc_result_t r = tcc__coll_run(comm, c, seq, deadline_ns, err);
  if (TCC_MUTANT(ALLGATHER_CORRUPT_BYTE) && r == TCC_OK && c->kind == TCC_COLL_ALLGATHER && c->count) ((unsigned char *)c->recvs[(comm->rank + 1) % comm->size])[c->count * tcc__dtype_size(c->dtype) / 2] ^= 1; /* MUTATION SITE */
  if (r == TCC_OK) return TCC_OK;
  if (err->msg[0] == 0)
    tcc__err_set(err, r, "tccomm %s on '%s' (rank %d) failed: %s", tcc__coll_name(c->kind), comm->name, comm->rank,
                 tcc_result_string(r));
  /* Transports do not know the op's own timeout (per-op or the default). */
  if (r == TCC_ERR_TIMEOUT) {
    size_t len = strlen(err->msg);
    snprintf(err->msg + len, sizeof err->msg - len, " [op timeout %lld ms]", (long long)timeout_ms);
  }
  /* A mismatch is detected by every rank before data moves, so the
   * communicator stays usable; anything else leaves ranks out of step
   * (and so does a mismatch found after some ranks went on: the
   * algorithm that found it failed the communicator already). */
  if (r != TCC_ERR_MISMATCH && r != TCC_ERR_INVALID && r != TCC_ERR_UNSUPPORTED)
    tcc__comm_fail(comm, r, err->msg);
  else if (!atomic_load(&comm->aborted))
    TCC_LOG_WARN(comm->rank, "%s (the communicator stays usable)", err->msg);
  return r;
}

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
  const tcc_result_t r = run_collective(comm, &op->coll, op->seq, op->timeout_ms, op->deadline_ns, &err);
  tcc__op_finish(op, r, err.msg);
}

void tcc__host_coll_push_locked(tcc_engine_t *e, tcc_op_t *op) {
  _Atomic(tcc_op_t *) *slot = &e->coll_ring[op->seq % TCC_COLL_RING];
  /* The slot is free once the runner took op seq - TCC_COLL_RING from it;
   * behind an overflow, every op waits on the list (queue order). */
  if (!e->coll_over_head && !atomic_load_explicit(slot, memory_order_relaxed)) {
    atomic_store_explicit(slot, op, memory_order_release); /* the op's fields go with it */
    return;
  }
  tcc__queue_push(&e->coll_over_head, &e->coll_over_tail, op);
  atomic_store_explicit(&e->coll_overflowed, true, memory_order_release);
}

bool tcc__host_coll_queued(tcc_engine_t *e) {
  const unsigned long long next = atomic_load_explicit(&e->coll_next, memory_order_relaxed);
  return atomic_load_explicit(&e->coll_ring[next % TCC_COLL_RING], memory_order_relaxed) ||
         atomic_load_explicit(&e->coll_overflowed, memory_order_relaxed);
}

/* The op numbered `next` off the overflow list, or off its slot if it was
 * stored there after the caller looked (the lock makes it visible). */
static tcc_op_t *take_locked(tcc_engine_t *e, _Atomic(tcc_op_t *) *slot, unsigned long long next) {
  tcc_op_t *op = atomic_load_explicit(slot, memory_order_relaxed);
  if (op) {
    atomic_store_explicit(slot, NULL, memory_order_relaxed);
    return op;
  }
  op = e->coll_over_head;
  if (!op || op->seq != next) return NULL;
  e->coll_over_head = op->next;
  if (!e->coll_over_head) {
    e->coll_over_tail = NULL;
    atomic_store_explicit(&e->coll_overflowed, false, memory_order_relaxed);
  }
  op->next = NULL;
  return op;
}

/* The queue's next op, taken off it; NULL when there is none. Caller holds
 * the runner claim: it alone takes ops and moves coll_next. */
static tcc_op_t *take_next(tcc_engine_t *e) {
  const unsigned long long next = atomic_load_explicit(&e->coll_next, memory_order_relaxed);
  _Atomic(tcc_op_t *) *slot = &e->coll_ring[next % TCC_COLL_RING];
  tcc_op_t *op = atomic_load_explicit(slot, memory_order_acquire);
  if (op) {
    atomic_store_explicit(slot, NULL, memory_order_relaxed); /* submit refills it only after this */
  } else if (atomic_load_explicit(&e->coll_overflowed, memory_order_acquire)) {
    pthread_mutex_lock(&e->lock);
    op = take_locked(e, slot, next);
    pthread_mutex_unlock(&e->lock);
  }
  if (op) atomic_store_explicit(&e->coll_next, next + 1, memory_order_relaxed);
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
      op = take_next(e);
      if (!op) return;
    }
    execute_collective(comm, op);
    tcc_op_release(op);
    op = NULL;
  }
}

static bool claim(tcc_engine_t *e, int who) {
  int expected = RUNNER_FREE;
  return atomic_compare_exchange_strong(&e->runner, &expected, who);
}

/* A waiter claims the right to run the collective queue; at most one
 * thread holds it, so ops run one at a time in queue order. Refused once
 * destroy has begun: the stopping engine finishes the op then. With the
 * claim it takes the queue's first op, unless `until` has finished
 * already. No lock: the claim is one compare-and-swap, and the op comes
 * off the ring. */
int tcc__host_claim_runner(tcc_engine_t *e, tcc_op_t *until, tcc_op_t **first) {
  *first = NULL;
  if (!claim(e, RUNNER_WAITER)) return 0;
  /* Both sequentially consistent, as stop's store of the flag and its
   * look at the claim: either this sees the flag, or stop sees the claim
   * and waits for it. */
  if (atomic_load(&e->waiters_refused)) {
    tcc__host_release_runner(e);
    return 0;
  }
  if (!atomic_load(&until->finished)) *first = take_next(e);
  return 1;
}

/* Gives the queue back. A waiter stops running it once its own op is
 * done: ops left in it go to the collective thread, woken for them, and a
 * destroy waiting for the waiter to be out of the transport is told. The
 * plain release store costs no locked instruction; a destroy or a
 * collective thread that misses it sees it at its next timed look. */
void tcc__host_release_runner(tcc_engine_t *e) {
  atomic_store_explicit(&e->runner, RUNNER_FREE, memory_order_release);
  const bool stopping = atomic_load_explicit(&e->waiters_refused, memory_order_relaxed);
  if (stopping || tcc__host_coll_queued(e)) {
    pthread_mutex_lock(&e->lock);
    if (stopping) pthread_cond_broadcast(&e->waiter_cv);
    pthread_cond_signal(&e->coll_cv);
    pthread_mutex_unlock(&e->lock);
  }
}

/* Output an op run at once left held back: the collective thread sends
 * it once the communicator is quiet, as after a queued op (host.h). Only
 * then is the engine lock taken: the thread may sleep until signalled. */
static void note_held_output(tcc_engine_t *e) {
  pthread_mutex_lock(&e->lock);
  e->last_submit_ns = tcc__coarse_now_ns();
  if (e->coll_deep_sleep) pthread_cond_signal(&e->coll_cv);
  pthread_mutex_unlock(&e->lock);
}

/* A collective whose caller waits for it at once, run in the calling
 * thread when nothing is queued and no other thread runs the queue. It
 * takes the next number only if no op has it yet (submit numbers with an
 * atomic increment): then it runs in its turn, and ops other threads
 * submit meanwhile are numbered after it. No lock, and no op made,
 * queued, finished or released: a small op's engine costs about a fifth
 * of what it costs issued and waited for (bench/README, "Blocking calls").
 * False, with nothing done, when it must go through the queue (the
 * caller issues it as an op then). */
bool tcc__host_coll_run_now(tcc_comm_t *comm, tcc_coll_t *c, int64_t timeout_ms, tcc_result_t *result,
                            tcc_err_t *err) {
  tcc_engine_t *e = comm->engine;
  if (!e || atomic_load_explicit(&comm->aborted, memory_order_relaxed) || !claim(e, RUNNER_WAITER)) return false;
  /* What an op's reference does for a waiter: a destroy on another thread,
   * which waits for the claim to be given back, frees nothing before the
   * release below is done with the engine. */
  atomic_fetch_add(&comm->refs, 1);
  bool ran = false;
  /* As in tcc__host_claim_runner: either this sees the flag, or stop sees
   * the claim and waits for it. */
  if (!atomic_load(&e->waiters_refused)) {
    /* Ops numbered up to coll_issued were submitted, those before
     * coll_next taken: the queue is empty when coll_issued is one less. */
    const unsigned long long seq = atomic_load_explicit(&e->coll_next, memory_order_relaxed);
    unsigned long long issued = seq - 1;
    ran = atomic_compare_exchange_strong(&comm->coll_issued, &issued, seq);
    if (ran) {
      atomic_store_explicit(&e->coll_next, seq + 1, memory_order_relaxed); /* the claim's holder moves it */
      *result = run_collective(comm, c, seq, timeout_ms, tcc__coarse_deadline_after_ms(timeout_ms), err);
      if (tcc__coll_holds_output(comm)) note_held_output(e);
    }
  }
  tcc__host_release_runner(e);
  tcc__comm_release(comm);
  return ran;
}

/* The collective thread, lock held, queue empty: sends what the
 * algorithms held back once the communicator has been quiet for
 * COLL_HELD_IDLE_NS, with the runner claim (the transport's streams are
 * the runner's). */
static void send_held_when_idle(tcc_comm_t *comm, tcc_engine_t *e) {
  if (tcc__host_coll_queued(e) || e->stopping || !tcc__coll_holds_output(comm) ||
      tcc__coarse_now_ns() - e->last_submit_ns < COLL_HELD_IDLE_NS || !claim(e, RUNNER_THREAD))
    return;
  pthread_mutex_unlock(&e->lock);
  tcc__coll_idle(comm);
  atomic_store_explicit(&e->runner, RUNNER_FREE, memory_order_release);
  pthread_mutex_lock(&e->lock);
}

/* The collective thread's look at the queue, lock held: 1 when it can run
 * it, -1 when it may end (stopping, nothing left), else 0. The claim is
 * read first: once it reads free, the last holder's coll_next is seen, so
 * an empty queue is really empty (ops are stored under the lock). */
static int queue_state(tcc_engine_t *e, bool *held) {
  *held = atomic_load_explicit(&e->runner, memory_order_acquire) != RUNNER_FREE;
  if (*held) return 0;
  if (tcc__host_coll_queued(e)) return 1;
  return e->stopping ? -1 : 0;
}

void *tcc__host_coll_thread(void *arg) {
  tcc_comm_t *comm = arg;
  tcc_engine_t *e = comm->engine;
  pthread_mutex_lock(&e->lock);
  for (;;) {
    bool held;
    int state;
    while ((state = queue_state(e, &held)) == 0) {
      int64_t now = tcc__now_ns();
      /* While another thread runs the queue, look again within the poll:
       * its release wakes this thread only when it saw ops left. */
      if (held || now - e->last_submit_ns < COLL_POLL_WINDOW_NS) {
        int64_t until = now + COLL_POLL_NS;
        struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
        pthread_cond_timedwait(&e->coll_cv, &e->lock, &ts);
        if (!held) send_held_when_idle(comm, e);
      } else {
        e->coll_deep_sleep = 1;
        pthread_cond_wait(&e->coll_cv, &e->lock);
        e->coll_deep_sleep = 0;
      }
    }
    if (state < 0) break; /* stopping, nothing left */
    if (!claim(e, RUNNER_THREAD)) continue; /* a waiter was first */
    pthread_mutex_unlock(&e->lock);
    tcc__host_run_queue(comm, NULL, NULL);
    atomic_store_explicit(&e->runner, RUNNER_FREE, memory_order_release);
    pthread_mutex_lock(&e->lock);
  }
  pthread_mutex_unlock(&e->lock);
  return NULL;
}
