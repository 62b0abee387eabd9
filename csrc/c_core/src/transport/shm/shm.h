/*
 * shm.h - the shared-memory transport's private interface:
 *
 * shm_setup.c    the segment: layout, setup, teardown, the transport's table
 * shm_spans.c    staging windows and the stage barrier, for coll/
 * shm_p2p.c      the point-to-point rings
 * shm_liveness.c knowing when a peer is gone
 * shm_segment.c  creating, verifying and attaching segments (also windows')
 * shm_reap.c     removing what killed processes left in /dev/shm
 * shm_cma.c      single-copy reads from a peer's memory (cross-memory attach)
 *
 * One segment per communicator, created by rank 0 under a name derived
 * from rank 0's random endpoint token, mode 0600, and unlinked as soon as
 * every rank has mapped it (shm_segment.h). Rank 0 chooses the tunable
 * sizes and publishes them in the header; the other ranks use those, never
 * their own environment, and accept the header only when the layout they
 * recompute from it and the group size matches it exactly. Layout:
 *
 *   header | per-rank control (CPU, p2p doorbell, failure, liveness)
 *          | per-rank slots [2 parities]: barrier arrival, then descriptor
 *          | per-rank staging [2 parities] x (input window W, result window W)
 *          | p2p rings, one per ordered pair of ranks
 *          | per-rank slot rings (small rooted ops; absent when slot_bytes is 0):
 *            progress line, then SHM_SLOTS slots of slot_bytes
 *
 * The staging areas are the spans of transport.h's stage rule: collective
 * algorithms (coll/coll_staged.c) advance in stages, one barrier each.
 */
#ifndef TCC_SHM_H
#define TCC_SHM_H

#include "transport/transport.h"
#include "transport/shm/shm_segment.h"

/* How much of a failed rank's error its peers can quote. */
#define TCC_SHM_FAIL_REASON_BYTES 400

typedef struct shm_header {
  tcc_segment_head_t seg; /* readiness, ranks attached, total size, secret */
  uint32_t size;
  uint64_t window;      /* W: staging bytes per rank, per parity, per area */
  uint64_t small_bytes; /* reductions up to this size go one-shot */
  uint64_t ring_bytes;  /* p2p ring capacity per ordered pair */
  uint64_t direct_bytes; /* movement from this size reads peers' memory directly */
  uint64_t p2p_direct_bytes; /* point-to-point messages from this size go by reference */
  uint64_t desc_stride;
  uint64_t slot_bytes;  /* bytes of one slot of the slot rings; 0: none */
  uint64_t slot_span_bytes; /* rooted ops' parts up to this size may fill several slots; 0: one slot only */
  uint64_t ctrl_off, desc_off, data_off, ring_off, slots_off;
  _Alignas(TCC_CACHELINE) atomic_uint barrier_futex;
  atomic_int barrier_sleepers;
} shm_header_t;

typedef struct shm_rank_ctrl {
  _Alignas(TCC_CACHELINE) atomic_int cpu; /* the CPU the rank ran on at its last barrier (-1: not known) */
  _Alignas(TCC_CACHELINE) atomic_uint doorbell; /* bumped to wake the p2p thread */
  atomic_int doorbell_sleeping;
  atomic_int destroyed; /* set before the rank lets go of its liveness lock */
  /* Set (after fail_reason) when the rank's communicator failed: a rank
   * waiting on it fails at once, with the cause, not at its timeout. */
  atomic_int failed;
  char fail_reason[TCC_SHM_FAIL_REASON_BYTES];
  /* Single-copy reads (shm_cma.c), written before the rank counts itself
   * attached: its process id (0: it offers none) and where a word holding
   * probe_value lies in its own memory, which a peer reads to prove that
   * it can and that the id names this rank in the peer's pid namespace. */
  int32_t pid;
  uint64_t probe_addr, probe_value;
  /* Set once the rank has read every peer that way: a sender may then
   * hand it point-to-point messages by reference (host/p2p_direct.c). */
  atomic_int reads_peers;
} shm_rank_ctrl_t;

typedef struct shm_ring {
  _Alignas(TCC_CACHELINE) atomic_ullong head; /* where the writer's next record starts (shm_p2p.c) */
  _Alignas(TCC_CACHELINE) atomic_ullong tail; /* where the record being read starts */
  _Alignas(TCC_CACHELINE) char data[];
} shm_ring_t;

typedef struct shm_state {
  char *base;
  size_t bytes;
  shm_header_t *hdr;
  uint64_t stage; /* last barrier stage passed; identical on every rank */
  size_t window;
  size_t small_bytes; /* reductions up to this size go one-shot */
  size_t direct_bytes; /* see tcc__spans_ops_t: SIZE_MAX when a peer cannot be read */
  uint64_t probe;      /* the word peers read to test single-copy reads */
  /* Liveness (see shm_liveness.c): this rank holds a lock on byte `rank`
   * of the segment's file for as long as it lives; the kernel drops it
   * when the process dies, however it dies. */
  int lock_fd;
  atomic_llong *peer_checked_ns; /* [size] last liveness check of each peer */
  /* [size] how far each peer had read this rank's ring to it when this
   * rank last looked (shm_p2p.c): its room is known without reading the
   * peer's line while that says there is enough. Rounds are serialized
   * (the engine's p2p_progress lock). */
  uint64_t *tail_seen;
  /* [size] how far this rank has read the record at the tail of each
   * peer's ring to it (shm_p2p.c; under p2p_progress too). */
  size_t *rec_read;
} shm_state_t;

/* Bytes between consecutive rings: the ring and its capacity, page aligned. */
static inline size_t shm_ring_stride(const shm_header_t *h) {
  return (sizeof(shm_ring_t) + (size_t)h->ring_bytes + 4095) / 4096 * 4096;
}

/* The ring carrying bytes from rank `from` to rank `to`. */
static inline shm_ring_t *shm_ring_of(shm_state_t *st, int from, int to) {
  size_t idx = (size_t)from * st->hdr->size + (size_t)to;
  return (shm_ring_t *)(st->base + st->hdr->ring_off + idx * shm_ring_stride(st->hdr));
}

static inline shm_state_t *shm_of(tcc_comm_t *comm) { return (shm_state_t *)comm->transport_state; }

static inline shm_rank_ctrl_t *shm_ctrl(shm_state_t *st, int r) {
  return (shm_rank_ctrl_t *)(st->base + st->hdr->ctrl_off) + r;
}
/* A rank's slot of one parity starts on a cache line with the last stage of
 * that parity the rank reached (its barrier arrival, the stage's low 32
 * bits: ranks are never more than two stages apart, so comparing the
 * difference as a signed number survives the wrap) and the digest of its
 * slot-ring ops (tcc__spans_ops_t.digest), followed by its descriptor
 * span: a peer that sees the arrival has the descriptor, and a small
 * one-shot input after it (tcc__spans_ops_t.desc_inline_bytes), in the
 * same line, one transfer between cores instead of three. */
#define SHM_ARRIVAL_BYTES 4
#define SHM_DIGEST_BYTES 4
#define SHM_DESC_OFFSET (SHM_ARRIVAL_BYTES + SHM_DIGEST_BYTES)
static inline atomic_uint *shm_arrival(shm_state_t *st, int r, int parity) {
  return (atomic_uint *)(st->base + st->hdr->desc_off + ((size_t)r * 2 + (size_t)parity) * st->hdr->desc_stride);
}
/* Whether an arrival word that reads `at` says its rank reached `stage`. */
static inline bool shm_stage_reached(uint32_t at, uint64_t stage) { return (int32_t)(at - (uint32_t)stage) >= 0; }
static inline uint32_t *shm_digest(shm_state_t *st, int r, int parity) {
  return (uint32_t *)((char *)shm_arrival(st, r, parity) + SHM_ARRIVAL_BYTES);
}
static inline char *shm_desc(shm_state_t *st, int r, int parity) {
  return (char *)shm_arrival(st, r, parity) + SHM_DESC_OFFSET;
}

/* The slot rings (tcc__spans_ops_t.slot): SHM_SLOTS slots per rank, which
 * only that rank writes, after a line of its progress (entered, then
 * finished: the last slot-ring op it started and the last it completed). */
#define SHM_SLOTS 32
static inline size_t shm_slots_stride(const shm_header_t *h) {
  return TCC_CACHELINE + SHM_SLOTS * (size_t)h->slot_bytes;
}
static inline atomic_ullong *shm_slot_progress(shm_state_t *st, int r) {
  return (atomic_ullong *)(st->base + st->hdr->slots_off + (size_t)r * shm_slots_stride(st->hdr));
}
static inline char *shm_slot(shm_state_t *st, int r, unsigned index) {
  return (char *)shm_slot_progress(st, r) + TCC_CACHELINE + (size_t)(index % SHM_SLOTS) * st->hdr->slot_bytes;
}
/* Input window of rank r for a parity. */
static inline char *shm_in(shm_state_t *st, int r, int parity) {
  return st->base + st->hdr->data_off + ((size_t)r * 2 + (size_t)parity) * 2 * st->window;
}
/* Result window of rank r for a parity. */
static inline char *shm_res(shm_state_t *st, int r, int parity) {
  return shm_in(st, r, parity) + st->window;
}

/* Ranks other than 0: rank 0's header (the segment's first page) against
 * the layout recomputed from its published tunables and this group's size
 * n; `bytes` is the verified size of the mapping. TCC_OK, or
 * TCC_ERR_INVALID naming the first field that does not match. */
tcc_result_t tcc__shm_check_header(const shm_header_t *h, int n, size_t bytes, const char *who, tcc_err_t *err);

/* shm_spans.c: the staging windows and the stage barrier, as the
 * collective algorithms see them (tcc__spans_ops_t). */
extern const tcc__spans_ops_t tcc__shm_spans;

/* shm_p2p.c: the point-to-point rings. */
ssize_t tcc__shm_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt, tcc_err_t *err);
ssize_t tcc__shm_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err);
int tcc__shm_peer_cpu(tcc_comm_t *comm, int peer);
void tcc__shm_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns);
void tcc__shm_p2p_notify(tcc_comm_t *comm);
bool tcc__shm_p2p_fits(tcc_comm_t *comm, int peer, size_t bytes);
/* Single-copy point-to-point (transport.h's p2p_direct, p2p_peer_read). */
bool tcc__shm_p2p_direct(tcc_comm_t *comm, int peer, size_t bytes, bool to_peer);
tcc_result_t tcc__shm_p2p_peer_read(tcc_comm_t *comm, int peer, void *dst, uint64_t remote, size_t len, uint64_t seq,
                                    tcc_err_t *err);
/* For a p2p thread that sleeps elsewhere than on this rank's doorbell (a
 * hybrid group's, in TCP's poll), with a relay thread waking it:
 *  - sleep_begin: false when some ring can move bytes now (want_write[p]:
 *    there are bytes for peer p); true when nothing can, and from then on
 *    the peers ring the doorbell on every write and read, until sleep_end;
 *  - the relay runs until *stop, calling wake(arg) after each ring of the
 *    doorbell (whoever sets *stop then notifies). */
bool tcc__shm_p2p_sleep_begin(tcc_comm_t *comm, const bool *want_write);
void tcc__shm_p2p_sleep_end(tcc_comm_t *comm);
void tcc__shm_doorbell_relay(tcc_comm_t *comm, atomic_bool *stop, void (*wake)(void *), void *arg);
/* Wakes whatever sleeps on this rank's doorbell, counted or not (the relay's stop). */
void tcc__shm_doorbell_wake(tcc_comm_t *comm);

/* shm_cma.c. publish: before the rank counts itself attached, offers
 * single-copy reads of its memory unless TCCOMM_CMA=0 (this rank's own
 * environment). probe: once every rank attached, tries to read each peer
 * and sets st->direct_bytes. */
void tcc__shm_cma_publish(tcc_comm_t *comm, shm_state_t *st);
void tcc__shm_cma_probe(tcc_comm_t *comm, shm_state_t *st);
tcc_result_t tcc__shm_peer_read(tcc_comm_t *comm, int rank, void *local, uint64_t remote, size_t len,
                                const char *what, uint64_t seq, tcc_err_t *err);
tcc_result_t tcc__shm_peer_write(tcc_comm_t *comm, int rank, const void *local, uint64_t remote, size_t len,
                                 const char *what, uint64_t seq, tcc_err_t *err);

/* shm_liveness.c. Takes this rank's liveness lock on `fd`, the segment's
 * descriptor from tcc__segment_create (rank 0, which holds it already) or
 * tcc__segment_open (the others), before the rank counts itself attached,
 * so every rank's lock is held once attachment completes. Owns `fd` from
 * then on, also on failure: tcc__shm_liveness_stop closes it. */
tcc_result_t tcc__shm_liveness_start(tcc_comm_t *comm, shm_state_t *st, int fd, tcc_err_t *err);
/* Marks this rank as having destroyed its communicator, then lets go of
 * the lock. */
void tcc__shm_liveness_stop(tcc_comm_t *comm, shm_state_t *st);
/* The transport's `failed`: when announcing, publishes this rank's
 * failure and its cause in its control block. */
void tcc__shm_failed(tcc_comm_t *comm, bool announce);
/* TCC_OK while `peer` lives and its communicator has not failed (its
 * lock checked at most every few hundred ms unless `now`), else
 * TCC_ERR_REMOTE with a message naming `what` and the peer and saying
 * whether it exited, destroyed its communicator, or failed (and why). */
tcc_result_t tcc__shm_peer_check(tcc_comm_t *comm, shm_state_t *st, int peer, bool now,
                                const char *what, tcc_err_t *err);


#endif /* TCC_SHM_H */
