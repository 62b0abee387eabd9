/*
 * coll_slots.c - small rooted collectives (broadcast, scatter, gather,
 * reduce) over the transport's slot rings (tcc__spans_ops_t.slot): a
 * rank that only sends writes its part into its next slot and returns,
 * without waiting for the receivers. A stage exchange costs every rank a
 * trip of a cache line between CPUs per op however small the op; a ring
 * lets a loop of them stream (bench/README, bench_handoff).
 *
 * Positions: every rank counts the slot-ring ops it ran (1, 2, ...): the
 * same count on every rank while the ranks agree on their ops, since
 * whether an op goes here depends only on what they agree on. Op p uses
 * slot p of each sender's ring, which held op p - K before (K slots).
 *
 *  - A sender waits until every other rank finished op p - K, writes its
 *    descriptor and part into slot p, then stores p in the slot's first
 *    word (release), then p as "entered" in its progress line.
 *  - A receiver stores p as entered, then for each sender waits for the
 *    slot to hold p, checks the sender's descriptor against its own and
 *    copies or reduces the part.
 *  - Every rank stores p as "finished" when done with the op.
 *
 * Agreement. A sender does not wait, so it cannot see its receivers'
 * descriptors. Receivers check their senders' and fail the op. The rest
 * is checked at the next op over the staging windows: each rank's digest
 * of its own descriptors of slot-ring ops travels beside that op's
 * descriptor, and every rank compares them (tcc__coll_slots_verify). A
 * disagreement found either way fails the communicator, not only the op:
 * its ranks are no longer in step (they ran different ops).
 */
#include <stdio.h>
#include <string.h>

#include "coll/coll_scratch.h"
#include "core/copy.h"
#include "core/prefetch.h"

/* A slot: the op's position (written last), its descriptor, its part. */
#define SLOT_POS_BYTES 8
#define SLOT_DESC_AT SLOT_POS_BYTES
#define SLOT_PART_AT (SLOT_DESC_AT + sizeof(tcc_coll_desc_t))
_Static_assert(SLOT_PART_AT == 32, "a slot's head is half a cache line: a part of 32 bytes shares its line");

/* The progress words of a rank (tcc__spans_ops_t.slot_progress). */
enum { PROGRESS_ENTERED = 0, PROGRESS_FINISHED = 1 };

/* The bytes one sender puts in its slot for c. */
static size_t part_bytes(const tcc_coll_t *c, int n) {
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  return c->kind == TCC_COLL_SCATTER ? (size_t)(n - 1) * bytes : bytes;
}

static bool sends(const tcc_coll_t *c, int rank) {
  const bool root = rank == c->root;
  return c->kind == TCC_COLL_BROADCAST || c->kind == TCC_COLL_SCATTER ? root : !root;
}

size_t tcc__coll_slots_part_max(tcc_comm_t *comm) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  if (!sp || comm->parent || comm->size < 2 || sp->slot_count(comm) == 0) return 0;
  return sp->slot_bytes(comm) - SLOT_PART_AT;
}

bool tcc__coll_slots_fit(tcc_comm_t *comm, const tcc_coll_t *c) {
  /* The kind first: every other op asks too, and that answers it. */
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
    case TCC_COLL_SCATTER:
    case TCC_COLL_GATHER:
    case TCC_COLL_REDUCE:
      break;
    default:
      return false;
  }
  const size_t part_max = coll_scratch_of(comm)->slot_part_max;
  if (part_max == 0) return false;
  /* Elements are at least a byte each: a count above the slot's size does
   * not fit, and the product below cannot overflow. */
  if (c->count > part_max) return false;
  return part_bytes(c, comm->size) <= part_max;
}

/* Every rank's digest of its slot-ring descriptors: equal on every rank
 * when they ran the same ones; published folded to 32 bits, so ranks that
 * disagree go unnoticed with a chance of 2^-32. */
static uint64_t digest_add(uint64_t h, const tcc_coll_desc_t *d) {
  uint64_t w[3];
  memcpy(w, d, sizeof w);
  for (int i = 0; i < 3; i++) {
    h ^= w[i];
    h *= 0x100000001b3ull;
    h ^= h >> 29;
  }
  return h;
}

/* ---- waits --------------------------------------------------------------- */

typedef struct slot_watch {
  tcc_comm_t *comm;
  const tcc__spans_ops_t *sp;
  int peer;
  uint64_t pos;
  bool out_of_step; /* the peer went past this op without what is waited for */
  const char *slot; /* part_arrived: the peer's slot for op pos */
} slot_watch_t;

/* A sender's slot holds op `pos`, or the sender went past it without. */
static bool part_arrived(void *arg) {
  slot_watch_t *w = arg;
  const atomic_ullong *at = (const atomic_ullong *)w->slot;
  if (atomic_load_explicit(at, memory_order_acquire) == w->pos) return true;
  const atomic_ullong *progress = w->sp->slot_progress(w->comm, w->peer);
  if (atomic_load_explicit(&progress[PROGRESS_ENTERED], memory_order_acquire) >= w->pos ||
      w->sp->stage_ahead(w->comm, w->peer)) {
    /* Entered stores come after the slot's: look once more. */
    w->out_of_step = atomic_load_explicit(at, memory_order_acquire) != w->pos;
    return true;
  }
  return false;
}

/* A peer finished op `pos`, or went on to ops over the staging windows
 * without having run as many slot-ring ops. */
static bool peer_finished(void *arg) {
  slot_watch_t *w = arg;
  const atomic_ullong *progress = w->sp->slot_progress(w->comm, w->peer);
  if (atomic_load_explicit(&progress[PROGRESS_FINISHED], memory_order_acquire) >= w->pos) return true;
  if (w->sp->stage_ahead(w->comm, w->peer)) {
    w->out_of_step = atomic_load_explicit(&progress[PROGRESS_FINISHED], memory_order_acquire) < w->pos;
    return true;
  }
  return false;
}

static tcc_result_t wait_for(tcc_comm_t *comm, slot_watch_t *w, bool (*ready)(void *), const tcc_coll_t *c,
                             uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const char *op = tcc__coll_name(c->kind);
  /* Looked at once before the transport's wait, which a ready peer (the
   * usual case for a sender's room) does not need. */
  tcc_result_t r = ready(w) ? TCC_OK : w->sp->slot_wait(comm, ready, w, w->peer, deadline, op, seq, err);
  if (r == TCC_ERR_TIMEOUT)
    return tcc__err_set(err, TCC_ERR_TIMEOUT,
                        "tccomm %s #%llu on '%s' (rank %d): timed out waiting for rank %d %s (it did not call "
                        "it, or is stuck in an earlier operation)",
                        op, (unsigned long long)seq, comm->name, tcc__self_label(comm),
                        tcc__rank_label(comm, w->peer),
                        ready == part_arrived ? "to send its part"
                                              : "to take what this rank sent it in an earlier small rooted op");
  if (r != TCC_OK) return r;
  if (w->out_of_step)
    return tcc__coll_out_of_step(comm, err,
                       "tccomm %s #%llu on '%s' (rank %d): rank %d issued a different collective: it went past "
                       "this one without %s",
                       op, (unsigned long long)seq, comm->name, tcc__self_label(comm),
                       tcc__rank_label(comm, w->peer),
                       ready == part_arrived ? "sending its part" : "the small rooted ops this rank ran");
  return TCC_OK;
}

/* ---- one op ------------------------------------------------------------- */

/* How much of a slot the next op's lines are asked for ahead, at most:
 * small ops are the lines' trips between CPUs; larger ones, bandwidth. */
#define SLOT_PREFETCH_MAX_BYTES 4096

/* Right after op `pos`: the slot lines op pos + 1 will likely use, asked
 * for ahead, on the guess that it is alike (ops in a loop are). A sender
 * takes its own next slot back from the receivers that read it K ops
 * ago; a receiver asks for the lines it will read of each sender's next
 * slot, which a sender running ahead has written already. Either way
 * the lines travel while this rank finishes the op and issues the next,
 * not when that op touches them (bench/README, "Slot lines asked for
 * ahead"). */
static void prefetch_next_slot(tcc_comm_t *comm, const tcc__spans_ops_t *sp, const tcc_coll_t *c, uint64_t pos) {
  const int n = comm->size, me = comm->rank;
  if (sends(c, me)) {
    size_t bytes = SLOT_PART_AT + part_bytes(c, n);
    if (bytes > SLOT_PREFETCH_MAX_BYTES) bytes = SLOT_PREFETCH_MAX_BYTES;
    tcc__prefetch_write_span(sp->slot(comm, me, pos + 1), bytes);
    return;
  }
  /* A scatter's receiver reads its own piece of the root's part only. */
  size_t bytes = c->count * tcc__dtype_size(c->dtype), skip = 0;
  if (c->kind == TCC_COLL_SCATTER) skip = (size_t)(me < c->root ? me : me - 1) * bytes;
  if (bytes > SLOT_PREFETCH_MAX_BYTES) bytes = SLOT_PREFETCH_MAX_BYTES;
  for (int j = 0; j < n; j++) {
    if (j == me || !sends(c, j)) continue;
    const char *slot = sp->slot(comm, j, pos + 1);
    tcc__prefetch_read(slot); /* the head: position and descriptor */
    tcc__prefetch_read_span(slot + SLOT_PART_AT + skip, bytes);
  }
}

/* Where this rank's part for c comes from: pieces in rank order. */
static void write_part(tcc_comm_t *comm, const tcc_coll_t *c, char *to) {
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  if (bytes == 0) return;
  if (c->kind != TCC_COLL_SCATTER) {
    tcc__copy(to, c->send, bytes);
    return;
  }
  for (int k = 0; k < comm->size; k++) {
    if (k == comm->rank) continue;
    tcc__copy(to, c->sends[k], bytes);
    to += bytes;
  }
}

/* The sender's half: room in its next slot, then the slot. */
static tcc_result_t send_part(tcc_comm_t *comm, tcc__coll_scratch_t *sc, const tcc_coll_t *c,
                              const tcc_coll_desc_t *mine, uint64_t pos, uint64_t seq, int64_t deadline,
                              tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  const unsigned K = sp->slot_count(comm);
  if (pos > K && sc->slot_room < pos - K) {
    /* Slot pos held op pos - K: every peer must be done with it. Their
     * least progress is kept, so the lines are read once per many ops. */
    uint64_t least = UINT64_MAX;
    for (int j = 0; j < comm->size; j++) {
      if (j == comm->rank) continue;
      slot_watch_t w = {comm, sp, j, pos - K, false, NULL};
      tcc_result_t r = wait_for(comm, &w, peer_finished, c, seq, deadline, err);
      if (r != TCC_OK) return r;
      const uint64_t f = atomic_load_explicit(&sp->slot_progress(comm, j)[PROGRESS_FINISHED], memory_order_acquire);
      if (f < least) least = f;
    }
    sc->slot_room = least;
  }
  char *slot = sp->slot(comm, comm->rank, pos);
  memcpy(slot + SLOT_DESC_AT, mine, sizeof *mine);
  write_part(comm, c, slot + SLOT_PART_AT);
  atomic_store_explicit((atomic_ullong *)slot, pos, memory_order_release);
  return TCC_OK;
}

/* The part of sender j's slot this rank takes: checked first. */
static tcc_result_t take_part(tcc_comm_t *comm, const tcc_coll_t *c, const tcc_coll_desc_t *mine, int j,
                              uint64_t pos, uint64_t seq, int64_t deadline, const char **part, tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  const char *slot = sp->slot(comm, j, pos);
  slot_watch_t w = {comm, sp, j, pos, false, slot};
  tcc_result_t r = wait_for(comm, &w, part_arrived, c, seq, deadline, err);
  if (r != TCC_OK) return r;
  tcc_coll_desc_t theirs;
  memcpy(&theirs, slot + SLOT_DESC_AT, sizeof theirs);
  r = tcc__coll_desc_check_peer(comm, c, mine, &theirs, j, err);
  if (r != TCC_OK) {
    char why[TCC_ERRLEN];
    snprintf(why, sizeof why, "%s", err->msg);
    tcc__err_reset(err);
    return tcc__coll_out_of_step(comm, err, "%s", why);
  }
  *part = slot + SLOT_PART_AT;
  return TCC_OK;
}

static tcc_result_t receive(tcc_comm_t *comm, const tcc_coll_t *c, const tcc_coll_desc_t *mine, uint64_t pos,
                            uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const int n = comm->size, me = comm->rank, root = c->root;
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  const char *part;
  tcc_result_t r;
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
    case TCC_COLL_SCATTER: {
      r = take_part(comm, c, mine, root, pos, seq, deadline, &part, err);
      if (r != TCC_OK) return r;
      const size_t index = c->kind == TCC_COLL_SCATTER ? (size_t)(me < root ? me : me - 1) : 0;
      if (bytes) tcc__copy(c->recv, part + index * bytes, bytes);
      return TCC_OK;
    }
    case TCC_COLL_GATHER:
      for (int j = 0; j < n; j++) {
        if (j == me) continue;
        r = take_part(comm, c, mine, j, pos, seq, deadline, &part, err);
        if (r != TCC_OK) return r;
        if (bytes) tcc__copy(c->recvs[j], part, bytes);
      }
      if (bytes && c->recvs[me] != c->send) tcc__move(c->recvs[me], c->send, bytes);
      return TCC_OK;
    case TCC_COLL_REDUCE: {
      const void **srcs = coll_scratch_of(comm)->srcs;
      for (int j = 0; j < n; j++) {
        if (j == me) {
          srcs[j] = c->send;
          continue;
        }
        r = take_part(comm, c, mine, j, pos, seq, deadline, &part, err);
        if (r != TCC_OK) return r;
        srcs[j] = part;
      }
      /* Every input in rank order, as the one-shot reduction over the
       * windows adds them: the same bits either way. */
      if (c->count) tcc__reduce_n(c->recv, srcs, n, c->count, c->dtype, c->redop, c->premul);
      return TCC_OK;
    }
    default:
      return TCC_OK;
  }
}

tcc_result_t tcc__coll_slots_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                 tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  const uint64_t pos = ++sc->slot_pos;
  tcc_coll_desc_t mine;
  tcc__coll_desc_fill(c, seq, comm->size, &mine);
  sc->slot_digest = digest_add(sc->slot_digest, &mine);
  if (!sc->slot_first_seq) sc->slot_first_seq = seq;
  sc->slot_last_seq = seq;
  atomic_ullong *progress = sp->slot_progress(comm, comm->rank);
  tcc_result_t r = TCC_OK;
  if (sends(c, comm->rank)) r = send_part(comm, sc, c, &mine, pos, seq, deadline, err);
  if (r != TCC_OK) return r;
  atomic_store_explicit(&progress[PROGRESS_ENTERED], pos, memory_order_release);
  if (c->kind == TCC_COLL_SCATTER && comm->rank == c->root && c->count)
    tcc__move(c->recv, c->sends[comm->rank], c->count * tcc__dtype_size(c->dtype));
  if (!sends(c, comm->rank)) r = receive(comm, c, &mine, pos, seq, deadline, err);
  if (r != TCC_OK) return r;
  atomic_store_explicit(&progress[PROGRESS_FINISHED], pos, memory_order_release);
  sp->slot_wake(comm);
  prefetch_next_slot(comm, sp, c, pos);
  return TCC_OK;
}

/* ---- agreement at the next op over the windows -------------------------- */

void tcc__coll_slots_publish(tcc_comm_t *comm, int parity) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  const uint64_t h = coll_scratch_of(comm)->slot_digest;
  *sp->digest(comm, comm->rank, parity) = (uint32_t)(h ^ (h >> 32));
}

tcc_result_t tcc__coll_slots_verify(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int parity,
                                    tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  const uint32_t first = *sp->digest(comm, 0, parity);
  for (int j = 1; j < comm->size; j++) {
    if (*sp->digest(comm, j, parity) == first) continue;
    if (sc->slot_first_seq)
      return tcc__coll_out_of_step(comm, err,
                         "tccomm %s #%llu on '%s' (rank %d): the ranks disagreed on the small rooted ops before it "
                         "(this rank ran them as #%llu to #%llu): rank 0's digest of them differs from rank %d's",
                         tcc__coll_name(c->kind), (unsigned long long)seq, comm->name, tcc__self_label(comm),
                         (unsigned long long)sc->slot_first_seq, (unsigned long long)sc->slot_last_seq,
                         tcc__rank_label(comm, j));
    return tcc__coll_out_of_step(comm, err,
                       "tccomm %s #%llu on '%s' (rank %d): the ranks disagreed on small rooted ops before it "
                       "(this rank ran none since the last check): rank 0's digest of them differs from rank %d's",
                       tcc__coll_name(c->kind), (unsigned long long)seq, comm->name, tcc__self_label(comm),
                       tcc__rank_label(comm, j));
  }
  sc->slot_first_seq = 0;
  return TCC_OK;
}
