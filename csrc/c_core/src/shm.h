/*
 * shm.h - private interface between the shared-memory transport's segment
 * management (shm.c) and its collective algorithms (shm_coll.c).
 *
 * One segment per communicator, created by rank 0 under a name derived
 * from rank 0's random endpoint token, mode 0600, and unlinked as soon as
 * every rank has mapped it (shm_segment.h). Rank 0 chooses the tunable
 * sizes and publishes them in the header; the other ranks use those, never
 * their own environment, and accept the header only when the layout they
 * recompute from it and the group size matches it exactly. Layout:
 *
 *   header | per-rank control (barrier arrival, p2p doorbell)
 *          | per-rank descriptors [2 parities]
 *          | per-rank staging [2 parities] x (input window W, result window W)
 *          | p2p rings, one per ordered pair of ranks
 *
 * Collectives advance in "stages". Stage s writes only parity s&1 of the
 * writer's own staging area, then every rank passes barrier s, then ranks
 * read parity s&1 of any rank. Writing stage s+1 (parity (s+1)&1) may start
 * right after barrier s: passing barrier s proves every rank finished
 * reading stage s-1, the last user of that parity. One barrier per stage,
 * no trailing barrier per collective.
 */
#ifndef TCC_SHM_H
#define TCC_SHM_H

#include "internal.h"
#include "shm_segment.h"

#define TCC_CACHELINE 64

typedef struct shm_header {
  tcc_segment_head_t seg; /* readiness, ranks attached, total size, secret */
  uint32_t size;
  uint64_t window;      /* W: staging bytes per rank, per parity, per area */
  uint64_t small_bytes; /* reductions up to this size go one-shot */
  uint64_t ring_bytes;  /* p2p ring capacity per ordered pair */
  uint64_t desc_stride;
  uint64_t ctrl_off, desc_off, data_off, ring_off;
  _Alignas(TCC_CACHELINE) atomic_uint barrier_futex;
  atomic_int barrier_sleepers;
} shm_header_t;

typedef struct shm_rank_ctrl {
  _Alignas(TCC_CACHELINE) atomic_ullong arrive; /* last barrier stage reached */
  _Alignas(TCC_CACHELINE) atomic_uint doorbell; /* bumped to wake the p2p thread */
  atomic_int doorbell_sleeping;
  atomic_int destroyed; /* set before the rank lets go of its liveness lock */
} shm_rank_ctrl_t;

typedef struct shm_ring {
  _Alignas(TCC_CACHELINE) atomic_ullong head; /* bytes ever written (producer) */
  _Alignas(TCC_CACHELINE) atomic_ullong tail; /* bytes ever read (consumer) */
  _Alignas(TCC_CACHELINE) char data[];
} shm_ring_t;

typedef struct shm_state {
  char *base;
  size_t bytes;
  shm_header_t *hdr;
  uint64_t stage; /* last barrier stage passed; identical on every rank */
  size_t window;
  size_t small_bytes; /* reductions up to this size go one-shot */
  /* Liveness (see shm_liveness.c): this rank holds a lock on byte `rank`
   * of the segment's file for as long as it lives; the kernel drops it
   * when the process dies, however it dies. */
  int lock_fd;
  atomic_llong *peer_checked_ns; /* [size] last liveness check of each peer */
  /* Per-collective scratch, `size` entries each; only the thread running
   * the collective queue (one at a time) touches it. */
  const void **srcs;
  const void **descs;
  struct shm_piece *pieces;
  struct shm_read *reads;
  const char **part_src;
  char **part_out;
  size_t *part_len;
} shm_state_t;

/* A contiguous run of a rank's staged stream. */
typedef struct shm_piece {
  const char *ptr;
  size_t len;
} shm_piece_t;

/* What this rank reads from one peer's stream: bytes [off, off+len) into dst. */
typedef struct shm_read {
  size_t off;
  size_t len;
  char *dst;
} shm_read_t;

static inline shm_state_t *shm_of(tcc_comm_t *comm) { return (shm_state_t *)comm->transport_state; }

static inline shm_rank_ctrl_t *shm_ctrl(shm_state_t *st, int r) {
  return (shm_rank_ctrl_t *)(st->base + st->hdr->ctrl_off) + r;
}
static inline char *shm_desc(shm_state_t *st, int r, int parity) {
  return st->base + st->hdr->desc_off + ((size_t)r * 2 + (size_t)parity) * st->hdr->desc_stride;
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
tcc_result_t tcc_shm_check_header(const shm_header_t *h, int n, size_t bytes, const char *who, tcc_err_t *err);

/* Arrives at the next stage's barrier and waits for every rank. On timeout
 * the message names `what`, seq and the ranks that did not arrive. */
tcc_result_t tcc_shm_barrier(tcc_comm_t *comm, shm_state_t *st, int64_t deadline_ns, const char *what,
                             uint64_t seq, tcc_err_t *err);

/* The parity the next stage writes. */
static inline int shm_next_parity(const shm_state_t *st) { return (int)((st->stage + 1) & 1); }

/* shm_liveness.c. Takes this rank's liveness lock on `fd`, the segment's
 * descriptor from tcc_segment_create (rank 0, which holds it already) or
 * tcc_segment_open (the others), before the rank counts itself attached,
 * so every rank's lock is held once attachment completes. Owns `fd` from
 * then on, also on failure: tcc_shm_liveness_stop closes it. */
tcc_result_t tcc_shm_liveness_start(tcc_comm_t *comm, shm_state_t *st, int fd, tcc_err_t *err);
/* Marks this rank as having destroyed its communicator, then lets go of
 * the lock. */
void tcc_shm_liveness_stop(tcc_comm_t *comm, shm_state_t *st);
/* TCC_OK while `peer` lives (checked at most every few hundred ms unless
 * `now`), else TCC_ERR_REMOTE with a message naming `what` and the peer
 * and saying whether it exited or destroyed its communicator. */
tcc_result_t tcc_shm_peer_check(tcc_comm_t *comm, shm_state_t *st, int peer, bool now,
                                const char *what, tcc_err_t *err);

tcc_result_t tcc_shm_run_collective(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq,
                                    int64_t deadline_ns, tcc_err_t *err);

#endif /* TCC_SHM_H */
