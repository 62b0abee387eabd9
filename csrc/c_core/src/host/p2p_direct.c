/*
 * p2p_direct.c - single-copy point-to-point messages: the sender puts a
 * reference to its buffer on the stream instead of the bytes, the
 * receiver reads them once from the sender's memory into its own buffer
 * and answers with a done frame, on which the send completes (a
 * rendezvous, as Open MPI's vader does it with cross-memory attach).
 *
 * Through the shared-memory ring a message is copied twice (into the
 * ring, out of it), each copy waiting on the other's progress through a
 * ring of 1 MiB; read in place it is copied once, by the receiver, and
 * the sender's CPU is free meanwhile (bench/README, "Point-to-point
 * messages by reference").
 *
 * The transport says where it can (transport.h's p2p_direct: the peer
 * shares this host and said it can read every rank; TCCOMM_CMA=0 on
 * either side turns it off), the sender decides per message when its
 * frame starts, and the receiver takes either kind of frame, so the two
 * ends need not agree beforehand. The done frames go on the stream back
 * to the sender between its other frames, never inside one; they carry
 * the token of the reference they answer (the send's posting number), so
 * receives may take references in any order.
 *
 * A receive that fails on a size mismatch still answers (the sender sent,
 * and a data frame would have completed it too). A send that times out
 * waiting for its answer fails the communicator, as a send cut part-way
 * does: its peer might still read the buffer the caller gets back.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/host.h"

bool tcc__host_p2p_goes_by_ref(tcc_comm_t *comm, const tcc_op_t *op) {
  return comm->ops->p2p_direct && op->bytes > 0 && comm->ops->p2p_direct(comm, op->peer, op->bytes, true);
}

bool tcc__host_p2p_comes_by_ref(tcc_comm_t *comm, const tcc_op_t *op) {
  return op->kind == TCC_OP_RECV && op->peer != TCC_ANY_SOURCE && comm->ops->p2p_direct && op->bytes > 0 &&
         comm->ops->p2p_direct(comm, op->peer, op->bytes, false);
}

size_t tcc__host_p2p_send_frame(const tcc_op_t *op, tcc_p2p_frame_t *f, tcc_p2p_ref_t *ref) {
  if (!op->by_ref) {
    tcc__p2p_frame_make(f, TCC_P2P_DATA, op->tag, op->bytes);
    return sizeof *f + op->bytes;
  }
  tcc__p2p_frame_make(f, TCC_P2P_REF, op->tag, op->bytes);
  tcc__p2p_ref_make(ref, (uint64_t)(uintptr_t)op->buf, op->seq);
  return sizeof *f + sizeof *ref;
}

bool tcc__host_p2p_awaits_answer(const tcc_op_t *op) {
  return op->kind == TCC_OP_SEND && op->by_ref && !atomic_load_explicit(&op->finished, memory_order_relaxed) &&
         op->done_bytes == sizeof(tcc_p2p_frame_t) + sizeof(tcc_p2p_ref_t);
}

void tcc__host_p2p_await_done(peer_state_t *ps, tcc_op_t *op) {
  ps->ref_bytes_sent += op->bytes;
  tcc__queue_push(&ps->await_head, &ps->await_tail, op);
}

tcc_op_t *tcc__host_p2p_done_arrived(tcc_comm_t *comm, int peer, peer_state_t *ps, uint64_t token, tcc_err_t *err) {
  tcc_op_t *prev = NULL;
  for (tcc_op_t *op = ps->await_head; op; prev = op, op = op->next) {
    if (op->seq != token) continue;
    if (prev) prev->next = op->next; else ps->await_head = op->next;
    if (ps->await_tail == op) ps->await_tail = prev;
    op->next = NULL;
    return op;
  }
  tcc__err_set(err, TCC_ERR_REMOTE,
               "tccomm p2p on '%s' (rank %d): corrupt stream from rank %d: a done frame for token %llu, which no "
               "send to it awaits; no further message from rank %d can be trusted",
               comm->name, comm->rank, peer, (unsigned long long)token, peer);
  return NULL;
}

/* Adds a done frame for `token` to those owed to the peer. */
static bool owe_done(peer_state_t *ps, uint64_t token) {
  if (ps->dones_len == ps->dones_cap && ps->dones_first > 0) {
    memmove(ps->dones, ps->dones + ps->dones_first, (ps->dones_len - ps->dones_first) * sizeof *ps->dones);
    ps->dones_len -= ps->dones_first;
    ps->dones_first = 0;
  }
  if (ps->dones_len == ps->dones_cap) {
    const size_t cap = ps->dones_cap ? 2 * ps->dones_cap : 16;
    uint64_t *grown = realloc(ps->dones, cap * sizeof *grown);
    if (!grown) return false;
    ps->dones = grown;
    ps->dones_cap = cap;
  }
  ps->dones[ps->dones_len++] = token;
  return true;
}

tcc_result_t tcc__host_p2p_read_ref(tcc_comm_t *comm, int peer, peer_state_t *ps, void *dst, size_t dst_bytes,
                                    size_t bytes, const tcc_p2p_ref_t *ref, uint64_t seq, char *cause,
                                    size_t cause_len) {
  tcc_result_t r = TCC_OK;
  if (bytes != dst_bytes) {
    snprintf(cause, cause_len, "size mismatch: the receive buffer holds %zu bytes, the peer sent %zu", dst_bytes,
             bytes);
    r = TCC_ERR_MISMATCH;
  } else {
    tcc_err_t err;
    tcc__err_reset(&err);
    r = comm->ops->p2p_peer_read(comm, peer, dst, ref->addr, bytes, seq, &err);
    if (r != TCC_OK) snprintf(cause, cause_len, "%s", err.msg);
  }
  if (!owe_done(ps, ref->token) && r == TCC_OK) {
    /* The sender then waits for its answer until its timeout. */
    snprintf(cause, cause_len, "out of memory noting the answer owed to the sender");
    r = TCC_ERR_SYSTEM;
  }
  return r;
}

ssize_t tcc__host_p2p_send_dones(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err) {
  ssize_t moved = 0;
  /* Not inside a send's frame; a done frame part written goes on. */
  if (ps->send_head && ps->send_head->done_bytes > 0) return 0;
  while (ps->dones_first < ps->dones_len) {
    tcc_p2p_frame_t f;
    tcc__p2p_frame_make(&f, TCC_P2P_DONE, ps->dones[ps->dones_first], 0);
    const struct iovec iov = {(char *)&f + ps->done_sent, sizeof f - ps->done_sent};
    const ssize_t n = comm->ops->p2p_write(comm, peer, &iov, 1, err);
    if (n < 0) return -1;
    if (n == 0) return moved;
    moved += n;
    ps->done_sent += (size_t)n;
    if (ps->done_sent < sizeof f) continue;
    ps->done_sent = 0;
    ps->dones_first++;
  }
  ps->dones_first = ps->dones_len = 0;
  return moved;
}

void tcc__host_p2p_free_dones(peer_state_t *ps) {
  free(ps->dones);
  ps->dones = NULL;
  ps->dones_first = ps->dones_len = ps->dones_cap = ps->done_sent = 0;
}
