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

/* The rings hold records: an 8-byte header, then the record's bytes (one
 * write's), each record starting on a line of its own. The header says
 * that the record is there (REC_MARK in its high half, the length in its
 * low half), so a reader learns it from the line that also carries a
 * small record's bytes: one line crosses per small message, where a head
 * counter beside the data made it two (bench/README, "Point-to-point
 * latency"). Before it publishes a record, the writer clears the header
 * where the next record will start: the header a reader polls is zero
 * until a record is there, never bytes of the ring's last lap. So that
 * it can, a record leaves a line free before the reader's tail.
 * The head (where the next record starts) is the writer's, kept in the
 * ring for its own looks at the room; the tail (where the record being
 * read starts) is the reader's, and how far into that record it read is
 * its own (st->rec_read). */
#define REC_ALIGN ((uint64_t)TCC_CACHELINE)
#define REC_HEADER 8u
#define REC_MARK 0x72656331ull /* "rec1" */

static uint64_t rec_size(size_t bytes) { return (REC_HEADER + bytes + REC_ALIGN - 1) / REC_ALIGN * REC_ALIGN; }

static _Atomic uint64_t *rec_header(shm_ring_t *ring, size_t cap, uint64_t pos) {
  return (_Atomic uint64_t *)(void *)(ring->data + pos % cap);
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

/* The payload bytes a record written now may hold, as far as needed: the
 * reader's tail is read only when the room last seen is too small for
 * `want` (reading it on every write took the line from the reader each
 * message, a cache miss on the sender's path; a stale tail only
 * understates the room: it never goes back). Only its writer (one thread
 * at a time: the host executor's p2p_progress) uses up room. */
static size_t record_room(shm_state_t *st, int peer, shm_ring_t *ring, uint64_t head, size_t want) {
  const uint64_t cap = st->hdr->ring_bytes;
  uint64_t used = head - st->tail_seen[peer];
  if (rec_size(want) + REC_ALIGN > cap - used) {
    st->tail_seen[peer] = atomic_load_explicit(&ring->tail, memory_order_acquire);
    used = head - st->tail_seen[peer];
  }
  const uint64_t free_bytes = cap - used - REC_ALIGN; /* the line before the tail stays free */
  return free_bytes < REC_ALIGN ? 0 : (size_t)(free_bytes - REC_HEADER);
}

bool tcc__shm_p2p_fits(tcc_comm_t *comm, int peer, size_t bytes) {
  shm_state_t *st = shm_of(comm);
  shm_ring_t *ring = shm_ring_of(st, comm->rank, peer);
  return record_room(st, peer, ring, atomic_load_explicit(&ring->head, memory_order_relaxed), bytes) >= bytes;
}

ssize_t tcc__shm_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  size_t len = 0;
  for (int i = 0; i < iovcnt; i++) len += iov[i].iov_len;
  /* Bytes for a peer that is gone would never be read. */
  if (tcc__shm_peer_check(comm, st, peer, false, "point-to-point stream", err) != TCC_OK) return -1;
  shm_ring_t *ring = shm_ring_of(st, comm->rank, peer);
  const size_t cap = st->hdr->ring_bytes;
  const uint64_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
  const size_t room = record_room(st, peer, ring, head, len);
  const size_t n = len < room ? len : room;
  if (n == 0) return 0;
  size_t at = (size_t)((head + REC_HEADER) % cap), left = n;
  for (int i = 0; i < iovcnt && left > 0; i++) {
    const size_t k = iov[i].iov_len < left ? iov[i].iov_len : left;
    ring_put(ring, cap, at, iov[i].iov_base, k);
    at += k;
    if (at >= cap) at -= cap;
    left -= k;
  }
  const uint64_t next = head + rec_size(n);
  atomic_store_explicit(rec_header(ring, cap, next), 0, memory_order_relaxed);
  /* One header for all the parts: the reader sees them together, and
   * the cleared header after them (the store releases both). */
  atomic_store_explicit(rec_header(ring, cap, head), REC_MARK << 32 | n, memory_order_seq_cst);
  atomic_store_explicit(&ring->head, next, memory_order_relaxed);
  ring_doorbell(st, peer);
  publish_cpu(comm, st);
  return (ssize_t)n;
}

/* The length of the record at `tail`, of which `off` bytes were read: 0
 * when none is there yet, or -1 (*err) when its header is not one a
 * writer makes. */
static ssize_t record_at(tcc_comm_t *comm, int peer, shm_ring_t *ring, size_t cap, uint64_t tail, size_t off,
                         tcc_err_t *err) {
  const uint64_t h = atomic_load_explicit(rec_header(ring, cap, tail), memory_order_acquire);
  if (h == 0 && off == 0) return 0;
  const uint64_t n = h & 0xffffffffu;
  if (h >> 32 == REC_MARK && n > off && rec_size(n) + REC_ALIGN <= cap) return (ssize_t)n;
  tcc__err_set(err, TCC_ERR_REMOTE,
               "tccomm p2p on '%s' (rank %d): corrupt ring from rank %d: record header %#llx at byte %llu; no "
               "further message from rank %d can be trusted",
               comm->name, tcc__self_label(comm), tcc__rank_label(comm, peer), (unsigned long long)h,
               (unsigned long long)tail, tcc__rank_label(comm, peer));
  return -1;
}

/* Reads from one record a call, the one at the tail: the header after it
 * is most often the one the writer has just cleared, and a look at it
 * would cost the reader a miss on its way to the message it has. */
ssize_t tcc__shm_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  shm_ring_t *ring = shm_ring_of(st, peer, comm->rank);
  const size_t cap = st->hdr->ring_bytes;
  const uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  const size_t off = st->rec_read[peer];
  const ssize_t n = record_at(comm, peer, ring, cap, tail, off, err);
  if (n < 0) return -1;
  if (n == 0) {
    /* What a peer wrote before it went is still read; after that, nothing
     * more can come. The header is read again after the check: a record
     * written just before the peer went must not be lost. */
    if (tcc__shm_peer_check(comm, st, peer, false, "point-to-point stream", err) == TCC_OK) return 0;
    if (atomic_load_explicit(rec_header(ring, cap, tail), memory_order_acquire) != 0) {
      err->code = TCC_OK;
      err->msg[0] = 0;
      return 0;
    }
    return -1;
  }
  const size_t take = (size_t)n - off < len ? (size_t)n - off : len;
  const size_t at = (size_t)((tail + REC_HEADER + off) % cap);
  const size_t first = take < cap - at ? take : cap - at;
  tcc__copy(buf, ring->data + at, first);
  tcc__copy((char *)buf + first, ring->data, take - first);
  if (off + take < (size_t)n) {
    st->rec_read[peer] = off + take;
  } else { /* the record read whole: the writer may have been waiting for its room */
    st->rec_read[peer] = 0;
    atomic_store_explicit(&ring->tail, tail + rec_size((size_t)n), memory_order_seq_cst);
    ring_doorbell(st, peer);
  }
  publish_cpu(comm, st);
  return (ssize_t)take;
}

/* True when some ring can move bytes for us right now. */
static bool p2p_ready(tcc_comm_t *comm, shm_state_t *st, const bool *want_write) {
  const size_t cap = st->hdr->ring_bytes;
  for (int p = 0; p < comm->size; p++) {
    if (p == comm->rank) continue;
    shm_ring_t *in = shm_ring_of(st, p, comm->rank);
    if (atomic_load(rec_header(in, cap, atomic_load(&in->tail))) != 0) return true;
    if (want_write[p]) {
      shm_ring_t *out = shm_ring_of(st, comm->rank, p);
      if (atomic_load(&out->head) - atomic_load(&out->tail) + 2 * REC_ALIGN <= cap) return true;
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
