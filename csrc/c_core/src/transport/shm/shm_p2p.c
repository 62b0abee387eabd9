/*
 * shm_p2p.c - the point-to-point byte streams of the shared-memory
 * transport: one single-producer single-consumer ring per ordered pair of
 * ranks, and a doorbell per rank that wakes its sleeping p2p thread.
 */
#include <string.h>

#include "core/idle_wait.h"
#include "transport/shm/shm.h"
#include "core/copy.h"

static void ring_doorbell(shm_state_t *st, int rank) {
  shm_rank_ctrl_t *c = shm_ctrl(st, rank);
  if (atomic_load(&c->doorbell_sleeping)) {
    atomic_fetch_add(&c->doorbell, 1);
    tcc__futex_wake_all(&c->doorbell);
  }
}

/* Where this rank runs, for a peer that waits for its bytes next; written
 * only when it changed: a waiting peer reads this line while it spins,
 * and every write would take it away from it. */
static void publish_cpu(tcc_comm_t *comm, shm_state_t *st) {
  if (!comm->cpu_share.spin_while_away) return;
  atomic_int *cpu = &shm_ctrl(st, comm->rank)->cpu;
  const int here = tcc__cpu_now();
  if (atomic_load_explicit(cpu, memory_order_relaxed) != here) atomic_store_explicit(cpu, here, memory_order_relaxed);
}

int tcc__shm_peer_cpu(tcc_comm_t *comm, int peer) {
  return atomic_load_explicit(&shm_ctrl(shm_of(comm), peer)->cpu, memory_order_relaxed);
}

/* Copies len bytes into the ring from position `at` on, wrapping at cap. */
static void ring_put(shm_ring_t *ring, size_t cap, size_t at, const char *src, size_t len) {
  if (len <= cap - at) {
    tcc__copy(ring->data + at, src, len);
    return;
  }
  tcc__copy(ring->data + at, src, cap - at);
  tcc__copy(ring->data, src + (cap - at), len - (cap - at));
}

/* The ring's free bytes, as far as needed: the reader's tail is read
 * only when the room last seen is smaller than `want` (see
 * tcc__shm_p2p_write). Only its writer (one thread at a time: the host
 * executor's p2p_progress) uses up room. */
static size_t ring_room(shm_state_t *st, int peer, shm_ring_t *ring, uint64_t head, size_t want) {
  const size_t cap = st->hdr->ring_bytes;
  size_t space = cap - (size_t)(head - st->tail_seen[peer]);
  if (space < want) {
    st->tail_seen[peer] = atomic_load_explicit(&ring->tail, memory_order_acquire);
    space = cap - (size_t)(head - st->tail_seen[peer]);
  }
  return space;
}

bool tcc__shm_p2p_fits(tcc_comm_t *comm, int peer, size_t bytes) {
  shm_state_t *st = shm_of(comm);
  shm_ring_t *ring = shm_ring_of(st, comm->rank, peer);
  return ring_room(st, peer, ring, atomic_load_explicit(&ring->head, memory_order_relaxed), bytes) >= bytes;
}

ssize_t tcc__shm_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  size_t len = 0;
  for (int i = 0; i < iovcnt; i++) len += iov[i].iov_len;
  /* Bytes for a peer that is gone would never be read. */
  if (tcc__shm_peer_check(comm, st, peer, false, "point-to-point stream", err) != TCC_OK) return -1;
  shm_ring_t *ring = shm_ring_of(st, comm->rank, peer);
  const size_t cap = st->hdr->ring_bytes;
  uint64_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
  /* The reader's tail line is read only when the room last seen is too
   * small: reading it on every write took the line from the reader each
   * message, a cache miss on the sender's path. A stale tail only
   * understates the room (the tail never goes back). */
  const size_t space = ring_room(st, peer, ring, head, len);
  size_t n = len < space ? len : space;
  if (n == 0) return 0;
  size_t at = (size_t)(head % cap), left = n;
  for (int i = 0; i < iovcnt && left > 0; i++) {
    const size_t k = iov[i].iov_len < left ? iov[i].iov_len : left;
    ring_put(ring, cap, at, iov[i].iov_base, k);
    at += k;
    if (at >= cap) at -= cap;
    left -= k;
  }
  /* One head update for all the parts: the reader sees them together. */
  atomic_store_explicit(&ring->head, head + n, memory_order_seq_cst);
  ring_doorbell(st, peer);
  publish_cpu(comm, st);
  return (ssize_t)n;
}

ssize_t tcc__shm_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  shm_ring_t *ring = shm_ring_of(st, peer, comm->rank);
  const size_t cap = st->hdr->ring_bytes;
  uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  /* The line the next bytes land in, asked for before the head: when
   * they are there, the two misses overlap instead of following each
   * other (the head's line, then the data's). */
  __builtin_prefetch(ring->data + tail % cap);
  uint64_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
  size_t avail = (size_t)(head - tail);
  size_t n = len < avail ? len : avail;
  if (n == 0) {
    /* What a peer wrote before it went is still read; after that, nothing
     * more can come. The head is read again after the check: bytes written
     * just before the peer went must not be lost. */
    if (tcc__shm_peer_check(comm, st, peer, false, "point-to-point stream", err) == TCC_OK) return 0;
    if (atomic_load_explicit(&ring->head, memory_order_acquire) != head) {
      err->code = TCC_OK;
      err->msg[0] = 0;
      return 0;
    }
    return -1;
  }
  size_t at = (size_t)(tail % cap);
  size_t first = n < cap - at ? n : cap - at;
  tcc__copy(buf, ring->data + at, first);
  tcc__copy((char *)buf + first, ring->data, n - first);
  atomic_store_explicit(&ring->tail, tail + n, memory_order_seq_cst);
  ring_doorbell(st, peer); /* the writer may be waiting for space */
  publish_cpu(comm, st);
  return (ssize_t)n;
}

/* True when some ring can move bytes for us right now. */
static bool p2p_ready(tcc_comm_t *comm, shm_state_t *st, const bool *want_write) {
  for (int p = 0; p < comm->size; p++) {
    if (p == comm->rank) continue;
    shm_ring_t *in = shm_ring_of(st, p, comm->rank);
    if (atomic_load(&in->head) != atomic_load(&in->tail)) return true;
    if (want_write[p]) {
      shm_ring_t *out = shm_ring_of(st, comm->rank, p);
      if (atomic_load(&out->head) - atomic_load(&out->tail) < st->hdr->ring_bytes) return true;
    }
  }
  return false;
}

bool tcc__shm_p2p_sleep_begin(tcc_comm_t *comm, const bool *want_write) {
  shm_state_t *st = shm_of(comm);
  /* Counted first: a peer's write or read after the check below sees the
   * count and rings (both sides seq_cst). */
  atomic_fetch_add(&shm_ctrl(st, comm->rank)->doorbell_sleeping, 1);
  if (!p2p_ready(comm, st, want_write)) return true;
  tcc__shm_p2p_sleep_end(comm);
  return false;
}

void tcc__shm_p2p_sleep_end(tcc_comm_t *comm) {
  atomic_fetch_sub(&shm_ctrl(shm_of(comm), comm->rank)->doorbell_sleeping, 1);
}

void tcc__shm_doorbell_relay(tcc_comm_t *comm, atomic_bool *stop, void (*wake)(void *), void *arg) {
  atomic_uint *bell = &shm_ctrl(shm_of(comm), comm->rank)->doorbell;
  unsigned seen = atomic_load(bell);
  while (!atomic_load(stop)) {
    /* Returns at once when the count moved since `seen`: no ring is lost
     * between a wake-up and the next sleep. Bounded: a lost stop costs a
     * second. */
    tcc__futex_wait(bell, seen, 1000 * 1000000LL);
    const unsigned now = atomic_load(bell);
    if (now != seen) {
      seen = now;
      wake(arg);
    }
  }
}

/* What ends the p2p thread's sleep: a ring it can move bytes on, the
 * doorbell rung since it decided to sleep (a peer wrote or read, or local
 * work arrived: tcc__shm_p2p_notify), or the communicator failing. */
typedef struct doorbell_wait {
  tcc_comm_t *comm;
  shm_state_t *st;
  const bool *want_write;
  unsigned rung_at; /* the doorbell's count when the wait began */
} doorbell_wait_t;

static bool p2p_wakeup(void *arg) {
  const doorbell_wait_t *d = arg;
  return atomic_load(&shm_ctrl(d->st, d->comm->rank)->doorbell) != d->rung_at || atomic_load(&d->comm->aborted) ||
         p2p_ready(d->comm, d->st, d->want_write);
}

void tcc__shm_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns) {
  shm_state_t *st = shm_of(comm);
  shm_rank_ctrl_t *me = shm_ctrl(st, comm->rank);
  doorbell_wait_t d = {comm, st, want_write, atomic_load(&me->doorbell)};
  const int64_t now = tcc__now_ns();
  /* Peers ring only while doorbell_sleeping is set (ring_doorbell). */
  const tcc__idle_wait_t w = {.ready = p2p_wakeup, .arg = &d, .max_nap_ns = max_ns,
                              .deadline_ns = max_ns > INT64_MAX - now ? INT64_MAX : now + max_ns,
                              .word = &me->doorbell, .sleepers = &me->doorbell_sleeping};
  tcc__idle_wait(&w);
}

void tcc__shm_doorbell_wake(tcc_comm_t *comm) {
  atomic_uint *bell = &shm_ctrl(shm_of(comm), comm->rank)->doorbell;
  atomic_fetch_add(bell, 1);
  tcc__futex_wake_all(bell);
}

void tcc__shm_p2p_notify(tcc_comm_t *comm) {
  shm_state_t *st = shm_of(comm);
  if (!st) return;
  shm_rank_ctrl_t *me = shm_ctrl(st, comm->rank);
  /* Bumped first: a thread about to sleep sees the change (idle_wait.c). */
  atomic_fetch_add(&me->doorbell, 1);
  if (atomic_load(&me->doorbell_sleeping)) tcc__futex_wake_all(&me->doorbell);
}
