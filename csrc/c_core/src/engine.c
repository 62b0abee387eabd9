/*
 * engine.c - executes a communicator's ops.
 *
 * Collectives: a FIFO queue executed strictly in issue order by whoever
 * holds the runner claim: the collective thread, or a thread blocked in
 * tcc_op_wait() on a queued op. Letting the waiter run its own op saves two
 * thread hand-offs per synchronous collective, which dominates small-message
 * latency when ranks outnumber cores.
 *
 * For the same reason submitting does not wake the collective thread while
 * the communicator is busy: waking a third thread per op on a machine whose
 * cores are busy spinning in barriers costs more than the op (2 ranks on 2
 * cores: 4.4 us per small allreduce without the wake, 7-22 us with it).
 * Instead, tcc_op_start() wakes it for ops handed to futures or polls,
 * and for COLL_POLL_WINDOW_NS after the last submit it polls the queue
 * every COLL_POLL_NS, so any other op nobody waits on (fire-and-forget)
 * still starts within that interval; after a quiet spell it sleeps until
 * a submit wakes it.
 *
 * Point-to-point: a dedicated thread frames messages (header + payload) on
 * the transport's per-peer byte streams and matches them to posted
 * receives by (peer, tag, order). Unmatched arrivals are buffered. It runs
 * independently of collectives so a pending send never blocks the queue.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda.h"
#include "internal.h"
#include "mutation.h"
#include "p2p_frame.h"

#define COLL_POLL_NS (5 * 1000 * 1000LL)               /* 5 ms */
#define COLL_POLL_WINDOW_NS (2000 * 1000 * 1000LL) /* 2 s */

/* A message that arrived before its receive was posted. */
typedef struct unexpected_msg {
  uint64_t tag;
  uint64_t arrival; /* order of arrival over all peers (any-source matching) */
  size_t bytes;
  void *data;
  struct unexpected_msg *next;
} unexpected_msg_t;

/* Per-peer state, touched only by the p2p thread. */
typedef struct peer_state {
  tcc_op_t *send_head, *send_tail; /* sends in issue order */
  tcc_op_t *recv_head, *recv_tail; /* posted, unmatched receives */
  unexpected_msg_t *unexp_head, *unexp_tail;
  /* incoming message being read */
  tcc_p2p_frame_t in_hdr;
  size_t in_hdr_got;
  int in_payload;          /* 1 while reading a payload */
  char *in_dst;            /* where the payload goes (NULL: discard) */
  size_t in_remaining;
  size_t in_discard;       /* bytes still to drop (size mismatch) */
  tcc_op_t *in_op;         /* receive being filled, or NULL */
  unexpected_msg_t *in_unexp; /* buffer being filled, or NULL */
  tcc_result_t broken;        /* TCC_OK while the stream to this peer works */
  char broken_msg[TCC_ERRLEN];
} peer_state_t;

struct tcc_engine {
  pthread_mutex_t lock;
  pthread_cond_t coll_cv;
  pthread_cond_t p2p_cv;
  tcc_op_t *coll_head, *coll_tail;
  tcc_op_t *p2p_new_head, *p2p_new_tail;
  int stopping;
  int p2p_idle; /* p2p thread sleeping on p2p_cv */
  int runner_busy; /* a thread is running the collective queue */
  int waiter_runs; /* the runner is a thread in tcc_op_wait; stop waits until it is out */
  pthread_cond_t waiter_cv;
  int coll_deep_sleep;      /* the collective thread sleeps until signalled */
  int64_t last_submit_ns;   /* last collective submitted (tcc_now_ns) */
  pthread_t coll_thread, p2p_thread;
  int coll_started, p2p_started;
  peer_state_t *peers;
  /* Posted receives from any source, in posting order (p2p thread only).
   * A p2p op's `seq` is its posting number, so a message goes to the
   * earliest-posted receive it matches, specific or any-source. */
  tcc_op_t *any_head, *any_tail;
  uint64_t posted, arrived;
  atomic_int p2p_pending; /* ops owned by the p2p thread (it decrements without the lock) */
};

/* ---- op completion ---------------------------------------------------- */

void tcc_op_finish(tcc_op_t *op, tcc_result_t result, const char *msg) {
  op->result = result;
  if (result != TCC_OK && msg) snprintf(op->error, sizeof op->error, "%s", msg);
  pthread_mutex_lock(&op->cb_lock);
  tcc_op_callback_t cb = op->cb;
  void *arg = op->cb_arg;
  op->cb = NULL;
  atomic_store(&op->finished, 1);
  pthread_mutex_unlock(&op->cb_lock);
  /* The callback runs before waiters wake, so when wait() returns any
   * future completed by the callback is already complete. */
  if (cb) cb(op, arg);
  atomic_fetch_add(&op->finished_futex, 1);
  tcc_futex_wake_all(&op->finished_futex);
}

/* ---- collectives ------------------------------------------------------ */

static void execute_collective(tcc_comm_t *comm, tcc_op_t *op) {
  if (atomic_load(&comm->aborted)) {
    char msg[TCC_ERRLEN];
    pthread_mutex_lock(&comm->fail_lock);
    snprintf(msg, sizeof msg, "tccomm %s on '%s' (rank %d) not run: %.400s",
             tcc_coll_name(op->coll.kind), comm->name, comm->rank, comm->fail_msg);
    tcc_result_t code = comm->fail_code;
    pthread_mutex_unlock(&comm->fail_lock);
    tcc_op_finish(op, code, msg);
    return;
  }
  tcc_err_t err = {TCC_OK, {0}};
  op->deadline_ns = tcc_deadline_after_ms(op->timeout_ms);
  tcc_coll_t *c = &op->coll; /* for the mutation sites */
  if (TCC_MUTANT(BROADCAST_WRONG_ROOT) && c->kind == TCC_COLL_BROADCAST) c->root = (c->root + 1) % comm->size; /* MUTATION SITE */
  if (TCC_MUTANT(REDUCE_SCATTER_SWAP) && c->kind == TCC_COLL_REDUCE_SCATTER && comm->size > 1) { void *t = c->sends[0]; c->sends[0] = c->sends[1]; c->sends[1] = t; } /* MUTATION SITE */
  tcc_result_t r = comm->ops->run_collective(comm, &op->coll, op->seq, op->deadline_ns, &err);
  if (TCC_MUTANT(ALLGATHER_CORRUPT_BYTE) && r == TCC_OK && c->kind == TCC_COLL_ALLGATHER && c->count) ((unsigned char *)c->recvs[(comm->rank + 1) % comm->size])[c->count * tcc_dtype_size(c->dtype) / 2] ^= 1; /* MUTATION SITE */
  if (r != TCC_OK && err.msg[0] == 0)
    tcc_err_set(&err, r, "tccomm %s on '%s' (rank %d) failed: %s", tcc_coll_name(op->coll.kind),
                comm->name, comm->rank, tcc_result_string(r));
  /* Transports do not know the op's own timeout (per-op or the default). */
  if (r == TCC_ERR_TIMEOUT) {
    size_t len = strlen(err.msg);
    snprintf(err.msg + len, sizeof err.msg - len, " [op timeout %lld ms]", (long long)op->timeout_ms);
  }
  /* A mismatch is detected by every rank before data moves, so the
   * communicator stays usable; anything else leaves ranks out of step. */
  if (r != TCC_OK && r != TCC_ERR_MISMATCH && r != TCC_ERR_INVALID && r != TCC_ERR_UNSUPPORTED)
    tcc_comm_fail(comm, r, err.msg);
  tcc_op_finish(op, r, err.msg);
}

/* Runs queued collectives in order until the queue is empty, or until
 * `until` has finished. Caller holds the runner claim. */
static void run_collective_queue(tcc_comm_t *comm, tcc_op_t *until) {
  tcc_engine_t *e = comm->engine;
  for (;;) {
    if (until && atomic_load(&until->finished)) return;
    pthread_mutex_lock(&e->lock);
    tcc_op_t *op = e->coll_head;
    if (op) {
      e->coll_head = op->next;
      if (!e->coll_head) e->coll_tail = NULL;
      op->next = NULL;
    }
    pthread_mutex_unlock(&e->lock);
    if (!op) return;
    execute_collective(comm, op);
    tcc_op_release(op);
  }
}

/* A waiter claims the right to run the collective queue; at most one
 * thread holds it, so ops run one at a time in queue order. Refused once
 * destroy has begun: the stopping engine finishes the op then. */
static int claim_runner(tcc_engine_t *e) {
  pthread_mutex_lock(&e->lock);
  int got = !e->runner_busy && !e->stopping;
  if (got) e->runner_busy = e->waiter_runs = 1;
  pthread_mutex_unlock(&e->lock);
  return got;
}

/* Gives the queue back; wakes the collective thread if work is left (a
 * waiter stops running the queue once its own op is done), and a destroy
 * that waits for the waiter to be out of the transport. */
static void release_runner(tcc_engine_t *e) {
  pthread_mutex_lock(&e->lock);
  e->runner_busy = 0;
  if (e->waiter_runs && e->stopping) pthread_cond_broadcast(&e->waiter_cv);
  e->waiter_runs = 0;
  if (e->coll_head || e->stopping) pthread_cond_signal(&e->coll_cv);
  pthread_mutex_unlock(&e->lock);
}

static void *collective_thread_main(void *arg) {
  tcc_comm_t *comm = arg;
  tcc_engine_t *e = comm->engine;
  pthread_mutex_lock(&e->lock);
  for (;;) {
    while (!(e->coll_head && !e->runner_busy) && !(e->stopping && !e->coll_head)) {
      int64_t now = tcc_now_ns();
      if (now - e->last_submit_ns < COLL_POLL_WINDOW_NS) {
        int64_t until = now + COLL_POLL_NS;
        struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
        pthread_cond_timedwait(&e->coll_cv, &e->lock, &ts);
      } else {
        e->coll_deep_sleep = 1;
        pthread_cond_wait(&e->coll_cv, &e->lock);
        e->coll_deep_sleep = 0;
      }
    }
    if (!e->coll_head) break; /* stopping, nothing left */
    e->runner_busy = 1;
    pthread_mutex_unlock(&e->lock);
    run_collective_queue(comm, NULL);
    release_runner(e);
    pthread_mutex_lock(&e->lock);
  }
  pthread_mutex_unlock(&e->lock);
  return NULL;
}

/* ---- point to point --------------------------------------------------- */

/* Fails a p2p op with a message naming the op, the group, both ranks and the tag. */
static void fail_p2p_op(tcc_op_t *op, tcc_result_t code, const char *cause) {
  char msg[TCC_ERRLEN], peer[32];
  const int is_send = op->kind == TCC_OP_SEND;
  if (op->peer == TCC_ANY_SOURCE) snprintf(peer, sizeof peer, "any rank");
  else snprintf(peer, sizeof peer, "rank %d", op->peer);
  snprintf(msg, sizeof msg, "tccomm %s on '%s' (rank %d) %s %s, tag %llu: %.360s",
           is_send ? "send" : "recv", op->comm->name, op->comm->rank, is_send ? "to" : "from", peer,
           (unsigned long long)op->tag, cause);
  tcc_op_finish(op, code, msg);
}

static void queue_push(tcc_op_t **head, tcc_op_t **tail, tcc_op_t *op) {
  op->next = NULL;
  if (*tail) (*tail)->next = op; else *head = op;
  *tail = op;
}

static void finish_p2p(tcc_engine_t *e, tcc_op_t *op, tcc_result_t r, const char *cause) {
  if (r == TCC_OK) tcc_op_finish(op, TCC_OK, NULL);
  else fail_p2p_op(op, r, cause);
  e->p2p_pending--;
  tcc_op_release(op);
}

/* Starts filling a posted receive from a message of `bytes` bytes. */
static void start_payload_into_recv(tcc_engine_t *e, peer_state_t *ps, tcc_op_t *op, size_t bytes) {
  if (bytes != op->bytes) {
    char cause[160];
    snprintf(cause, sizeof cause, "size mismatch: the receive buffer holds %zu bytes, the peer sent %zu",
             op->bytes, bytes);
    finish_p2p(e, op, TCC_ERR_MISMATCH, cause);
    ps->in_op = NULL;
    ps->in_dst = NULL;
    ps->in_discard = bytes;
    ps->in_remaining = 0;
  } else {
    ps->in_op = op;
    ps->in_dst = op->buf;
    ps->in_remaining = bytes;
    ps->in_discard = 0;
  }
}

/* Matches a posted receive against buffered arrivals. Returns 1 if done. */
static int match_unexpected(tcc_engine_t *e, peer_state_t *ps, tcc_op_t *op) {
  if (TCC_MUTANT(P2P_TAG_IGNORED) && ps->unexp_head && ps->unexp_head != ps->in_unexp) op->tag = ps->unexp_head->tag; /* MUTATION SITE */
  unexpected_msg_t *prev = NULL;
  for (unexpected_msg_t *m = ps->unexp_head; m; prev = m, m = m->next) {
    if (m->tag != op->tag || m == ps->in_unexp) continue;
    if (prev) prev->next = m->next; else ps->unexp_head = m->next;
    if (ps->unexp_tail == m) ps->unexp_tail = prev;
    if (m->bytes != op->bytes) {
      char cause[160];
      snprintf(cause, sizeof cause, "size mismatch: the receive buffer holds %zu bytes, the peer sent %zu",
               op->bytes, m->bytes);
      finish_p2p(e, op, TCC_ERR_MISMATCH, cause);
    } else {
      if (m->bytes) memcpy(op->buf, m->data, m->bytes);
      finish_p2p(e, op, TCC_OK, NULL);
    }
    free(m->data);
    free(m);
    return 1;
  }
  return 0;
}

static tcc_op_t *take_posted_recv_from(tcc_op_t **head, tcc_op_t **tail, uint64_t tag) {
  tcc_op_t *prev = NULL;
  for (tcc_op_t *op = *head; op; prev = op, op = op->next) {
    if (op->tag != tag) continue;
    if (prev) prev->next = op->next; else *head = op->next;
    if (*tail == op) *tail = prev;
    op->next = NULL;
    return op;
  }
  return NULL;
}

static tcc_op_t *take_posted_recv(peer_state_t *ps, uint64_t tag) {
  return take_posted_recv_from(&ps->recv_head, &ps->recv_tail, tag);
}

/* The earliest-posted any-source receive for `tag`, unlinked; NULL if none. */
static tcc_op_t *take_any_recv(tcc_engine_t *e, uint64_t tag) {
  return take_posted_recv_from(&e->any_head, &e->any_tail, tag);
}

/* The receive a message with `tag` from `peer` goes to: the earlier posted
 * of that peer's first matching receive and the first matching any-source
 * one (the other stays posted). Unlinked; NULL if none. */
static tcc_op_t *take_recv_for(tcc_engine_t *e, peer_state_t *ps, int peer, uint64_t tag) {
  if (TCC_MUTANT(P2P_TAG_IGNORED) && ps->recv_head) tag = ps->recv_head->tag; /* MUTATION SITE */
  tcc_op_t *mine = NULL, *any = NULL;
  for (tcc_op_t *op = ps->recv_head; op && !mine; op = op->next)
    if (op->tag == tag) mine = op;
  for (tcc_op_t *op = e->any_head; op && !any; op = op->next)
    if (op->tag == tag) any = op;
  if (any && (!mine || any->seq < mine->seq)) {
    tcc_op_t *op = take_any_recv(e, tag);
    op->source = peer; /* published by the op's completion */
    return op;
  }
  return mine ? take_posted_recv(ps, tag) : NULL;
}

/* Matches an any-source receive against the buffered arrivals of every
 * peer, oldest arrival first. Returns 1 if done. */
static int match_unexpected_any(tcc_comm_t *comm, tcc_op_t *op) {
  tcc_engine_t *e = comm->engine;
  int best = -1;
  uint64_t best_arrival = UINT64_MAX;
  for (int p = 0; p < comm->size; p++) {
    peer_state_t *ps = &e->peers[p];
    for (unexpected_msg_t *m = ps->unexp_head; m; m = m->next) {
      if (m->tag != op->tag) continue;
      /* Only a peer's first message with this tag may match, and not while
       * it is still arriving. */
      if (m != ps->in_unexp && m->arrival < best_arrival) best = p, best_arrival = m->arrival;
      break;
    }
  }
  if (best < 0) return 0;
  op->source = best;
  return match_unexpected(e, &e->peers[best], op);
}

/* Moves bytes of the head send of one peer. Returns bytes moved or -1. */
static ssize_t progress_send(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err) {
  tcc_engine_t *e = comm->engine;
  ssize_t moved = 0;
  while (ps->send_head) {
    tcc_op_t *op = ps->send_head;
    size_t total = sizeof(tcc_p2p_frame_t) + op->bytes;
    while (op->done_bytes < total) {
      ssize_t n;
      if (op->done_bytes < sizeof(tcc_p2p_frame_t)) {
        tcc_p2p_frame_t h;
        tcc_p2p_frame_make(&h, op->tag, op->bytes);
        n = comm->ops->p2p_write(comm, peer, (char *)&h + op->done_bytes,
                                 sizeof h - op->done_bytes, err);
      } else {
        size_t off = op->done_bytes - sizeof(tcc_p2p_frame_t);
        n = comm->ops->p2p_write(comm, peer, (char *)op->buf + off, op->bytes - off, err);
      }
      if (n < 0) return -1;
      if (n == 0) return moved;
      op->done_bytes += (size_t)n;
      moved += n;
    }
    ps->send_head = op->next;
    if (!ps->send_head) ps->send_tail = NULL;
    finish_p2p(e, op, TCC_OK, NULL);
  }
  return moved;
}

/* Reads whatever one peer has sent. Returns bytes moved or -1. */
static ssize_t progress_recv(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err) {
  tcc_engine_t *e = comm->engine;
  ssize_t moved = 0;
  for (;;) {
    if (!ps->in_payload) {
      ssize_t n = comm->ops->p2p_read(comm, peer, (char *)&ps->in_hdr + ps->in_hdr_got,
                                      sizeof ps->in_hdr - ps->in_hdr_got, err);
      if (n < 0) return -1;
      if (n == 0) return moved;
      moved += n;
      ps->in_hdr_got += (size_t)n;
      if (ps->in_hdr_got < sizeof ps->in_hdr) continue;
      if (tcc_p2p_frame_check(comm, peer, &ps->in_hdr, err) != TCC_OK) return -1;
      ps->in_hdr_got = 0;
      ps->in_payload = 1;
      size_t bytes = (size_t)ps->in_hdr.bytes;
      tcc_op_t *op = take_recv_for(e, ps, peer, ps->in_hdr.tag);
      if (op) {
        start_payload_into_recv(e, ps, op, bytes);
      } else {
        unexpected_msg_t *m = calloc(1, sizeof *m);
        void *data = bytes ? malloc(bytes) : NULL;
        if (!m || (bytes && !data)) {
          free(m);
          free(data);
          tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm p2p on '%s' (rank %d): out of memory buffering %zu bytes",
                      comm->name, comm->rank, bytes);
          return -1;
        }
        m->tag = ps->in_hdr.tag;
        m->arrival = ++e->arrived;
        m->bytes = bytes;
        m->data = data;
        /* Listed now so later messages with the same tag stay behind it. */
        if (ps->unexp_tail) ps->unexp_tail->next = m; else ps->unexp_head = m;
        ps->unexp_tail = m;
        ps->in_unexp = m;
        ps->in_op = NULL;
        ps->in_dst = data;
        ps->in_remaining = bytes;
        ps->in_discard = 0;
      }
    }
    /* payload */
    while (ps->in_remaining > 0 || ps->in_discard > 0) {
      ssize_t n;
      if (ps->in_remaining > 0) {
        n = comm->ops->p2p_read(comm, peer, ps->in_dst, ps->in_remaining, err);
        if (n > 0) { ps->in_dst += n; ps->in_remaining -= (size_t)n; }
      } else {
        char sink[4096];
        size_t want = ps->in_discard < sizeof sink ? ps->in_discard : sizeof sink;
        n = comm->ops->p2p_read(comm, peer, sink, want, err);
        if (n > 0) ps->in_discard -= (size_t)n;
      }
      if (n < 0) return -1;
      if (n == 0) return moved;
      moved += n;
    }
    ps->in_payload = 0;
    if (ps->in_op) {
      tcc_op_t *op = ps->in_op;
      ps->in_op = NULL;
      finish_p2p(e, op, TCC_OK, NULL);
    } else if (ps->in_unexp) {
      unexpected_msg_t *m = ps->in_unexp;
      ps->in_unexp = NULL;
      /* A receive may have been posted while the payload streamed in. */
      tcc_op_t *op = take_recv_for(e, ps, peer, m->tag);
      if (op) match_unexpected(e, ps, op);
    }
  }
}

/* Hands newly submitted p2p ops to their peers' queues. */
static void adopt_new_p2p_ops(tcc_comm_t *comm, tcc_op_t *list) {
  tcc_engine_t *e = comm->engine;
  while (list) {
    tcc_op_t *op = list;
    list = op->next;
    op->seq = ++e->posted;
    if (op->peer == TCC_ANY_SOURCE) {
      if (!match_unexpected_any(comm, op)) queue_push(&e->any_head, &e->any_tail, op);
      continue;
    }
    peer_state_t *ps = &e->peers[op->peer];
    /* Messages that arrived before the stream broke still match. */
    if (op->kind == TCC_OP_RECV && match_unexpected(e, ps, op)) continue;
    if (ps->broken != TCC_OK) {
      finish_p2p(e, op, ps->broken, ps->broken_msg);
      continue;
    }
    if (op->kind == TCC_OP_SEND) queue_push(&ps->send_head, &ps->send_tail, op);
    else queue_push(&ps->recv_head, &ps->recv_tail, op);
  }
}

/* Fails the ops of one queue whose deadline passed (or all of them if
 * `all`, with `code` and `cause`). */
static void expire_queue(tcc_comm_t *comm, tcc_op_t **head, tcc_op_t **tail, int64_t now, int all,
                         tcc_result_t code, const char *cause) {
  tcc_op_t **link = head, *prev = NULL;
  while (*link) {
    tcc_op_t *op = *link;
    if (!all && now <= op->deadline_ns) {
      prev = op;
      link = &op->next;
      continue;
    }
    /* A send cut part-way leaves the byte stream unusable. */
    if (!all && op->kind == TCC_OP_SEND && op->done_bytes > 0)
      tcc_comm_fail(comm, TCC_ERR_TIMEOUT, "a point-to-point send timed out part-way");
    *link = op->next;
    if (*tail == op) *tail = prev;
    char why[TCC_ERRLEN];
    if (all)
      snprintf(why, sizeof why, "%.300s", cause);
    else
      snprintf(why, sizeof why, "timed out after %lld ms: %s (%.300s)", (long long)op->timeout_ms,
               op->kind == TCC_OP_SEND ? "the peer did not receive it" : "no matching send arrived",
               cause);
    finish_p2p(comm->engine, op, all ? code : TCC_ERR_TIMEOUT, why);
  }
}

/* Fails one peer's p2p ops whose deadline passed (or all of them if `all`). */
static void expire_peer_ops(tcc_comm_t *comm, peer_state_t *ps, int64_t now, int all,
                            tcc_result_t code, const char *cause) {
  expire_queue(comm, &ps->send_head, &ps->send_tail, now, all, code, cause);
  expire_queue(comm, &ps->recv_head, &ps->recv_tail, now, all, code, cause);
  if (ps->in_op && (all || now > ps->in_op->deadline_ns)) {
    tcc_op_t *op = ps->in_op;
    ps->in_op = NULL;
    ps->in_discard = ps->in_remaining;
    ps->in_remaining = 0;
    ps->in_dst = NULL;
    finish_p2p(comm->engine, op, all ? code : TCC_ERR_TIMEOUT,
               all ? cause : "timed out while the message was arriving");
  }
}

static void expire_p2p_ops(tcc_comm_t *comm, int64_t now, int all, tcc_result_t code,
                           const char *cause) {
  for (int p = 0; p < comm->size; p++)
    expire_peer_ops(comm, &comm->engine->peers[p], now, all, code, cause);
  expire_queue(comm, &comm->engine->any_head, &comm->engine->any_tail, now, all, code, cause);
}

/* The stream to one peer failed (typically: it closed its communicator
 * after its last op). Only ops involving that peer fail; the streams to
 * the other peers carry on, as they would with separate connections. */
static void break_peer(tcc_comm_t *comm, peer_state_t *ps, const tcc_err_t *err) {
  ps->broken = err->code;
  snprintf(ps->broken_msg, sizeof ps->broken_msg, "%s", err->msg);
  expire_peer_ops(comm, ps, 0, 1, err->code, err->msg);
  /* Any-source receives wait while some peer may still send. */
  tcc_engine_t *e = comm->engine;
  for (int p = 0; p < comm->size; p++)
    if (p != comm->rank && e->peers[p].broken == TCC_OK) return;
  expire_queue(comm, &e->any_head, &e->any_tail, 0, 1, err->code, err->msg);
}

static void free_unexpected(tcc_engine_t *e, int size) {
  for (int p = 0; p < size; p++) {
    unexpected_msg_t *m = e->peers[p].unexp_head;
    while (m) {
      unexpected_msg_t *next = m->next;
      free(m->data);
      free(m);
      m = next;
    }
    e->peers[p].unexp_head = e->peers[p].unexp_tail = NULL;
  }
}

static void *p2p_thread_main(void *arg) {
  tcc_comm_t *comm = arg;
  tcc_engine_t *e = comm->engine;
  bool *want_write = calloc((size_t)comm->size, sizeof *want_write);
  int idle_spins = 0;
  for (;;) {
    pthread_mutex_lock(&e->lock);
    tcc_op_t *fresh = e->p2p_new_head;
    e->p2p_new_head = e->p2p_new_tail = NULL;
    if (!fresh && e->p2p_pending == 0) {
      if (e->stopping) {
        pthread_mutex_unlock(&e->lock);
        break;
      }
      e->p2p_idle = 1;
      pthread_cond_wait(&e->p2p_cv, &e->lock);
      e->p2p_idle = 0;
      pthread_mutex_unlock(&e->lock);
      continue;
    }
    int stopping = e->stopping;
    pthread_mutex_unlock(&e->lock);
    adopt_new_p2p_ops(comm, fresh);

    if (atomic_load(&comm->aborted) || stopping) {
      char cause[TCC_ERRLEN];
      pthread_mutex_lock(&comm->fail_lock);
      snprintf(cause, sizeof cause, "%s",
               atomic_load(&comm->aborted) ? comm->fail_msg : "the communicator was destroyed");
      tcc_result_t code = atomic_load(&comm->aborted) ? comm->fail_code : TCC_ERR_ABORTED;
      pthread_mutex_unlock(&comm->fail_lock);
      expire_p2p_ops(comm, 0, 1, code, cause);
      continue;
    }

    ssize_t moved = 0;
    for (int p = 0; p < comm->size; p++) {
      peer_state_t *ps = &e->peers[p];
      want_write[p] = false;
      /* no self channel (peers are validated); nothing more from a broken one */
      if (p == comm->rank || ps->broken != TCC_OK) continue;
      tcc_err_t err = {TCC_OK, {0}};
      ssize_t n = progress_send(comm, p, ps, &err);
      if (n > 0) moved += n;
      if (n >= 0) {
        n = progress_recv(comm, p, ps, &err);
        if (n > 0) moved += n;
      }
      if (err.code != TCC_OK) break_peer(comm, ps, &err);
      else want_write[p] = ps->send_head != NULL;
    }
    int64_t now = tcc_now_ns();
    expire_p2p_ops(comm, now, 0, TCC_ERR_TIMEOUT, "check that the peer posts the matching operation");
    if (moved > 0) {
      idle_spins = 0;
      continue;
    }
    if (e->p2p_pending == 0) continue;
    if (idle_spins++ < comm->spin_iters / 16) {
      tcc_cpu_relax();
      continue;
    }
    idle_spins = 0;
    comm->ops->p2p_wait(comm, want_write, 50 * 1000000LL);
  }
  free(want_write);
  return NULL;
}

/* ---- lifecycle -------------------------------------------------------- */

tcc_result_t tcc_engine_start(tcc_comm_t *comm, tcc_err_t *err) {
  tcc_engine_t *e = calloc(1, sizeof *e);
  if (!e) return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  e->peers = calloc((size_t)comm->size, sizeof *e->peers);
  if (!e->peers) {
    free(e);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  }
  pthread_mutex_init(&e->lock, NULL);
  pthread_condattr_t monotonic; /* timed waits on the tcc_now_ns clock */
  pthread_condattr_init(&monotonic);
  pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
  pthread_cond_init(&e->coll_cv, &monotonic);
  pthread_condattr_destroy(&monotonic);
  pthread_cond_init(&e->p2p_cv, NULL);
  pthread_cond_init(&e->waiter_cv, NULL);
  comm->engine = e;
  int rc = pthread_create(&e->coll_thread, NULL, collective_thread_main, comm);
  if (rc == 0) {
    e->coll_started = 1;
    rc = pthread_create(&e->p2p_thread, NULL, p2p_thread_main, comm);
    if (rc == 0) e->p2p_started = 1;
  }
  if (rc != 0) {
    tcc_engine_stop(comm);
    tcc_engine_free(comm);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm '%s': cannot start engine threads: %s", comm->name,
                       strerror(rc));
  }
  return TCC_OK;
}

void tcc_engine_submit(tcc_comm_t *comm, tcc_op_t *op) {
  tcc_engine_t *e = comm->engine;
  tcc_op_retain(op);
  pthread_mutex_lock(&e->lock);
  if (e->stopping) { /* destroy has begun: nothing runs any more */
    pthread_mutex_unlock(&e->lock);
    char msg[TCC_ERRLEN];
    snprintf(msg, sizeof msg, "tccomm op on '%s' (rank %d) not run: the communicator is being destroyed",
             comm->name, comm->rank);
    tcc_op_finish(op, TCC_ERR_ABORTED, msg);
    tcc_op_release(op);
    return;
  }
  if (op->kind == TCC_OP_COLL) {
    /* Numbered under the lock so numbers follow queue order. */
    op->seq = atomic_fetch_add(&comm->coll_issued, 1) + 1;
    queue_push(&e->coll_head, &e->coll_tail, op);
    e->last_submit_ns = tcc_now_ns();
    if (e->coll_deep_sleep) pthread_cond_signal(&e->coll_cv); /* see the file comment */
    pthread_mutex_unlock(&e->lock);
    return;
  }
  op->deadline_ns = tcc_deadline_after_ms(op->timeout_ms);
  queue_push(&e->p2p_new_head, &e->p2p_new_tail, op);
  e->p2p_pending++;
  int idle = e->p2p_idle;
  if (idle) pthread_cond_signal(&e->p2p_cv);
  pthread_mutex_unlock(&e->lock);
  if (!idle) comm->ops->p2p_notify(comm);
}

void tcc_engine_wake(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e) return;
  pthread_mutex_lock(&e->lock);
  pthread_cond_broadcast(&e->coll_cv);
  pthread_cond_broadcast(&e->p2p_cv);
  pthread_mutex_unlock(&e->lock);
  if (comm->ops) comm->ops->p2p_notify(comm);
}

void tcc_engine_stop(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e) return;
  pthread_mutex_lock(&e->lock);
  e->stopping = 1;
  pthread_cond_broadcast(&e->coll_cv);
  pthread_cond_broadcast(&e->p2p_cv);
  pthread_mutex_unlock(&e->lock);
  if (comm->ops) comm->ops->p2p_notify(comm);
  /* A thread running the queue from tcc_op_wait uses the transport: it
   * must be out before the transport goes (its op fails fast: the
   * communicator is failed before stop). */
  pthread_mutex_lock(&e->lock);
  while (e->waiter_runs) pthread_cond_wait(&e->waiter_cv, &e->lock);
  pthread_mutex_unlock(&e->lock);
  if (e->coll_started) pthread_join(e->coll_thread, NULL);
  if (e->p2p_started) pthread_join(e->p2p_thread, NULL);
  e->coll_started = e->p2p_started = 0;
  free_unexpected(e, comm->size);
}

void tcc_engine_free(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e) return;
  pthread_mutex_destroy(&e->lock);
  pthread_cond_destroy(&e->coll_cv);
  pthread_cond_destroy(&e->p2p_cv);
  pthread_cond_destroy(&e->waiter_cv);
  free(e->peers);
  free(e);
  comm->engine = NULL;
}

/* ---- op handles ------------------------------------------------------- */

int tcc_op_test(tcc_op_t *op) {
  if (op->cuda_device >= 0) return tcc_cuda_op_test(op);
  return atomic_load(&op->finished);
}

tcc_result_t tcc_op_result(const tcc_op_t *op) {
  return atomic_load(&((tcc_op_t *)op)->finished) ? op->result : TCC_ERR_INPROGRESS;
}

const char *tcc_op_error(const tcc_op_t *op) {
  return atomic_load(&((tcc_op_t *)op)->finished) ? op->error : "";
}

tcc_result_t tcc_op_wait(tcc_op_t *op, int64_t timeout_ms) {
  if (atomic_load(&op->finished)) return op->result;
  tcc_comm_t *comm = op->comm;
  /* Run the queue ourselves when nobody else is: see the file comment. A
   * bounded wait must not: a collective, once started, runs until it ends
   * or its own deadline passes, which may be long after timeout_ms. */
  tcc_engine_t *e = comm->engine;
  if (op->kind == TCC_OP_COLL && op->cuda_device < 0 && e) {
    if (timeout_ms < 0 && claim_runner(e)) {
      run_collective_queue(comm, op);
      release_runner(e);
    } else if (timeout_ms >= 0) {
      tcc_op_start(op);
    }
  }
  int64_t deadline = timeout_ms < 0 ? INT64_MAX : tcc_deadline_after_ms(timeout_ms);
  for (int i = 0; i < comm->spin_iters; i++) {
    if (atomic_load(&op->finished)) return op->result;
    tcc_cpu_relax();
  }
  for (;;) {
    unsigned v = atomic_load(&op->finished_futex);
    if (atomic_load(&op->finished)) return op->result;
    int64_t now = tcc_now_ns();
    if (now >= deadline) return TCC_ERR_INPROGRESS;
    int64_t nap = deadline - now;
    if (nap > 100 * 1000000LL) nap = 100 * 1000000LL;
    tcc_futex_wait(&op->finished_futex, v, nap);
  }
}

int tcc_op_peer(const tcc_op_t *op) {
  if (op->kind == TCC_OP_COLL) return -1;
  if (op->peer != TCC_ANY_SOURCE) return op->peer;
  /* The p2p thread sets `source` before it finishes the op. */
  return atomic_load(&((tcc_op_t *)op)->finished) ? op->source : TCC_ANY_SOURCE;
}

void tcc_op_start(tcc_op_t *op) {
  /* (The engine's memory lives as long as any op of it.) */
  if (op->kind != TCC_OP_COLL || op->cuda_device >= 0 || atomic_load(&op->finished)) return;
  tcc_engine_t *e = op->comm->engine;
  pthread_mutex_lock(&e->lock);
  if (e->coll_head && !e->runner_busy) pthread_cond_signal(&e->coll_cv);
  pthread_mutex_unlock(&e->lock);
}

void tcc_op_on_complete(tcc_op_t *op, tcc_op_callback_t fn, void *arg) {
  pthread_mutex_lock(&op->cb_lock);
  if (!atomic_load(&op->finished)) {
    op->cb = fn;
    op->cb_arg = arg;
    pthread_mutex_unlock(&op->cb_lock);
    return;
  }
  pthread_mutex_unlock(&op->cb_lock);
  fn(op, arg);
}

void tcc_op_retain(tcc_op_t *op) { atomic_fetch_add(&op->refs, 1); }

void tcc_op_release(tcc_op_t *op) {
  if (!op) return;
  if (atomic_fetch_sub(&op->refs, 1) != 1) return;
  pthread_mutex_destroy(&op->cb_lock);
  tcc_cuda_op_free(op);
  free(op->owned_arrays);
  tcc_comm_t *comm = op->comm;
  free(op);
  tcc_comm_release(comm);
}
