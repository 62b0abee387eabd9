/*
 * coll_staged.c - collectives over shared staging spans (the transport's
 * tcc__spans_ops_t; see transport.h for the stage rule).
 *
 * Every collective's first stage carries this rank's descriptor and the
 * first window of its data; after that barrier all ranks check the
 * descriptors and reach the same verdict before anyone reads peer data.
 *
 * Data movement (broadcast, gathers, scatter, all-to-all): each rank
 * stages a "stream" (the bytes others need from it) window by window;
 * readers copy the part of each window that is theirs. Where every rank
 * can read its peers' memory, large ones instead read it in place, one
 * copy (coll_direct.c).
 *
 * Reductions: each stage every rank stages one slot per destination part;
 * rank i reduces part i from all ranks' slots in rank order (bit-identical
 * everywhere) and, unless it only needs its own part (reduce-scatter),
 * publishes it in its result window for the others to copy in the next
 * stage. Small reductions go one-shot: every rank reduces everything.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/coll_scratch.h"
#include "core/copy.h"

/* One collective's view of the spans and of the scratch. */
typedef struct staged {
  tcc_comm_t *comm;
  const tcc__spans_ops_t *sp;
  size_t window;      /* bytes per window */
  size_t small_bytes; /* reductions up to this size go one-shot */
  tcc__coll_scratch_t *sc;
} staged_t;

static char *desc_of(staged_t *st, int r, int parity) { return st->sp->desc(st->comm, r, parity); }
static char *in_of(staged_t *st, int r, int parity) { return st->sp->input(st->comm, r, parity); }
static char *res_of(staged_t *st, int r, int parity) { return st->sp->result(st->comm, r, parity); }
static int next_parity(staged_t *st) { return st->sp->next_parity(st->comm); }
static tcc_result_t stage_barrier(staged_t *st, int64_t deadline, const char *what, uint64_t seq, tcc_err_t *err) {
  return st->sp->barrier(st->comm, deadline, what, seq, err);
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

static void copy_bytes(char *dst, const char *src, size_t len) {
  tcc__move(dst, src, len);
}

/* Copies bytes [from, from+len) of the concatenated pieces into dst. */
static void copy_stream(char *dst, const coll_piece_t *pieces, int np, size_t from, size_t len) {
  size_t base = 0;
  for (int i = 0; i < np && len > 0; i++) {
    size_t end = base + pieces[i].len;
    if (from < end) {
      size_t off = from - base;
      size_t n = min_sz(len, pieces[i].len - off);
      tcc__copy(dst, pieces[i].ptr + off, n);
      dst += n;
      from += n;
      len -= n;
    }
    base = end;
  }
}

/* The first stage's barrier and the agreement check. */
static tcc_result_t first_stage_sync(tcc_comm_t *comm, staged_t *st, const tcc_coll_t *c, int parity,
                                     uint64_t seq, int64_t deadline, tcc_err_t *err) {
  /* Without slot-ring ops here (no rings, or a view, or one rank) every
   * rank's digest stays the same: nothing to publish or compare. */
  const bool slots = st->sc->slot_part_max > 0;
  if (slots) tcc__coll_slots_publish(comm, parity);
  tcc_result_t r = stage_barrier(st, deadline, tcc__coll_name(c->kind), seq, err);
  if (r != TCC_OK) return r;
  /* The small rooted ops before this one first: a disagreement there
   * fails the communicator, whatever this op's descriptors say. */
  if (slots && (r = tcc__coll_slots_verify(comm, c, seq, parity, err)) != TCC_OK) return r;
  for (int j = 0; j < comm->size; j++) st->sc->descs[j] = desc_of(st, j, parity);
  return tcc__coll_desc_check(comm, c, st->sc->descs, err);
}

/* Right after a barrier: the spans the next op will likely write, taken
 * back from the peers ahead of it (see tcc__spans_ops_t.prefetch_writes).
 * Ops in a loop tend to be alike, so this op's `input_bytes` (what it
 * staged in its input span) is the guess. */
static void prefetch_next_op(staged_t *st, size_t input_bytes) {
  st->sp->prefetch_writes(st->comm, next_parity(st), input_bytes);
}

/* ---- data movement ---------------------------------------------------- */

/* This rank's stream: what the others read from it. */
static int build_stream(tcc_comm_t *comm, const tcc_coll_t *c, size_t es, coll_piece_t *pieces) {
  const int n = comm->size, me = comm->rank;
  const size_t bytes = c->count * es;
  int np = 0;
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
      if (me == c->root) pieces[np++] = (coll_piece_t){c->send, bytes};
      break;
    case TCC_COLL_ALLGATHER:
      pieces[np++] = (coll_piece_t){c->send, bytes};
      break;
    case TCC_COLL_GATHER:
      if (me != c->root) pieces[np++] = (coll_piece_t){c->send, bytes};
      break;
    case TCC_COLL_SCATTER:
      if (me == c->root)
        for (int k = 0; k < n; k++)
          if (k != me) pieces[np++] = (coll_piece_t){c->sends[k], bytes};
      break;
    case TCC_COLL_ALLTOALL:
      for (int k = 0; k < n; k++)
        if (k != me) pieces[np++] = (coll_piece_t){c->sends[k], c->send_counts[k] * es};
      break;
    default:
      break;
  }
  return np;
}

/* Length of rank j's stream, and what rank `me` reads from it; from the
 * (already checked) descriptors so it is known for every pair. The
 * destination is this rank's own buffer when me is this rank, else NULL
 * (single-copy writes find it in the reader's published block). */
static size_t plan_read(tcc_comm_t *comm, staged_t *st, const tcc_coll_t *c, size_t es, int me, int j,
                        coll_read_t *rd) {
  const int n = comm->size, root = c->root;
  const bool mine = me == comm->rank;
  const size_t bytes = c->count * es;
  *rd = (coll_read_t){0, 0, NULL, 0};
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
      if (me != root && j == root) *rd = (coll_read_t){0, bytes, mine ? c->recv : NULL, 0};
      return j == root ? bytes : 0;
    case TCC_COLL_ALLGATHER:
      if (j != me) *rd = (coll_read_t){0, bytes, mine ? c->recvs[j] : NULL, 0};
      return bytes;
    case TCC_COLL_GATHER:
      if (me == root && j != root) *rd = (coll_read_t){0, bytes, mine ? c->recvs[j] : NULL, 0};
      return j == root ? 0 : bytes;
    case TCC_COLL_SCATTER:
      if (me != root && j == root) {
        size_t index = (size_t)(me < root ? me : me - 1);
        *rd = (coll_read_t){index * bytes, bytes, mine ? c->recv : NULL, 0};
      }
      return j == root ? (size_t)(n - 1) * bytes : 0;
    case TCC_COLL_ALLTOALL: {
      const void *desc = st->sc->descs[j];
      uint64_t even;
      if (tcc__coll_desc_even(desc, &even)) { /* every block of j's stream is `even` elements */
        const size_t block = (size_t)even * es;
        const size_t before = (size_t)(me - (j < me)); /* j's blocks for ranks below me */
        if (j != me) *rd = (coll_read_t){before * block, block, mine ? c->recvs[j] : NULL, 0};
        return (size_t)(n - 1) * block;
      }
      size_t total = 0, off = 0;
      for (int k = 0; k < n; k++) {
        if (k == j) continue;
        const size_t len = tcc__coll_desc_sends(desc, k) * es;
        if (k < me) off += len;
        total += len;
      }
      if (j != me) *rd = (coll_read_t){off, tcc__coll_desc_sends(desc, me) * es, mine ? c->recvs[j] : NULL, 0};
      return total;
    }
    default:
      return 0;
  }
}

/* At least the longest stream of any rank, as this rank's own arguments
 * tell it before the descriptors are checked (they hold if the ranks
 * agree; if not, no data moves). An all-to-all's peers' counts are not
 * known here. */
static size_t stream_bound(tcc_comm_t *comm, const tcc_coll_t *c, size_t es) {
  const size_t bytes = c->count * es;
  switch (c->kind) {
    case TCC_COLL_ALLTOALL: return SIZE_MAX;
    case TCC_COLL_SCATTER: return (size_t)(comm->size - 1) * bytes;
    default: return bytes;
  }
}

/* Where rank r stages the first window of its stream of `len` bytes: a
 * stream that fits right after the descriptor goes there, and reaches the
 * peers with it (see one_shot_in). Not where an all-to-all's count lists
 * are (its descriptor's short form leaves the place free), nor where the
 * single-copy block would overlap it (one rank: nobody reads anyway).
 * Every rank decides alike, from rank r's descriptor and the checked
 * lengths. */
static char *stream_span(staged_t *st, int r, int parity, size_t len) {
  const size_t inline_from = sizeof(tcc_coll_desc_t);
  char *desc = desc_of(st, r, parity);
  if (len <= st->sp->desc_inline_bytes && !tcc__coll_desc_has_tail(desc) &&
      inline_from + st->sp->desc_inline_bytes <= tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, st->comm->size))
    return desc + inline_from;
  return in_of(st, r, parity);
}

/* Copies this rank's own contribution where the result needs it. */
static void copy_local(tcc_comm_t *comm, const tcc_coll_t *c, size_t es) {
  const int me = comm->rank;
  const size_t bytes = c->count * es;
  switch (c->kind) {
    case TCC_COLL_ALLGATHER: copy_bytes(c->recvs[me], c->send, bytes); break;
    case TCC_COLL_GATHER:
      if (me == c->root) copy_bytes(c->recvs[me], c->send, bytes);
      break;
    case TCC_COLL_SCATTER:
      if (me == c->root) copy_bytes(c->recv, c->sends[me], bytes);
      break;
    case TCC_COLL_ALLTOALL: copy_bytes(c->recvs[me], c->sends[me], c->send_counts[me] * es); break;
    default: break;
  }
}

static tcc_result_t run_movement(tcc_comm_t *comm, staged_t *st, const tcc_coll_t *c, uint64_t seq,
                                 int64_t deadline, tcc_err_t *err) {
  const int n = comm->size, me = comm->rank;
  const size_t es = tcc__dtype_size(c->dtype), W = st->window;
  const int np = build_stream(comm, c, es, st->sc->pieces);
  size_t my_len = 0;
  for (int i = 0; i < np; i++) my_len += st->sc->pieces[i].len;

  int parity = next_parity(st);
  char *desc = desc_of(st, me, parity);
  tcc__coll_desc_fill_short(c, seq, n, desc);
  size_t staged_in = 0; /* bytes of the input span written */
  if (tcc__direct_publish(comm, c, desc, st->sc->pieces, np, my_len, stream_bound(comm, c, es))) {
    char *span = stream_span(st, me, parity, my_len);
    copy_stream(span, st->sc->pieces, np, 0, min_sz(my_len, W));
    if (span == in_of(st, me, parity)) staged_in = min_sz(my_len, W);
  }
  tcc_result_t r = first_stage_sync(comm, st, c, parity, seq, deadline, err);
  if (r != TCC_OK) return r;
  prefetch_next_op(st, staged_in);

  size_t longest = 0;
  for (int j = 0; j < n; j++) {
    size_t len = plan_read(comm, st, c, es, me, j, &st->sc->reads[j]);
    st->sc->reads[j].stream = len;
    if (len > longest) longest = len;
  }
  copy_local(comm, c, es);
  const tcc__direct_plan_t plan = tcc__direct_choose(comm, st->sc->descs, longest);
  if (plan == TCC__DIRECT_READS) {
    /* What every peer reads from this rank: a share of it this rank writes. */
    for (int r = 0; r < n; r++) plan_read(comm, st, c, es, r, me, &st->sc->writes[r]);
    return tcc__direct_move(comm, c, st->sc->descs, st->sc->reads, st->sc->writes, seq, deadline, err);
  }

  for (size_t lo = 0; lo < longest; lo += W) {
    if (lo > 0 || plan == TCC__DIRECT_RESTAGE) {
      parity = next_parity(st);
      if (my_len > lo) copy_stream(in_of(st, me, parity), st->sc->pieces, np, lo, min_sz(my_len - lo, W));
      r = stage_barrier(st, deadline, tcc__coll_name(c->kind), seq, err);
      if (r != TCC_OK) return r;
    }
    const size_t hi = lo + W;
    for (int j = 0; j < n; j++) {
      const coll_read_t *rd = &st->sc->reads[j];
      size_t a = rd->off > lo ? rd->off : lo;
      size_t b = min_sz(rd->off + rd->len, hi);
      if (rd->len == 0 || a >= b) continue;
      /* Only the first stage's staging may have gone after the descriptor. */
      const char *from = lo == 0 && plan == TCC__DIRECT_NONE ? stream_span(st, j, parity, rd->stream)
                                                             : in_of(st, j, parity);
      tcc__copy(rd->dst + (a - rd->off), from + (a - lo), b - a);
    }
  }
  return TCC_OK;
}

/* ---- reductions ------------------------------------------------------- */

/* Where rank r's input of a one-shot reduction of `bytes` is staged: right
 * after its descriptor when it fits there (it then reaches the peers with
 * the descriptor), else its input span. Every rank decides alike: the
 * peers' inputs are read only after the check found the sizes equal. */
static char *one_shot_in(staged_t *st, int r, int parity, size_t bytes) {
  if (bytes <= st->sp->desc_inline_bytes) return desc_of(st, r, parity) + sizeof(tcc_coll_desc_t);
  return in_of(st, r, parity);
}

/* Every rank reduces the whole vector from all inputs: one barrier. */
static tcc_result_t reduce_one_shot(tcc_comm_t *comm, staged_t *st, const tcc_coll_t *c, uint64_t seq,
                                    int64_t deadline, tcc_err_t *err) {
  const int n = comm->size, me = comm->rank;
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  const int parity = next_parity(st);
  tcc__coll_desc_fill(c, seq, n, desc_of(st, me, parity));
  /* An empty tensor may have no data pointer. */
  char *in = one_shot_in(st, me, parity, bytes);
  if (bytes) tcc__copy(in, c->send, bytes);
  tcc_result_t r = first_stage_sync(comm, st, c, parity, seq, deadline, err);
  if (r != TCC_OK) return r;
  prefetch_next_op(st, in == in_of(st, me, parity) ? bytes : 0);
  if (c->kind == TCC_COLL_ALLREDUCE || me == c->root) {
    /* The descriptors' places are known since the check (descs[]). */
    const bool inline_data = bytes <= st->sp->desc_inline_bytes;
    for (int j = 0; j < n; j++)
      st->sc->srcs[j] = inline_data ? (const char *)st->sc->descs[j] + sizeof(tcc_coll_desc_t) : in_of(st, j, parity);
    tcc__reduce_n(c->recv, st->sc->srcs, n, c->count, c->dtype, c->redop, c->premul);
  }
  return TCC_OK;
}

/* The vector split in `size` parts; part j is reduced by rank j. */
typedef struct parts {
  const char **src; /* part j of this rank's input */
  char **out;       /* where reduced part j goes here (NULL: not needed) */
  size_t *len;      /* elements of part j (equal on every rank) */
  int direct;       /* only out[rank] is needed: reduce straight into it */
} parts_t;

/* Elements reduced per piece by reduce_and_publish: 8 KiB of float32, so
 * a piece is still in L1 when it is copied. */
#define PUBLISH_PIECE 2048

/* Reduces `count` elements into the result window `res` for the peers
 * and, where this rank needs its own part (out != NULL), into its output
 * too: piece by piece, each copied out while it is in L1 (srcs advance).
 * Copying the whole part from the window a stage later read it back from
 * L2 or memory: at 2 ranks a third of all bytes copied. */
static void reduce_and_publish(char *res, char *out, const void **srcs, int n, size_t count,
                               const tcc_coll_t *c) {
  const size_t es = tcc__dtype_size(c->dtype);
  if (!out) {
    tcc__reduce_n(res, srcs, n, count, c->dtype, c->redop, c->premul);
    return;
  }
  for (size_t k = 0; k < count; k += PUBLISH_PIECE) {
    const size_t len = min_sz(PUBLISH_PIECE, count - k);
    tcc__reduce_n(res + k * es, srcs, n, len, c->dtype, c->redop, c->premul);
    tcc__copy(out + k * es, res + k * es, len * es);
    for (int j = 0; j < n; j++) srcs[j] = (const char *)srcs[j] + len * es; /* the next piece */
  }
}

static tcc_result_t reduce_pipelined(tcc_comm_t *comm, staged_t *st, const tcc_coll_t *c,
                                     const parts_t *pt, uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const int n = comm->size, me = comm->rank;
  const size_t es = tcc__dtype_size(c->dtype);
  const size_t slot = st->window / (size_t)n / TCC_CACHELINE * TCC_CACHELINE;
  const size_t w = slot / es; /* elements of each part per stage */
  size_t longest = 0;
  for (int j = 0; j < n; j++) longest = pt->len[j] > longest ? pt->len[j] : longest;
  const size_t T = (longest + w - 1) / w; /* stages that carry input */
  const size_t stages = T == 0 ? 1 : pt->direct ? T : T + 1;

  for (size_t t = 0; t < stages; t++) {
    const int parity = next_parity(st);
    if (t == 0) tcc__coll_desc_fill(c, seq, n, desc_of(st, me, parity));
    if (t < T) {
      char *in = in_of(st, me, parity);
      for (int j = 0; j < n; j++) {
        size_t k0 = t * w;
        /* Our own part is reduced straight from our input: not staged. */
        if (j != me && k0 < pt->len[j])
          tcc__copy(in + (size_t)j * slot, pt->src[j] + k0 * es, min_sz(w, pt->len[j] - k0) * es);
      }
    }
    tcc_result_t r = t == 0 ? first_stage_sync(comm, st, c, parity, seq, deadline, err)
                            : stage_barrier(st, deadline, tcc__coll_name(c->kind), seq, err);
    if (r != TCC_OK) return r;
    if (!pt->direct && t >= 1) {
      /* The peers' results of stage t-1, published in this stage's parity
       * (this rank's own went to its output as it was reduced). */
      size_t k0 = (t - 1) * w;
      for (int j = 0; j < n; j++) {
        if (j == me || !pt->out[j] || k0 >= pt->len[j]) continue;
        tcc__copy(pt->out[j] + k0 * es, res_of(st, j, parity), min_sz(w, pt->len[j] - k0) * es);
      }
    }
    if (t < T && t * w < pt->len[me]) {
      size_t k0 = t * w;
      for (int j = 0; j < n; j++) st->sc->srcs[j] = in_of(st, j, parity) + (size_t)me * slot;
      st->sc->srcs[me] = pt->src[me] + k0 * es;
      const size_t count = min_sz(w, pt->len[me] - k0);
      if (pt->direct)
        tcc__reduce_n(pt->out[me] + k0 * es, st->sc->srcs, n, count, c->dtype, c->redop, c->premul);
      else
        reduce_and_publish(res_of(st, me, parity ^ 1), pt->out[me] ? pt->out[me] + k0 * es : NULL, st->sc->srcs,
                           n, count, c);
    }
  }
  return TCC_OK;
}

bool tcc__coll_staged_one_shot(tcc_coll_kind_t kind, size_t bytes, size_t small_bytes) {
  return kind != TCC_COLL_REDUCE_SCATTER && bytes <= small_bytes;
}

static tcc_result_t run_reduction(tcc_comm_t *comm, staged_t *st, const tcc_coll_t *c, uint64_t seq,
                                  int64_t deadline, tcc_err_t *err) {
  const int n = comm->size, me = comm->rank;
  const size_t es = tcc__dtype_size(c->dtype);
  if (tcc__coll_staged_one_shot(c->kind, c->count * es, st->small_bytes))
    return reduce_one_shot(comm, st, c, seq, deadline, err);

  parts_t pt = {st->sc->part_src, st->sc->part_out, st->sc->part_len, c->kind == TCC_COLL_REDUCE_SCATTER};
  if (c->kind == TCC_COLL_REDUCE_SCATTER) {
    for (int j = 0; j < n; j++) {
      pt.src[j] = c->sends[j];
      pt.len[j] = c->count;
      pt.out[j] = j == me ? c->recv : NULL;
    }
  } else {
    const int wants = c->kind == TCC_COLL_ALLREDUCE || me == c->root;
    const size_t q = c->count / (size_t)n, rem = c->count % (size_t)n;
    size_t start = 0;
    for (int j = 0; j < n; j++) {
      pt.len[j] = q + ((size_t)j < rem ? 1 : 0);
      pt.src[j] = (const char *)c->send + start * es;
      pt.out[j] = wants ? (char *)c->recv + start * es : NULL;
      start += pt.len[j];
    }
  }
  return reduce_pipelined(comm, st, c, &pt, seq, deadline, err);
}

tcc_result_t tcc__coll_staged_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                  tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  tcc_coll_t copy;
  void *snapshot;
  const tcc_coll_t *staged = tcc__coll_inputs_safe(c, comm->size, comm->rank, &copy, &snapshot);
  if (!staged)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): out of memory",
                       tcc__coll_name(c->kind), comm->name, tcc__self_label(comm));
  tcc_result_t r;
  if (tcc__coll_slots_fit(comm, staged)) {
    r = tcc__coll_slots_run(comm, staged, seq, deadline_ns, err);
    if (snapshot) free(snapshot); /* rarely: overlapping inputs only */
    return r;
  }
  /* After the slot rings' look: a small rooted op needs none of it. */
  staged_t view = {comm, sp, sp->window_bytes(comm), sp->one_shot_bytes(comm), coll_scratch_of(comm)};
  staged_t *st = &view;
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE:
    case TCC_COLL_REDUCE:
    case TCC_COLL_REDUCE_SCATTER:
      r = run_reduction(comm, st, staged, seq, deadline_ns, err);
      break;
    default:
      r = run_movement(comm, st, staged, seq, deadline_ns, err);
      break;
  }
  if (snapshot) free(snapshot); /* rarely: overlapping inputs only */
  return r;
}
