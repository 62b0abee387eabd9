/*
 * p2p_match.c - the host executor's point-to-point thread (see host.h): frames
 * messages on the transport's per-peer byte streams, matches arrivals to
 * posted receives by (peer, tag, order), buffers the unmatched ones and
 * fails ops whose deadline passed or whose peer's stream broke.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu_share.h"
#include "core/mutation.h"
#include "host/host.h"
#include "core/copy.h"

/* Why a send or receive failed, naming the op, the group, both ranks and the tag. */
void tcc__host_p2p_describe_failure(char *msg, size_t len, const tcc_comm_t *comm, tcc_op_kind_t kind, int peer_rank,
                                    uint64_t tag, const char *cause) {
  char peer[32];
  const int is_send = kind == TCC_OP_SEND;
  if (peer_rank == TCC_ANY_SOURCE) snprintf(peer, sizeof peer, "any rank");
  else snprintf(peer, sizeof peer, "rank %d", peer_rank);
  snprintf(msg, len, "tccomm %s on '%s' (rank %d) %s %s, tag %llu: %.360s", is_send ? "send" : "recv", comm->name,
           comm->rank, is_send ? "to" : "from", peer, (unsigned long long)tag, cause);
}

static void fail_p2p_op(tcc_op_t *op, tcc_result_t code, const char *cause) {
  char msg[TCC_ERRLEN];
  tcc__host_p2p_describe_failure(msg, sizeof msg, op->comm, op->kind, op->peer, op->tag, cause);
  tcc__op_finish(op, code, msg);
}

static void finish_p2p(tcc_engine_t *e, tcc_op_t *op, tcc_result_t r, const char *cause) {
  if (r == TCC_OK) tcc__op_finish(op, TCC_OK, NULL);
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
      if (m->bytes) tcc__copy(op->buf, m->data, m->bytes);
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

/* Writes what is left of a send's frame: header then payload (a data
 * frame) or reference. Returns bytes moved or -1. */
static ssize_t write_frame(tcc_comm_t *comm, int peer, tcc_op_t *op, tcc_err_t *err) {
  if (op->done_bytes == 0) op->by_ref = tcc__host_p2p_goes_by_ref(comm, op);
  struct {
    tcc_p2p_frame_t h;
    tcc_p2p_ref_t ref;
  } head;
  const size_t total = tcc__host_p2p_send_frame(op, &head.h, &head.ref);
  const size_t head_bytes = op->by_ref ? sizeof head : sizeof head.h;
  ssize_t moved = 0;
  while (op->done_bytes < total) {
    struct iovec iov[2];
    int parts = 0;
    if (op->done_bytes < head_bytes) {
      iov[parts++] = (struct iovec){(char *)&head + op->done_bytes, head_bytes - op->done_bytes};
      if (!op->by_ref && op->bytes && op->bytes <= P2P_GATHER_BYTES) iov[parts++] = (struct iovec){op->buf, op->bytes};
    } else {
      const size_t off = op->done_bytes - head_bytes;
      iov[parts++] = (struct iovec){(char *)op->buf + off, op->bytes - off};
    }
    /* A write may take a prefix: the rest goes on from done_bytes. */
    const ssize_t n = comm->ops->p2p_write(comm, peer, iov, parts, err);
    if (n < 0) return -1;
    if (n == 0) return moved;
    op->done_bytes += (size_t)n;
    moved += n;
  }
  return moved;
}

/* Moves bytes of the sends queued for one peer, and the done frames owed
 * to it between them. Returns bytes moved or -1. */
ssize_t tcc__host_p2p_progress_send(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err) {
  tcc_engine_t *e = comm->engine;
  ssize_t moved = 0;
  for (;;) {
    if (ps->dones_len > 0) {
      const ssize_t n = tcc__host_p2p_send_dones(comm, peer, ps, err);
      if (n < 0) return -1;
      moved += n;
      if (ps->done_sent > 0) return moved; /* the stream is full */
    }
    tcc_op_t *op = ps->send_head;
    if (!op) return moved;
    const ssize_t n = write_frame(comm, peer, op, err);
    if (n < 0) return -1;
    moved += n;
    tcc_p2p_frame_t h;
    tcc_p2p_ref_t ref;
    if (op->done_bytes < tcc__host_p2p_send_frame(op, &h, &ref)) return moved;
    ps->send_head = op->next;
    if (!ps->send_head) ps->send_tail = NULL;
    if (op->by_ref && !TCC_MUTANT(P2P_DONE_EARLY)) tcc__host_p2p_await_done(ps, op); /* MUTATION SITE */
    else finish_p2p(e, op, TCC_OK, NULL);
  }
}

/* Reads up to len bytes of peer's stream into dst: the transport's read,
 * except that a short read (a header, a small payload) takes whatever the
 * stream holds up to the size of ps->ahead and keeps the rest for the
 * next reads. A small message then costs one read of the stream, not two
 * (one system call over TCP, one update of the ring's tail over shared
 * memory). Same results as p2p_read: bytes, 0 (nothing now), -1. */
static ssize_t stream_read(tcc_comm_t *comm, int peer, peer_state_t *ps, void *dst, size_t len, tcc_err_t *err) {
  if (ps->ahead_off == ps->ahead_len) {
    if (len >= sizeof ps->ahead) return comm->ops->p2p_read(comm, peer, dst, len, err);
    const ssize_t n = comm->ops->p2p_read(comm, peer, ps->ahead, sizeof ps->ahead, err);
    if (n <= 0) return n;
    ps->ahead_off = 0;
    ps->ahead_len = (size_t)n;
  }
  const size_t have = ps->ahead_len - ps->ahead_off;
  const size_t n = len < have ? len : have;
  memcpy(dst, ps->ahead + ps->ahead_off, n);
  ps->ahead_off += n;
  return (ssize_t)n;
}

/* A buffer for the message whose header is ps->in_hdr, which no posted
 * receive matched; NULL (*err) when out of memory. */
static unexpected_msg_t *buffer_arrival(tcc_comm_t *comm, peer_state_t *ps, tcc_err_t *err) {
  const size_t bytes = (size_t)ps->in_hdr.bytes;
  unexpected_msg_t *m = calloc(1, sizeof *m);
  void *data = bytes ? malloc(bytes) : NULL;
  if (!m || (bytes && !data)) {
    free(m);
    free(data);
    tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm p2p on '%s' (rank %d): out of memory buffering %zu bytes", comm->name,
                 comm->rank, bytes);
    return NULL;
  }
  m->tag = ps->in_hdr.tag;
  m->arrival = ++comm->engine->arrived;
  m->bytes = bytes;
  m->data = data;
  return m;
}

/* Lists a buffered message behind those that arrived before it. */
static void list_arrival(peer_state_t *ps, unexpected_msg_t *m) {
  if (ps->unexp_tail) ps->unexp_tail->next = m; else ps->unexp_head = m;
  ps->unexp_tail = m;
}

/* A reference frame arrived whole (ps->in_hdr, ps->in_ref_body): the
 * message is read into the receive it matches, or, when none is posted,
 * into a buffer as a data frame's payload would be: the send completes
 * once this rank's rounds took it, as it would through the stream, and
 * two ranks that both send before they receive go on. Its answer goes at
 * once, unless a frame to the peer is part written. */
static tcc_result_t ref_arrived(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err) {
  if (tcc__p2p_ref_check(comm, peer, &ps->in_ref_body, err) != TCC_OK) return err->code;
  tcc_engine_t *e = comm->engine;
  const size_t bytes = (size_t)ps->in_hdr.bytes;
  tcc_op_t *op = take_recv_for(e, ps, peer, ps->in_hdr.tag);
  char cause[TCC_ERRLEN] = "";
  if (op) {
    const tcc_result_t r =
        tcc__host_p2p_read_ref(comm, peer, ps, op->buf, op->bytes, bytes, &ps->in_ref_body, op->seq, cause, sizeof cause);
    finish_p2p(e, op, r, cause);
  } else {
    unexpected_msg_t *m = buffer_arrival(comm, ps, err);
    if (!m) return err->code;
    const tcc_result_t r =
        tcc__host_p2p_read_ref(comm, peer, ps, m->data, bytes, bytes, &ps->in_ref_body, 0, cause, sizeof cause);
    if (r != TCC_OK) {
      free(m->data);
      free(m);
      return tcc__err_set(err, r, "tccomm p2p on '%s' (rank %d): taking a message of %zu bytes from rank %d: %s",
                          comm->name, comm->rank, bytes, peer, cause);
    }
    list_arrival(ps, m);
  }
  return tcc__host_p2p_send_dones(comm, peer, ps, err) < 0 ? err->code : TCC_OK;
}

/* Reads whatever one peer has sent. Returns bytes moved or -1. */
ssize_t tcc__host_p2p_progress_recv(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err) {
  tcc_engine_t *e = comm->engine;
  ssize_t moved = 0;
  for (;;) {
    if (!ps->in_payload) {
      ssize_t n = stream_read(comm, peer, ps, (char *)&ps->in_hdr + ps->in_hdr_got, sizeof ps->in_hdr - ps->in_hdr_got,
                              err);
      if (n < 0) return -1;
      if (n == 0) return moved;
      moved += n;
      ps->in_hdr_got += (size_t)n;
      if (ps->in_hdr_got < sizeof ps->in_hdr) continue;
      if (tcc__p2p_frame_check(comm, peer, &ps->in_hdr, err) != TCC_OK) return -1;
      ps->in_hdr_got = 0;
      const tcc_p2p_kind_t kind = tcc__p2p_frame_kind(&ps->in_hdr);
      if (kind == TCC_P2P_DONE) { /* a send of ours by reference is complete */
        tcc_op_t *op = tcc__host_p2p_done_arrived(comm, peer, ps, ps->in_hdr.tag, err);
        if (!op) return -1;
        finish_p2p(e, op, TCC_OK, NULL);
        continue;
      }
      ps->in_payload = 1;
      size_t bytes = (size_t)ps->in_hdr.bytes;
      tcc_op_t *op = kind == TCC_P2P_REF ? NULL : take_recv_for(e, ps, peer, ps->in_hdr.tag);
      if (kind == TCC_P2P_REF) { /* the reference first; matched once it is whole */
        ps->in_ref = true;
        ps->in_op = NULL;
        ps->in_dst = (char *)&ps->in_ref_body;
        ps->in_remaining = sizeof ps->in_ref_body;
        ps->in_discard = 0;
      } else if (op) {
        start_payload_into_recv(e, ps, op, bytes);
      } else {
        unexpected_msg_t *m = buffer_arrival(comm, ps, err);
        if (!m) return -1;
        list_arrival(ps, m); /* now: later messages with the same tag stay behind it */
        ps->in_unexp = m;
        ps->in_op = NULL;
        ps->in_dst = m->data;
        ps->in_remaining = bytes;
        ps->in_discard = 0;
      }
    }
    /* payload */
    while (ps->in_remaining > 0 || ps->in_discard > 0) {
      ssize_t n;
      if (ps->in_remaining > 0) {
        n = stream_read(comm, peer, ps, ps->in_dst, ps->in_remaining, err);
        if (n > 0) { ps->in_dst += n; ps->in_remaining -= (size_t)n; }
      } else {
        char sink[4096];
        size_t want = ps->in_discard < sizeof sink ? ps->in_discard : sizeof sink;
        n = stream_read(comm, peer, ps, sink, want, err);
        if (n > 0) ps->in_discard -= (size_t)n;
      }
      if (n < 0) return -1;
      if (n == 0) return moved;
      moved += n;
    }
    ps->in_payload = 0;
    if (ps->in_ref) {
      ps->in_ref = false;
      if (ref_arrived(comm, peer, ps, err) != TCC_OK) return -1;
    } else if (ps->in_op) {
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
void tcc__host_p2p_adopt(tcc_comm_t *comm, tcc_op_t *list) {
  tcc_engine_t *e = comm->engine;
  while (list) {
    tcc_op_t *op = list;
    list = op->next;
    op->seq = ++e->posted;
    if (op->deadline_ns < e->p2p_next_expiry_ns) e->p2p_next_expiry_ns = op->deadline_ns;
    if (op->peer == TCC_ANY_SOURCE) {
      if (!match_unexpected_any(comm, op)) tcc__queue_push(&e->any_head, &e->any_tail, op);
      continue;
    }
    peer_state_t *ps = &e->peers[op->peer];
    /* Messages that arrived before the stream broke still match. */
    if (op->kind == TCC_OP_RECV && match_unexpected(e, ps, op)) continue;
    if (ps->broken != TCC_OK) {
      finish_p2p(e, op, ps->broken, ps->broken_msg);
      continue;
    }
    if (op->kind == TCC_OP_SEND) tcc__queue_push(&ps->send_head, &ps->send_tail, op);
    else tcc__queue_push(&ps->recv_head, &ps->recv_tail, op);
  }
}

/* Fails the ops of one queue whose deadline passed (or all of them if
 * `all`, with `code` and `cause`). Returns the earliest deadline of the
 * ops left (INT64_MAX: none). */
static int64_t expire_queue(tcc_comm_t *comm, tcc_op_t **head, tcc_op_t **tail, int64_t now, int all,
                            tcc_result_t code, const char *cause) {
  tcc_op_t **link = head, *prev = NULL;
  int64_t next = INT64_MAX;
  while (*link) {
    tcc_op_t *op = *link;
    if (!all && now <= op->deadline_ns) {
      if (op->deadline_ns < next) next = op->deadline_ns;
      prev = op;
      link = &op->next;
      continue;
    }
    /* A send cut part-way leaves the byte stream unusable; one whose
     * reference went out leaves its buffer to a peer that may still read it. */
    if (!all && op->kind == TCC_OP_SEND && op->done_bytes > 0)
      tcc__comm_fail(comm, TCC_ERR_TIMEOUT,
                     op->by_ref ? "a point-to-point send timed out before its peer read it"
                                : "a point-to-point send timed out part-way");
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
  return next;
}

static int64_t earlier(int64_t a, int64_t b) { return a < b ? a : b; }

/* Fails one peer's p2p ops whose deadline passed (or all of them if `all`).
 * Returns the earliest deadline of its ops left (INT64_MAX: none). */
static int64_t expire_peer_ops(tcc_comm_t *comm, peer_state_t *ps, int64_t now, int all,
                               tcc_result_t code, const char *cause) {
  int64_t next = expire_queue(comm, &ps->send_head, &ps->send_tail, now, all, code, cause);
  next = earlier(next, expire_queue(comm, &ps->await_head, &ps->await_tail, now, all, code, cause));
  next = earlier(next, expire_queue(comm, &ps->recv_head, &ps->recv_tail, now, all, code, cause));
  if (ps->in_op && !all && now <= ps->in_op->deadline_ns) return earlier(next, ps->in_op->deadline_ns);
  if (ps->in_op) {
    tcc_op_t *op = ps->in_op;
    ps->in_op = NULL;
    ps->in_discard = ps->in_remaining;
    ps->in_remaining = 0;
    ps->in_dst = NULL;
    finish_p2p(comm->engine, op, all ? code : TCC_ERR_TIMEOUT,
               all ? cause : "timed out while the message was arriving");
  }
  return next;
}

/* Fails the p2p ops whose deadline passed (or all of them if `all`). The
 * queues are walked only once the earliest deadline seen has passed: a
 * polling waiter runs this every round. */
static void expire_p2p_ops(tcc_comm_t *comm, int64_t now, int all, tcc_result_t code,
                           const char *cause) {
  tcc_engine_t *e = comm->engine;
  if (!all && now <= e->p2p_next_expiry_ns) return;
  int64_t next = INT64_MAX;
  for (int p = 0; p < comm->size; p++)
    next = earlier(next, expire_peer_ops(comm, &e->peers[p], now, all, code, cause));
  e->p2p_next_expiry_ns = earlier(next, expire_queue(comm, &e->any_head, &e->any_tail, now, all, code, cause));
}

/* The stream to one peer failed (typically: it closed its communicator
 * after its last op). Only ops involving that peer fail; the streams to
 * the other peers carry on, as they would with separate connections. */
void tcc__host_p2p_break_peer(tcc_comm_t *comm, peer_state_t *ps, const tcc_err_t *err) {
  /* A failed communicator ends its own connections to tell its peers
   * (transport `failed`): then its failure, not the stream's end, is why. */
  tcc_err_t own;
  if (atomic_load(&comm->aborted)) {
    own.code = tcc__comm_failure(comm, own.msg, sizeof own.msg);
    err = &own;
  }
  ps->broken = err->code;
  snprintf(ps->broken_msg, sizeof ps->broken_msg, "%s", err->msg);
  expire_peer_ops(comm, ps, 0, 1, err->code, err->msg);
  /* Any-source receives wait while some peer may still send. */
  tcc_engine_t *e = comm->engine;
  for (int p = 0; p < comm->size; p++)
    if (p != comm->rank && e->peers[p].broken == TCC_OK) return;
  expire_queue(comm, &e->any_head, &e->any_tail, 0, 1, err->code, err->msg);
}

void tcc__host_free_unexpected(tcc_engine_t *e, int size) {
  for (int p = 0; p < size; p++) {
    unexpected_msg_t *m = e->peers[p].unexp_head;
    while (m) {
      unexpected_msg_t *next = m->next;
      free(m->data);
      free(m);
      m = next;
    }
    e->peers[p].unexp_head = e->peers[p].unexp_tail = NULL;
    tcc__host_p2p_free_dones(&e->peers[p]);
  }
}

/* One round of point-to-point work: adopts the ops submitted since the
 * last one, moves what the streams allow to and from every peer (only
 * `only_peer` unless it is TCC_ANY_SOURCE), fails what timed out
 * (everything, once the communicator failed or stops). want_write[p]
 * says afterwards whether a send to p waits for room. The caller holds
 * e->p2p_progress. Returns the bytes moved. */
static ssize_t p2p_round_of(tcc_comm_t *comm, bool *want_write, int only_peer) {
  tcc_engine_t *e = comm->engine;
  int stopping = 0;
  if (atomic_load_explicit(&e->p2p_news, memory_order_acquire)) {
    pthread_mutex_lock(&e->lock);
    tcc_op_t *fresh = e->p2p_new_head;
    e->p2p_new_head = e->p2p_new_tail = NULL;
    stopping = e->stopping;
    atomic_store_explicit(&e->p2p_news, stopping, memory_order_relaxed); /* once stopping, every round looks */
    pthread_mutex_unlock(&e->lock);
    tcc__host_p2p_adopt(comm, fresh);
  }

  if (atomic_load(&comm->aborted) || stopping) {
    char cause[TCC_ERRLEN];
    tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
    if (code == TCC_OK) {
      code = TCC_ERR_ABORTED;
      snprintf(cause, sizeof cause, "the communicator was destroyed");
    }
    expire_p2p_ops(comm, 0, 1, code, cause);
    return 0;
  }

  ssize_t moved = 0;
  const int first = only_peer == TCC_ANY_SOURCE ? 0 : only_peer;
  const int end = only_peer == TCC_ANY_SOURCE ? comm->size : only_peer + 1;
  for (int p = first; p < end; p++) {
    peer_state_t *ps = &e->peers[p];
    want_write[p] = false;
    /* no self channel (peers are validated); nothing more from a broken one */
    if (p == comm->rank || ps->broken != TCC_OK) continue;
    tcc_err_t err;
    tcc__err_reset(&err);
    ssize_t n = tcc__host_p2p_progress_send(comm, p, ps, &err);
    if (n > 0) moved += n;
    if (n >= 0) {
      n = tcc__host_p2p_progress_recv(comm, p, ps, &err);
      if (n > 0) moved += n;
    }
    if (err.code != TCC_OK) tcc__host_p2p_break_peer(comm, ps, &err);
    else want_write[p] = ps->send_head != NULL || ps->dones_first < ps->dones_len;
  }
  /* The coarse clock: this runs on every round of a polling waiter, and
   * a deadline met a tick late still fails the op (deadlines are coarse). */
  expire_p2p_ops(comm, tcc__coarse_now_ns(), 0, TCC_ERR_TIMEOUT, "check that the peer posts the matching operation");
  return moved;
}

static ssize_t p2p_round(tcc_comm_t *comm, bool *want_write) { return p2p_round_of(comm, want_write, TCC_ANY_SOURCE); }

void tcc__host_p2p_round(tcc_comm_t *comm) { p2p_round(comm, comm->engine->waiter_want_write); }

#define P2P_POLL_NS (1000 * 1000LL)                /* 1 ms */
#define P2P_POLL_WINDOW_NS (2000 * 1000 * 1000LL) /* 2 s */

/* How a runner of rounds waits when a round moved nothing: a while of
 * rounds spinning (`spins`) then yielding (`yields`), then a sleep until a
 * stream is ready, new work is notified, or `max_ns` (at most 50 ms).
 * A waiter for one peer (`peer` not TCC_ANY_SOURCE) that runs on another
 * CPU spins on instead of yielding, up to TCC_CPU_AWAY_SPIN_NS from the
 * first yield it would have made (core/cpu_share.h).
 * Where the transport cannot tell a peer's CPU (TCP) but the machine's
 * ranks have a CPU each, a waiter for one peer spins for
 * TCC_CPU_AWAY_SPIN_NS when the engine's spin gate let it (`blind`), and
 * otherwise, or once that ran out, sleeps at once: a yield would hand
 * the CPU to another process for a time slice, while a sleeping waiter is
 * woken as soon as its bytes arrive. */
typedef struct p2p_idle {
  int rounds;            /* idle rounds since bytes last moved */
  int64_t away_until_ns; /* end of spinning on; 0: not begun */
  bool shared_cpu;       /* the peer, a lower rank, was seen on this CPU (this rank then moves: cpu_share.h) */
  bool blind;            /* may spin without knowing where the peer runs */
  int64_t away_spin_ns;  /* how long to spin on while the peer runs elsewhere */
} p2p_idle_t;

/* A send by reference waits while its peer copies the message (p2p_direct.c),
 * for as long as a copy at 2 GB/s takes beyond TCC_CPU_AWAY_SPIN_NS: a
 * sleep for it cost a wake-up whose latency showed in every large
 * message (4 MiB ping-pong over shm: 1.30 ms a round trip sleeping after
 * 200 us, 0.82 ms spinning on; Open MPI 0.81-0.84). */
static int64_t away_spin_ns(const tcc_op_t *op) {
  const int64_t copy_ns = op && op->kind == TCC_OP_SEND && op->by_ref ? (int64_t)(op->bytes / 2) : 0;
  return TCC_CPU_AWAY_SPIN_NS + copy_ns;
}

static bool spin_on(tcc_comm_t *comm, p2p_idle_t *idle, int peer) {
  if (peer == TCC_ANY_SOURCE || !comm->cpu_share.spin_while_away || !comm->ops->peer_cpu) return false;
  const int cpu = comm->ops->peer_cpu(comm, peer);
  if (cpu < 0) return false;
  if (cpu == tcc__cpu_now()) {
    idle->shared_cpu |= peer < comm->rank;
    return false;
  }
  const int64_t now = tcc__now_ns();
  if (idle->away_until_ns == 0) idle->away_until_ns = now + idle->away_spin_ns;
  return now < idle->away_until_ns;
}

static bool waits_blind(tcc_comm_t *comm, int peer) {
  return peer != TCC_ANY_SOURCE && !comm->ops->peer_cpu && comm->cpu_share.spin_while_away;
}

static bool spin_blind(tcc_comm_t *comm, p2p_idle_t *idle) {
  if (!idle->blind) return false;
  const int64_t now = tcc__now_ns();
  if (idle->away_until_ns == 0) idle->away_until_ns = now + TCC_CPU_AWAY_SPIN_NS;
  if (now < idle->away_until_ns) return true;
  idle->blind = false; /* a whole spin without a byte: sleep from now on */
  tcc__spin_gate_missed(&comm->engine->waiter_spin_gate);
  return false;
}

static void p2p_idle(tcc_comm_t *comm, const bool *want_write, p2p_idle_t *idle, int peer, int spins, int yields,
                     int64_t max_ns) {
  if (waits_blind(comm, peer)) {
    if (spin_blind(comm, idle)) return; /* each round is a system call per stream already */
  } else {
    const int k = idle->rounds++;
    if (k < spins) {
      tcc_cpu_relax();
      return;
    }
    if (spin_on(comm, idle, peer)) {
      idle->rounds = spins; /* the yields are still ahead */
      tcc_cpu_relax();
      return;
    }
    if (k < spins + yields) {
      sched_yield();
      return;
    }
  }
  idle->rounds = 0;
  idle->away_until_ns = 0;
  const int64_t cap = 50 * 1000000LL;
  comm->ops->p2p_wait(comm, want_write, max_ns < cap ? max_ns : cap);
}

static void note_attended(tcc_engine_t *e) {
  atomic_store_explicit(&e->p2p_attended_ns, tcc__now_ns(), memory_order_relaxed);
}

/* Whether the p2p thread should sleep rather than run rounds: nothing is
 * pending, or a caller runs the rounds now or did within P2P_POLL_NS (see
 * host.h). The caller holds e->lock. */
static bool p2p_left_to_callers(tcc_engine_t *e, int64_t now) {
  if (e->stopping) return false;
  if (!e->p2p_new_head && e->p2p_pending == 0) return true;
  return e->p2p_waiter_runs || now - atomic_load_explicit(&e->p2p_attended_ns, memory_order_relaxed) < P2P_POLL_NS;
}

/* The p2p thread's sleep on p2p_cv: polling while the communicator sends
 * or receives, until signalled after a quiet spell (see host.h). A waiter
 * running rounds signals when it leaves ops behind, so ops pending in a
 * long wait need no looks once submits have stopped. The caller holds
 * e->lock. */
static void p2p_thread_sleep(tcc_engine_t *e, int64_t now) {
  e->p2p_idle = 1;
  const bool submitting = now - e->p2p_last_submit_ns < P2P_POLL_WINDOW_NS;
  if (submitting || (e->p2p_pending > 0 && !e->p2p_waiter_runs)) {
    const int64_t until = now + P2P_POLL_NS;
    const struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
    pthread_cond_timedwait(&e->p2p_cv, &e->lock, &ts);
  } else {
    e->p2p_deep_sleep = 1;
    pthread_cond_wait(&e->p2p_cv, &e->lock);
    e->p2p_deep_sleep = 0;
  }
  e->p2p_idle = 0;
}

void *tcc__host_p2p_thread(void *arg) {
  tcc_comm_t *comm = arg;
  tcc_engine_t *e = comm->engine;
  bool *want_write = calloc((size_t)comm->size, sizeof *want_write);
  p2p_idle_t idle = {0, 0, false, false, TCC_CPU_AWAY_SPIN_NS};
  for (;;) {
    pthread_mutex_lock(&e->lock);
    if (e->stopping && !e->p2p_new_head && e->p2p_pending == 0) {
      pthread_mutex_unlock(&e->lock);
      break;
    }
    const int64_t now = tcc__now_ns();
    if (p2p_left_to_callers(e, now)) {
      p2p_thread_sleep(e, now);
      pthread_mutex_unlock(&e->lock);
      idle = (p2p_idle_t){0, 0, false, false, TCC_CPU_AWAY_SPIN_NS};
      continue;
    }
    pthread_mutex_unlock(&e->lock);
    pthread_mutex_lock(&e->p2p_progress); /* a waiter may be running rounds: after it */
    const ssize_t moved = p2p_round(comm, want_write);
    pthread_mutex_unlock(&e->p2p_progress);
    if (moved > 0) {
      idle = (p2p_idle_t){0, 0, false, false, TCC_CPU_AWAY_SPIN_NS};
      continue;
    }
    if (e->p2p_pending == 0) continue;
    p2p_idle(comm, want_write, &idle, TCC_ANY_SOURCE, comm->cpu_share.spins / 16, 0, INT64_MAX);
  }
  free(want_write);
  return NULL;
}

/* The end of a caller's single round: ops it leaves pending are the p2p
 * thread's P2P_POLL_NS from now (noted while p2p_progress is held: once
 * released, destroy may go on). Returns whether `op` finished. */
bool tcc__host_p2p_end_caller_round(tcc_engine_t *e, tcc_op_t *op) {
  const bool finished = atomic_load(&op->finished);
  if (!finished || atomic_load_explicit(&e->p2p_pending, memory_order_relaxed) > 0) note_attended(e);
  pthread_mutex_unlock(&e->p2p_progress);
  return finished;
}

/* A caller's single round needs no flag for destroy: it holds
 * p2p_progress, which destroy takes once `stopping` is set, and a round
 * that sees `stopping` fails the ops without touching the transport. Its
 * own peer's stream only: a round over every stream of a large group
 * costs a system call per peer on TCP. */
bool tcc__host_p2p_round_now(tcc_comm_t *comm, tcc_op_t *op) {
  tcc_engine_t *e = comm->engine;
  if (pthread_mutex_trylock(&e->p2p_progress) != 0) {
    note_attended(e); /* its holder runs the rounds meanwhile */
    return atomic_load(&op->finished);
  }
  p2p_round_of(comm, e->waiter_want_write, op->peer);
  return tcc__host_p2p_end_caller_round(e, op);
}

bool tcc__host_p2p_submitter_round(tcc_comm_t *comm, tcc_op_t *op, bool adopt, bool *answer_due) {
  tcc_engine_t *e = comm->engine;
  if (adopt) {
    op->next = NULL;
    tcc__host_p2p_adopt(comm, op);
  }
  p2p_round_of(comm, e->waiter_want_write, op->peer);
  *answer_due = tcc__host_p2p_awaits_answer(op);
  return tcc__host_p2p_end_caller_round(e, op);
}

void tcc__host_p2p_wake(tcc_engine_t *e, tcc_comm_t *comm, bool always) {
  pthread_mutex_lock(&e->lock);
  if (e->p2p_idle) {
    if (always || e->p2p_deep_sleep) pthread_cond_signal(&e->p2p_cv);
  } else if (!e->stopping) {
    /* It runs rounds and may sleep in the transport's wait. Under the
     * lock: once destroy has begun, the transport may be gone. */
    comm->ops->p2p_notify(comm);
  }
  pthread_mutex_unlock(&e->lock);
}

void tcc__host_p2p_kick(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  atomic_store_explicit(&e->p2p_attended_ns, 0, memory_order_relaxed);
  tcc__host_p2p_wake(e, comm, true);
}

void tcc__host_drive_p2p(tcc_comm_t *comm, tcc_op_t *op, int64_t deadline_ns) {
  tcc_engine_t *e = comm->engine;
  /* The p2p thread holds it for a round at a time; another waiter holds it
   * until its own op is done, and its rounds complete this op too: then
   * waiting for the op, not for the lock, lets this thread go on as soon
   * as its op is done. */
  note_attended(e);
  for (int tries = 0; pthread_mutex_trylock(&e->p2p_progress) != 0; tries++) {
    if (atomic_load(&op->finished) || tries >= comm->cpu_share.spins + 64) return;
    if (tries < comm->cpu_share.spins) tcc_cpu_relax();
    else sched_yield();
  }
  tcc__host_p2p_drive_held(comm, op, deadline_ns);
}

/* tcc__host_drive_p2p once p2p_progress is held (released here). */
void tcc__host_p2p_drive_held(tcc_comm_t *comm, tcc_op_t *op, int64_t deadline_ns) {
  tcc_engine_t *e = comm->engine;
  pthread_mutex_lock(&e->lock);
  const int go = !e->stopping;
  if (go) e->p2p_waiter_runs = 1;
  pthread_mutex_unlock(&e->lock);
  const bool blind =
      go && waits_blind(comm, op->peer) && tcc__spin_gate_open(&e->waiter_spin_gate, &comm->cpu_share, false);
  p2p_idle_t idle = {0, 0, false, blind, away_spin_ns(op)};
  bool shared_cpu = false;
  while (go && !atomic_load(&op->finished)) {
    if (p2p_round(comm, e->waiter_want_write) > 0) {
      shared_cpu |= idle.shared_cpu;
      idle = (p2p_idle_t){0, 0, false, idle.blind, away_spin_ns(op)};
      continue;
    }
    if (atomic_load(&op->finished)) break;
    const int64_t left = deadline_ns - tcc__coarse_now_ns(); /* every idle round: the cheap clock */
    if (left <= 0) break;
    /* Waiting for its own message, as a collective waits for its peers
     * (core/idle_wait.c): spin, yield, then sleep. */
    p2p_idle(comm, e->waiter_want_write, &idle, op->peer, comm->cpu_share.spins, 64, left);
  }
  tcc__cpu_share_after_wait(&comm->cpu_share, shared_cpu || idle.shared_cpu);
  /* Ops left pending are the p2p thread's after P2P_POLL_NS from now. */
  if (atomic_load_explicit(&e->p2p_pending, memory_order_relaxed) > 0) note_attended(e);
  pthread_mutex_unlock(&e->p2p_progress);
  pthread_mutex_lock(&e->lock);
  if (e->p2p_waiter_runs && e->stopping) pthread_cond_broadcast(&e->waiter_cv);
  if (e->p2p_waiter_runs && e->p2p_idle && (e->p2p_new_head || e->p2p_pending > 0)) pthread_cond_signal(&e->p2p_cv);
  e->p2p_waiter_runs = 0;
  pthread_mutex_unlock(&e->lock);
}
