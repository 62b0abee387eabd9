/*
 * p2p_now.c - sends and receives whose caller waits for them at once (an
 * entry point given no op handle), run in the calling thread.
 *
 * A blocking call owes nobody an op: no other thread waits on it, polls it
 * or registers a callback. When the point-to-point engine is idle for its
 * peer, it moves the message itself, holding p2p_progress (so no round
 * runs meanwhile) from its look at the engine's state to its end:
 *  - a small send (up to P2P_GATHER_BYTES) goes out as one gathered write
 *    when no send to its peer waits before it and the stream takes it
 *    whole; no op, no lock but p2p_progress, no clock;
 *  - a receive from one peer takes its message straight from the front of
 *    the peer's stream (through the read-ahead buffer, which a small
 *    message fits) when nothing posted before it could take that message
 *    and nothing from the peer waits buffered, spinning a while for it;
 *  - otherwise (a larger message, a stream full or holding another tag
 *    first, a peer slow to send) the caller's op is adopted at once and
 *    its own stream moved, then rounds run as a waiter runs them: one
 *    taking of p2p_progress instead of submit's and the waiter's.
 * Any of them gives way (false, nothing done) when another thread runs
 * rounds or ops wait on p2p_new: those were issued first.
 *
 * bench_latency 2 shm p2p blocking, 8 B round trip: 0.84-0.86 us with the
 * op submitted and waited for, 0.61-0.62 with both sides here
 * (bench/README, "Blocking sends and receives in the calling thread").
 */
#include <string.h>

#include "host/host.h"

/* Takes p2p_progress for a call that must go after everything issued
 * before it: false (nothing held) when another thread runs rounds or ops
 * wait on p2p_new. Destroy sets that flag too, before it waits for
 * p2p_progress: seen clear here, the transport stays until the unlock. */
static bool take_idle_engine(tcc_comm_t *comm) {
  tcc_engine_t *e = comm->engine;
  if (!e || atomic_load_explicit(&comm->aborted, memory_order_relaxed)) return false;
  if (pthread_mutex_trylock(&e->p2p_progress) != 0) return false;
  if (!atomic_load_explicit(&e->p2p_news, memory_order_acquire)) return true;
  pthread_mutex_unlock(&e->p2p_progress);
  return false;
}

/* The direction of its own stream that op moves: a send's bytes out (and
 * in, for the answer to a reference: p2p_direct.c), a receive's in (their
 * peer's stream broke: adopting failed the op). */
static void move_own_stream(tcc_comm_t *comm, tcc_op_t *op) {
  peer_state_t *ps = &comm->engine->peers[op->peer];
  if (ps->broken != TCC_OK) return;
  tcc_err_t err;
  tcc__err_reset(&err);
  ssize_t n = op->kind == TCC_OP_SEND ? tcc__host_p2p_progress_send(comm, op->peer, ps, &err) : 0;
  if (n >= 0 && (op->kind == TCC_OP_RECV || op->by_ref)) n = tcc__host_p2p_progress_recv(comm, op->peer, ps, &err);
  if (n < 0) tcc__host_p2p_break_peer(comm, ps, &err);
}

bool tcc__host_p2p_now(tcc_comm_t *comm, tcc_op_t *op) {
  if (!take_idle_engine(comm)) return false;
  tcc_engine_t *e = comm->engine;
  /* The executor's reference, as submit takes it: no other thread has
   * the op yet. */
  atomic_store_explicit(&op->refs, atomic_load_explicit(&op->refs, memory_order_relaxed) + 1, memory_order_relaxed);
  tcc__op_begin(op);
  atomic_fetch_add(&e->p2p_pending, 1);
  op->next = NULL;
  tcc__host_p2p_adopt(comm, op); /* matches what arrived for it, fails it on a broken stream */
  if (!atomic_load(&op->finished)) {
    if (op->peer == TCC_ANY_SOURCE) tcc__host_p2p_round(comm);
    else move_own_stream(comm, op);
  }
  /* A while on its own stream alone, as a waiter's first spins: bytes
   * for it are most likely on their way. */
  for (int spin = 0; !atomic_load(&op->finished) && op->peer != TCC_ANY_SOURCE && spin < comm->cpu_share.spins;
       spin++) {
    tcc_cpu_relax();
    move_own_stream(comm, op);
  }
  if (atomic_load(&op->finished)) {
    tcc__host_p2p_end_caller_round(e, op);
    return true;
  }
  tcc__host_p2p_drive_held(comm, op, INT64_MAX); /* until its own deadline fails it, at the latest */
  return true;
}

static bool send_whole(tcc_comm_t *comm, const void *buf, size_t bytes, int peer, uint64_t tag, tcc_err_t *err) {
  const size_t total = sizeof(tcc_p2p_frame_t) + bytes;
  if (!comm->ops->p2p_fits || bytes > P2P_GATHER_BYTES || !take_idle_engine(comm)) return false;
  /* Within the threshold of single-copy messages too (p2p_direct.c). */
  tcc_engine_t *e = comm->engine;
  peer_state_t *ps = &e->peers[peer];
  if (ps->send_head || ps->done_sent > 0 || ps->broken != TCC_OK || !comm->ops->p2p_fits(comm, peer, total) ||
      (comm->ops->p2p_direct && bytes > 0 && comm->ops->p2p_direct(comm, peer, bytes, true))) {
    pthread_mutex_unlock(&e->p2p_progress);
    return false;
  }
  tcc_p2p_frame_t h;
  tcc__p2p_frame_make(&h, TCC_P2P_DATA, tag, bytes);
  const struct iovec iov[2] = {{&h, sizeof h}, {(void *)buf, bytes}};
  const ssize_t n = comm->ops->p2p_write(comm, peer, iov, bytes ? 2 : 1, err);
  if (n >= 0 && (size_t)n != total) /* the rest would never follow: the stream is out of step */
    tcc__err_set(err, TCC_ERR_SYSTEM, "the stream took %zd of a message's %zu bytes that it said fit", n, total);
  if (err->code != TCC_OK) tcc__host_p2p_break_peer(comm, ps, err); /* fails what else waits on that stream */
  pthread_mutex_unlock(&e->p2p_progress);
  return true;
}

/* A whole frame from `peer` for (tag, bytes) at the front of its stream,
 * taken into buf: 1. Else nothing taken: 0 when the stream holds nothing
 * yet, 2 when something else is there (another tag or size, a frame in
 * parts, a bad header: the rounds deal with it), -1 when the stream
 * failed (*err). Reads through ps->ahead, as the rounds do. */
static int take_whole_frame(tcc_comm_t *comm, int peer, peer_state_t *ps, uint64_t tag, void *buf, size_t bytes,
                            tcc_err_t *err) {
  if (ps->ahead_off == ps->ahead_len) {
    const ssize_t n = comm->ops->p2p_read(comm, peer, ps->ahead, sizeof ps->ahead, err);
    if (n <= 0) return (int)n;
    ps->ahead_off = 0;
    ps->ahead_len = (size_t)n;
  }
  const size_t have = ps->ahead_len - ps->ahead_off;
  tcc_p2p_frame_t h;
  if (have < sizeof h) return 2;
  memcpy(&h, ps->ahead + ps->ahead_off, sizeof h);
  if (h.magic != TCC_P2P_FRAME_MAGIC || h.tag != tag || h.bytes != bytes || have - sizeof h < bytes) return 2;
  tcc_err_t bad;
  if (tcc__p2p_frame_check(comm, peer, &h, &bad) != TCC_OK) return 2;
  memcpy(buf, ps->ahead + ps->ahead_off + sizeof h, bytes);
  ps->ahead_off += sizeof h + bytes;
  return 1;
}

static bool recv_whole(tcc_comm_t *comm, void *buf, size_t bytes, int peer, uint64_t tag, tcc_err_t *err) {
  tcc_engine_t *e = comm->engine;
  if (peer == TCC_ANY_SOURCE || !e || bytes > sizeof e->peers[0].ahead - sizeof(tcc_p2p_frame_t) ||
      !take_idle_engine(comm))
    return false;
  peer_state_t *ps = &e->peers[peer];
  /* Its message is the peer's next frame only when no receive posted
   * before it could take it, nothing from the peer waits buffered, and
   * no frame is half parsed. */
  if (ps->recv_head || e->any_head || ps->unexp_head || ps->broken != TCC_OK || ps->in_payload || ps->in_hdr_got) {
    pthread_mutex_unlock(&e->p2p_progress);
    return false;
  }
  int taken = take_whole_frame(comm, peer, ps, tag, buf, bytes, err);
  /* A while on that stream alone, as a waiter's first spins: its bytes
   * are most likely on their way. */
  for (int spin = 0; taken == 0 && spin < comm->cpu_share.spins; spin++) {
    tcc_cpu_relax();
    taken = take_whole_frame(comm, peer, ps, tag, buf, bytes, err);
  }
  if (taken < 0) tcc__host_p2p_break_peer(comm, ps, err); /* fails what else waits on that stream */
  pthread_mutex_unlock(&e->p2p_progress);
  return taken == 1 || taken < 0;
}

bool tcc__host_p2p_move_now(tcc_comm_t *comm, tcc_op_kind_t kind, void *buf, size_t bytes, int peer, uint64_t tag,
                            tcc_result_t *result, tcc_err_t *err) {
  tcc_err_t failed;
  tcc__err_reset(&failed);
  const bool done = kind == TCC_OP_SEND ? send_whole(comm, buf, bytes, peer, tag, &failed)
                                        : recv_whole(comm, buf, bytes, peer, tag, &failed);
  if (!done) return false;
  *result = failed.code;
  if (failed.code != TCC_OK) {
    char msg[TCC_ERRLEN];
    tcc__host_p2p_describe_failure(msg, sizeof msg, comm, kind, peer, tag, failed.msg);
    tcc__err_set(err, failed.code, "%s", msg);
  }
  return true;
}
