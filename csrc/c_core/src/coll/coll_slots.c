/*
 * coll_slots.c - small rooted collectives (broadcast, scatter, gather,
 * reduce) over the transport's slot rings (tcc__spans_ops_t.slot): a
 * rank that only sends writes its part into its next slot and returns,
 * without waiting for the receivers. A stage exchange costs every rank a
 * trip of a cache line between CPUs per op however small the op; a ring
 * lets a loop of them stream (bench/README, bench_handoff).
 *
 * Positions: every rank numbers the slots its slot-ring ops use (1, 2,
 * ...): the same numbers on every rank while the ranks agree on their ops,
 * since whether an op goes here, and over how many slots, depends only on
 * what they agree on. An op whose part fits one slot takes the next
 * position p; a larger one (up to the transport's slot_span_bytes) takes
 * m consecutive ones, p to p + m - 1, starting a lap of the ring where
 * they would wrap past its end, so that its slots lie one after the other.
 * Position p is slot p mod K of each sender's ring (K slots).
 *
 *  - A sender waits until every other rank finished the ops that used its
 *    slots a lap before, writes its descriptor and the part's first piece
 *    into the first slot, then stores p in its first word (release); each
 *    further slot likewise gets its piece, then its own position (p + 1,
 *    ...) in its first word. Then the sender stores the op's last
 *    position as "entered" in its progress line.
 *  - A receiver stores the last position as entered, then for each sender
 *    waits for the first slot to hold p, checks the sender's descriptor
 *    against its own and copies or reduces the part, each further slot
 *    once its first word holds its position: it copies one piece while
 *    the sender writes the next.
 *  - Every rank stores the last position as "finished" when done.
 *
 * A slot's first word is only ever a position: a part over several slots
 * leaves each slot's first line to it. So what a receiver finds there
 * before the sender came is an earlier lap's position, never data that
 * could happen to equal the one it waits for.
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
/* A part over several slots starts a line into each: the first line of
 * every slot keeps its position word (and the first slot's descriptor). */
#define SPAN_PART_AT TCC_CACHELINE

/* Where an op's part lies in a sender's ring. */
typedef struct part_place {
  char *slot;        /* its first slot */
  size_t slot_bytes; /* from one slot to the next */
  size_t at;         /* where the part starts in each slot */
  size_t piece;      /* the part's bytes in each slot */
} part_place_t;

/* How many slots of slot_bytes a part of `part` bytes takes. */
static unsigned slots_for(size_t part, size_t slot_bytes) {
  if (part <= slot_bytes - SLOT_PART_AT) return 1;
  const size_t piece = slot_bytes - SPAN_PART_AT;
  return (unsigned)((part + piece - 1) / piece);
}

static part_place_t place_of(char *first, size_t slot_bytes, unsigned slots) {
  const size_t at = slots == 1 ? SLOT_PART_AT : SPAN_PART_AT;
  return (part_place_t){first, slot_bytes, at, slot_bytes - at};
}

/* Where byte `off` of the part lies, and how many of its bytes follow
 * there in the same slot (*run). */
static char *place_at(const part_place_t *p, size_t off, size_t *run) {
  const size_t k = off / p->piece, in = off % p->piece;
  *run = p->piece - in;
  return p->slot + k * p->slot_bytes + p->at + in;
}

/* At most the whole ring: an op that needs more than half of it waits,
 * before it writes, until every peer is done with the op before (so it
 * does not pipeline as smaller ones do), but its sender still does not
 * wait for its own receivers (bench/README, "Parts over several slots":
 * a 1 MiB broadcast at 4 ranks 135 -> 42 us in C). */
size_t tcc__coll_slot_span_capacity(unsigned slots, size_t slot_bytes) {
  if (slots < 2 || slot_bytes <= SPAN_PART_AT) return 0;
  return (size_t)slots * (slot_bytes - SPAN_PART_AT);
}

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

size_t tcc__coll_slots_span_max(tcc_comm_t *comm) {
  if (tcc__coll_slots_part_max(comm) == 0) return 0;
  const size_t span = comm->ops->spans->slot_span_bytes(comm);
  const size_t most = tcc__coll_slot_span_capacity(comm->ops->spans->slot_count(comm), comm->ops->spans->slot_bytes(comm));
  return span < most ? span : most;
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
  const tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  const size_t part_max = sc->slot_part_max > sc->slot_span_max ? sc->slot_part_max : sc->slot_span_max;
  if (part_max == 0) return false;
  /* Elements are at least a byte each: a count above the largest part
   * does not fit, and the product below cannot overflow. */
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

/* One op over the rings, as the functions below see it. */
typedef struct slot_op {
  const tcc_coll_t *c;
  tcc_coll_desc_t mine; /* this rank's descriptor of it */
  uint64_t pos, last;   /* its first and last positions */
  unsigned slots;       /* last - pos + 1 */
  uint64_t seq;
  int64_t deadline;
} slot_op_t;

/* Bytes [off, off + len) of this rank's part for c into `to`; a
 * scatter's part is the other ranks' pieces in rank order. */
static void copy_part_range(tcc_comm_t *comm, const tcc_coll_t *c, char *to, size_t off, size_t len) {
  if (c->kind != TCC_COLL_SCATTER) {
    if (len) tcc__copy(to, (const char *)c->send + off, len);
    return;
  }
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  while (len) {
    const size_t q = off / bytes, in = off % bytes;
    const int k = (int)q < comm->rank ? (int)q : (int)q + 1;
    const size_t run = bytes - in < len ? bytes - in : len;
    tcc__copy(to, (const char *)c->sends[k] + in, run);
    to += run;
    off += run;
    len -= run;
  }
}

/* The sender's half: room in its next slots, then the slots. `before`:
 * the last position of this rank's previous op over the rings. */
static tcc_result_t send_part(tcc_comm_t *comm, tcc__coll_scratch_t *sc, const slot_op_t *op, uint64_t before,
                              tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  const unsigned K = sp->slot_count(comm);
  /* Slots pos..last held positions up to last - K a lap before: every
   * peer must be done with the ops that had them. Where this op skipped
   * to a new lap, the skipped positions held none of this lap: the
   * previous op is then the latest that matters. */
  uint64_t need = op->last > K ? op->last - K : 0;
  if (need > before) need = before;
  if (sc->slot_room < need) {
    /* Their least progress is kept, so the lines are read once per many ops. */
    uint64_t least = UINT64_MAX;
    for (int j = 0; j < comm->size; j++) {
      if (j == comm->rank) continue;
      slot_watch_t w = {comm, sp, j, need, false, NULL};
      tcc_result_t r = wait_for(comm, &w, peer_finished, op->c, op->seq, op->deadline, err);
      if (r != TCC_OK) return r;
      const uint64_t f = atomic_load_explicit(&sp->slot_progress(comm, j)[PROGRESS_FINISHED], memory_order_acquire);
      if (f < least) least = f;
    }
    sc->slot_room = least;
  }
  char *first = sp->slot(comm, comm->rank, op->pos);
  memcpy(first + SLOT_DESC_AT, &op->mine, sizeof op->mine);
  const part_place_t to = place_of(first, sp->slot_bytes(comm), op->slots);
  const size_t part = part_bytes(op->c, comm->size);
  for (unsigned k = 0; k < op->slots; k++) {
    char *slot = to.slot + k * to.slot_bytes;
    const size_t off = k * to.piece, run = part - off < to.piece ? part - off : to.piece;
    copy_part_range(comm, op->c, slot + to.at, off, run);
    atomic_store_explicit((atomic_ullong *)slot, op->pos + k, memory_order_release);
  }
  return TCC_OK;
}

/* The part of sender j's slots this rank takes: checked first. */
static tcc_result_t take_part(tcc_comm_t *comm, const slot_op_t *op, int j, part_place_t *part, tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  char *slot = sp->slot(comm, j, op->pos);
  slot_watch_t w = {comm, sp, j, op->pos, false, slot};
  tcc_result_t r = wait_for(comm, &w, part_arrived, op->c, op->seq, op->deadline, err);
  if (r != TCC_OK) return r;
  tcc_coll_desc_t theirs;
  memcpy(&theirs, slot + SLOT_DESC_AT, sizeof theirs);
  r = tcc__coll_desc_check_peer(comm, op->c, &op->mine, &theirs, j, err);
  if (r != TCC_OK) {
    char why[TCC_ERRLEN];
    snprintf(why, sizeof why, "%s", err->msg);
    tcc__err_reset(err);
    return tcc__coll_out_of_step(comm, err, "%s", why);
  }
  *part = place_of(slot, sp->slot_bytes(comm), op->slots);
  return TCC_OK;
}

/* Slot k of sender j's part is written (the first, k = 0, was waited
 * for with the descriptor). */
static tcc_result_t wait_piece(tcc_comm_t *comm, const slot_op_t *op, int j, const part_place_t *part, size_t k,
                               tcc_err_t *err) {
  if (k == 0) return TCC_OK;
  slot_watch_t w = {comm, comm->ops->spans, j, op->pos + k, false, part->slot + k * part->slot_bytes};
  return wait_for(comm, &w, part_arrived, op->c, op->seq, op->deadline, err);
}

/* Bytes [off, off + len) of sender j's part into dst, each slot's once
 * it is written. */
static tcc_result_t read_part(tcc_comm_t *comm, const slot_op_t *op, int j, const part_place_t *part, void *dst,
                              size_t off, size_t len, tcc_err_t *err) {
  char *to = dst;
  while (len) {
    tcc_result_t r = wait_piece(comm, op, j, part, off / part->piece, err);
    if (r != TCC_OK) return r;
    size_t run;
    const char *from = place_at(part, off, &run);
    if (run > len) run = len;
    tcc__copy(to, from, run);
    to += run;
    off += run;
    len -= run;
  }
  return TCC_OK;
}

/* A reduction of every sender's part with this rank's input, in rank
 * order as the one-shot reduction over the windows adds them: the same
 * bits either way. firsts[j]: sender j's first slot; a part over several
 * slots goes slot by slot, laid out alike by every sender. */
static tcc_result_t reduce_parts(tcc_comm_t *comm, const slot_op_t *op, const char *const *firsts,
                                 const part_place_t *like, tcc_err_t *err) {
  const tcc_coll_t *c = op->c;
  const int n = comm->size, me = comm->rank;
  const size_t size = tcc__dtype_size(c->dtype), bytes = c->count * size;
  const void **srcs = coll_scratch_of(comm)->srcs;
  for (size_t off = 0, k = 0; off < bytes; off += like->piece, k++) {
    for (int j = 0; j < n; j++) {
      if (j == me) {
        srcs[j] = (const char *)c->send + off;
        continue;
      }
      const part_place_t theirs = place_of((char *)firsts[j], like->slot_bytes, op->slots);
      tcc_result_t r = wait_piece(comm, op, j, &theirs, k, err);
      if (r != TCC_OK) return r;
      srcs[j] = firsts[j] + k * like->slot_bytes + like->at;
    }
    const size_t run = bytes - off < like->piece ? bytes - off : like->piece;
    tcc__reduce_n((char *)c->recv + off, srcs, n, run / size, c->dtype, c->redop, c->premul);
  }
  return TCC_OK;
}

static tcc_result_t receive(tcc_comm_t *comm, const slot_op_t *op, tcc_err_t *err) {
  const tcc_coll_t *c = op->c;
  const int n = comm->size, me = comm->rank, root = c->root;
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  part_place_t part;
  tcc_result_t r;
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
    case TCC_COLL_SCATTER: {
      r = take_part(comm, op, root, &part, err);
      if (r != TCC_OK) return r;
      const size_t index = c->kind == TCC_COLL_SCATTER ? (size_t)(me < root ? me : me - 1) : 0;
      return read_part(comm, op, root, &part, c->recv, index * bytes, bytes, err);
    }
    case TCC_COLL_GATHER:
      for (int j = 0; j < n; j++) {
        if (j == me) continue;
        r = take_part(comm, op, j, &part, err);
        if (r == TCC_OK) r = read_part(comm, op, j, &part, c->recvs[j], 0, bytes, err);
        if (r != TCC_OK) return r;
      }
      if (bytes && c->recvs[me] != c->send) tcc__move(c->recvs[me], c->send, bytes);
      return TCC_OK;
    case TCC_COLL_REDUCE: {
      const char **firsts = coll_scratch_of(comm)->part_src;
      for (int j = 0; j < n; j++) {
        if (j == me) continue;
        r = take_part(comm, op, j, &part, err);
        if (r != TCC_OK) return r;
        firsts[j] = part.slot;
      }
      return reduce_parts(comm, op, firsts, &part, err);
    }
    default:
      return TCC_OK;
  }
}

tcc_result_t tcc__coll_slots_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                 tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  const unsigned K = sp->slot_count(comm);
  slot_op_t op = {.c = c, .seq = seq, .deadline = deadline};
  op.slots = slots_for(part_bytes(c, comm->size), sp->slot_bytes(comm));
  const uint64_t before = sc->slot_pos;
  op.pos = before + 1;
  /* Slots that would wrap past the ring's end start the next lap. */
  if (op.slots > 1 && op.pos % K + op.slots > K) op.pos += K - op.pos % K;
  op.last = op.pos + op.slots - 1;
  sc->slot_pos = op.last;
  tcc__coll_desc_fill(c, seq, comm->size, &op.mine);
  sc->slot_digest = digest_add(sc->slot_digest, &op.mine);
  if (!sc->slot_first_seq) sc->slot_first_seq = seq;
  sc->slot_last_seq = seq;
  atomic_ullong *progress = sp->slot_progress(comm, comm->rank);
  tcc_result_t r = TCC_OK;
  if (sends(c, comm->rank)) r = send_part(comm, sc, &op, before, err);
  if (r != TCC_OK) return r;
  atomic_store_explicit(&progress[PROGRESS_ENTERED], op.last, memory_order_release);
  if (c->kind == TCC_COLL_SCATTER && comm->rank == c->root && c->count)
    tcc__move(c->recv, c->sends[comm->rank], c->count * tcc__dtype_size(c->dtype));
  if (!sends(c, comm->rank)) r = receive(comm, &op, err);
  if (r != TCC_OK) return r;
  atomic_store_explicit(&progress[PROGRESS_FINISHED], op.last, memory_order_release);
  sp->slot_wake(comm);
  /* A part over several slots is past what asking ahead is for. */
  if (op.slots == 1) prefetch_next_slot(comm, sp, c, op.last);
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
