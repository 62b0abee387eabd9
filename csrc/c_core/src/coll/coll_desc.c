/*
 * coll_desc.c - collective descriptors: what each rank publishes before a
 * collective so that all ranks can verify they agree on it.
 *
 * The check is deterministic over the same set of descriptors, so every
 * rank reaches the same verdict and a mismatch fails the op everywhere
 * without any data having moved (the communicator stays usable).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "core/mutation.h"
#include "core/copy.h"

tcc_result_t tcc__coll_out_of_step(tcc_comm_t *comm, tcc_err_t *err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char why[TCC_ERRLEN];
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  tcc__err_set(err, TCC_ERR_MISMATCH, "%s (the ranks are out of step: the communicator fails)", why);
  tcc__comm_fail(comm, TCC_ERR_MISMATCH, err->msg);
  return TCC_ERR_MISMATCH;
}

size_t tcc__coll_desc_bytes(tcc_coll_kind_t kind, int size) {
  size_t bytes = sizeof(tcc_coll_desc_t);
  if (kind == TCC_COLL_ALLTOALL) bytes += 2 * (size_t)size * sizeof(uint64_t);
  return bytes;
}

/* An all-to-all whose counts are all one number: every send and receive
 * count is the first. */
static bool even_counts(const tcc_coll_t *c, int size) {
  const size_t first = c->send_counts[0];
  for (int j = 0; j < size; j++)
    if (c->send_counts[j] != first || c->recv_counts[j] != first) return false;
  return true;
}

static void write_desc(const tcc_coll_t *c, uint64_t seq, int size, void *out, bool may_shorten) {
  tcc_coll_desc_t d;
  memset(&d, 0, sizeof d);
  d.seq = seq;
  d.kind = (uint8_t)c->kind;
  d.dtype = (uint8_t)c->dtype;
  /* Only reductions carry a meaningful reduce op. */
  int reduces = c->kind == TCC_COLL_ALLREDUCE || c->kind == TCC_COLL_REDUCE ||
                c->kind == TCC_COLL_REDUCE_SCATTER;
  d.redop = reduces ? (uint8_t)c->redop : 0;
  int rooted = c->kind == TCC_COLL_BROADCAST || c->kind == TCC_COLL_REDUCE ||
               c->kind == TCC_COLL_GATHER || c->kind == TCC_COLL_SCATTER;
  d.root = rooted ? c->root : -1;
  d.count = c->kind == TCC_COLL_ALLTOALL || c->kind == TCC_COLL_BARRIER ? 0 : c->count;
  const bool alltoall = c->kind == TCC_COLL_ALLTOALL;
  if (alltoall && may_shorten && even_counts(c, size)) {
    d.flags = TCC_DESC_EVEN_COUNTS;
    d.count = c->send_counts[0];
  }
  memcpy(out, &d, sizeof d);
  if (alltoall && !(d.flags & TCC_DESC_EVEN_COUNTS)) {
    uint64_t *counts = (uint64_t *)((char *)out + sizeof d);
    for (int j = 0; j < size; j++) {
      counts[j] = c->send_counts[j];
      counts[size + j] = c->recv_counts[j];
    }
  }
}

void tcc__coll_desc_fill(const tcc_coll_t *c, uint64_t seq, int size, void *out) {
  write_desc(c, seq, size, out, false);
}

void tcc__coll_desc_fill_short(const tcc_coll_t *c, uint64_t seq, int size, void *out) {
  write_desc(c, seq, size, out, true);
}

static const tcc_coll_desc_t *desc_at(const void *const *descs, int r) {
  return (const tcc_coll_desc_t *)descs[r];
}

bool tcc__coll_desc_has_tail(const void *desc) {
  const tcc_coll_desc_t *d = desc;
  return d->kind == TCC_COLL_ALLTOALL && !(d->flags & TCC_DESC_EVEN_COUNTS);
}

/* Entry i of an all-to-all descriptor's lists (sends to i, then expects
 * from i - size), in either form. */
static uint64_t listed_count(const void *desc, int i) {
  const tcc_coll_desc_t *d = desc;
  if (d->flags & TCC_DESC_EVEN_COUNTS) return d->count;
  uint64_t v;
  memcpy(&v, (const char *)desc + sizeof *d + (size_t)i * sizeof v, sizeof v);
  return v;
}

bool tcc__coll_desc_even(const void *desc, uint64_t *count) {
  const tcc_coll_desc_t *d = desc;
  *count = d->count;
  return d->kind == TCC_COLL_ALLTOALL && (d->flags & TCC_DESC_EVEN_COUNTS);
}

uint64_t tcc__coll_desc_sends(const void *desc, int to) { return listed_count(desc, to); }

uint64_t tcc__coll_desc_expects(const void *desc, int size, int from) { return listed_count(desc, size + from); }

/* The first pair (j, k), in row order, where what all-to-all descriptor j
 * sends to k is not what descriptor k expects from j; false when none.
 * When every descriptor is in the short form, pair (j, k) disagrees
 * exactly when the two counts differ, so the first is (0, k) for the first
 * count unlike rank 0's: n reads instead of n * n. */
static bool first_split_mismatch(const void *const *descs, int n, int *j_out, int *k_out) {
  uint64_t first;
  bool all_even = tcc__coll_desc_even(descs[0], &first);
  int unlike = -1;
  for (int r = 1; r < n && all_even; r++) {
    uint64_t count;
    all_even = tcc__coll_desc_even(descs[r], &count);
    if (all_even && count != first && unlike < 0) unlike = r;
  }
  if (all_even) {
    *j_out = 0;
    *k_out = unlike;
    return unlike >= 0;
  }
  for (int j = 0; j < n; j++) {
    for (int k = 0; k < n; k++) {
      if (tcc__coll_desc_sends(descs[j], k) != tcc__coll_desc_expects(descs[k], n, j)) {
        *j_out = j;
        *k_out = k;
        return true;
      }
    }
  }
  return false;
}

/* Descriptor d of rank r against ref of rank ref_rank: TCC_OK, or
 * TCC_ERR_MISMATCH naming the first field they differ in. An all-to-all's
 * per-pair counts are checked apart (first_split_mismatch). */
static tcc_result_t check_against(const tcc_comm_t *comm, const char *op, const tcc_coll_desc_t *ref, int ref_rank,
                                  const tcc_coll_desc_t *d, int r, tcc_err_t *err) {
  /* Equal heads agree in every field below: one comparison for the usual case. */
  if (memcmp(d, ref, sizeof *d) == 0) return TCC_OK;
  if (d->seq != ref->seq || d->kind != ref->kind) {
    return tcc__err_set(err, TCC_ERR_MISMATCH,
                       "tccomm %s on '%s' (rank %d): ranks issued different collectives: "
                       "rank %d issued %s #%llu, rank %d issued %s #%llu",
                       op, comm->name, tcc__self_label(comm), ref_rank, tcc__coll_name((tcc_coll_kind_t)ref->kind),
                       (unsigned long long)ref->seq, r,
                       tcc__coll_name((tcc_coll_kind_t)d->kind), (unsigned long long)d->seq);
  }
  if (d->dtype != ref->dtype) {
    return tcc__err_set(err, TCC_ERR_MISMATCH,
                       "tccomm %s on '%s' (rank %d): dtype mismatch: rank %d has %s, rank %d has %s",
                       op, comm->name, tcc__self_label(comm), ref_rank, tcc_dtype_name((tcc_dtype_t)ref->dtype), r,
                       tcc_dtype_name((tcc_dtype_t)d->dtype));
  }
  /* An all-to-all's counts are per pair (below); its count field is its
   * short form's, which ranks need not share. */
  if (d->count != ref->count && ref->kind != TCC_COLL_ALLTOALL) {
    return tcc__err_set(err, TCC_ERR_MISMATCH,
                       "tccomm %s on '%s' (rank %d): size mismatch: rank %d has %llu elements, "
                       "rank %d has %llu",
                       op, comm->name, tcc__self_label(comm), ref_rank, (unsigned long long)ref->count, r,
                       (unsigned long long)d->count);
  }
  if (d->redop != ref->redop) {
    return tcc__err_set(err, TCC_ERR_MISMATCH,
                       "tccomm %s on '%s' (rank %d): reduce op mismatch: rank %d uses %s, rank %d uses %s",
                       op, comm->name, tcc__self_label(comm), ref_rank, tcc_redop_name((tcc_redop_t)ref->redop), r,
                       tcc_redop_name((tcc_redop_t)d->redop));
  }
  if (d->root != ref->root) {
    return tcc__err_set(err, TCC_ERR_MISMATCH,
                       "tccomm %s on '%s' (rank %d): root mismatch: rank %d uses root %d, rank %d uses %d",
                       op, comm->name, tcc__self_label(comm), ref_rank, ref->root, r, d->root);
  }
  return TCC_OK;
}

tcc_result_t tcc__coll_desc_check_peer(const tcc_comm_t *comm, const tcc_coll_t *c, const tcc_coll_desc_t *mine,
                                      const tcc_coll_desc_t *theirs, int peer, tcc_err_t *err) {
  if (TCC_MUTANT(MISMATCH_UNCHECKED)) return TCC_OK; /* MUTATION SITE */
  return check_against(comm, tcc__coll_name(c->kind), mine, tcc__self_label(comm), theirs, peer, err);
}

tcc_result_t tcc__coll_desc_check(const tcc_comm_t *comm, const tcc_coll_t *c,
                                 const void *const *descs, tcc_err_t *err) {
  if (TCC_MUTANT(MISMATCH_UNCHECKED)) return TCC_OK; /* MUTATION SITE */
  const int n = comm->size;
  const char *op = tcc__coll_name(c->kind);
  /* Compare every rank against rank 0, in rank order, so the first
   * disagreement reported is the same everywhere. */
  const tcc_coll_desc_t *ref = desc_at(descs, 0);
  for (int r = 1; r < n; r++) {
    tcc_result_t bad = check_against(comm, op, ref, 0, desc_at(descs, r), r, err);
    if (bad != TCC_OK) return bad;
  }
  if (c->kind == TCC_COLL_ALLTOALL) {
    /* What j sends to k must be what k expects from j. */
    int j, k;
    if (!first_split_mismatch(descs, n, &j, &k)) return TCC_OK;
    return tcc__err_set(err, TCC_ERR_MISMATCH,
                       "tccomm %s on '%s' (rank %d): split size mismatch: rank %d sends %llu "
                       "elements to rank %d, which expects %llu",
                       op, comm->name, tcc__self_label(comm), j,
                       (unsigned long long)tcc__coll_desc_sends(descs[j], k), k,
                       (unsigned long long)tcc__coll_desc_expects(descs[k], n, j));
  }
  return TCC_OK;
}

/* ---- inputs that overlap outputs -------------------------------------- */

static bool overlap(const void *a, size_t alen, const void *b, size_t blen) {
  if (!alen || !blen || !a || !b) return false;
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return x < y + blen && y < x + alen;
}

/* Whether the address range spanned by all inputs meets the one spanned
 * by the outputs peers write; if not, no input can overlap an output. */
static bool alltoall_spans_meet(const tcc_coll_t *c, int n, int me, size_t es) {
  uintptr_t in_lo = UINTPTR_MAX, in_hi = 0, out_lo = UINTPTR_MAX, out_hi = 0;
  for (int j = 0; j < n; j++) {
    size_t in_len = c->send_counts[j] * es, out_len = c->recv_counts[j] * es;
    uintptr_t in = (uintptr_t)c->sends[j], out = (uintptr_t)c->recvs[j];
    if (in && in_len) {
      if (in < in_lo) in_lo = in;
      if (in + in_len > in_hi) in_hi = in + in_len;
    }
    if (j != me && out && out_len) {
      if (out < out_lo) out_lo = out;
      if (out + out_len > out_hi) out_hi = out + out_len;
    }
  }
  return in_lo < out_hi && out_lo < in_hi;
}

/* True when data arriving from peers (or a reduced chunk) could land on
 * input this rank still has to send. Exact in-place use (send == recv
 * for allreduce/reduce, recv == sends[me] for reduce-scatter) is safe by
 * construction: a peer only returns reduced bytes of a region after this
 * rank has sent its own contribution to that region. */
static bool inputs_need_copy(const tcc_coll_t *c, int n, int me, size_t es) {
  size_t bytes = c->count * es;
  switch (c->kind) {
  case TCC_COLL_GATHER:
    if (me != c->root) return false;
    /* fall through */
  case TCC_COLL_ALLGATHER:
    for (int j = 0; j < n; j++)
      if (j != me && overlap(c->send, bytes, c->recvs[j], bytes)) return true;
    return false;
  case TCC_COLL_ALLREDUCE:
  case TCC_COLL_REDUCE:
    if (c->kind == TCC_COLL_REDUCE && me != c->root) return false;
    return c->send != c->recv && overlap(c->send, bytes, c->recv, bytes);
  case TCC_COLL_REDUCE_SCATTER:
    for (int j = 0; j < n; j++)
      if (overlap(c->sends[j], bytes, c->recv, bytes) && !(j == me && c->sends[j] == c->recv))
        return true;
    return false;
  case TCC_COLL_ALLTOALL:
    if (!alltoall_spans_meet(c, n, me, es)) return false; /* the usual case, in O(n) */
    for (int i = 0; i < n; i++)
      for (int j = 0; j < n; j++)
        if (j != me && overlap(c->sends[i], c->send_counts[i] * es, c->recvs[j],
                               c->recv_counts[j] * es))
          return true;
    return false;
  default:
    return false;
  }
}

/* Points *staged at a private copy of the inputs of c (held in *mem). */
static bool copy_inputs(const tcc_coll_t *c, int n, size_t es, tcc_coll_t *staged,
                        void **mem) {
  *staged = *c;
  bool per_peer = c->kind == TCC_COLL_ALLTOALL || c->kind == TCC_COLL_REDUCE_SCATTER;
  if (!per_peer) {
    size_t bytes = c->count * es;
    *mem = malloc(bytes);
    if (!*mem) return false;
    tcc__copy(*mem, c->send, bytes);
    staged->send = *mem;
    return true;
  }
  size_t total = 0;
  for (int j = 0; j < n; j++)
    total += (c->kind == TCC_COLL_ALLTOALL ? c->send_counts[j] : c->count) * es;
  void **sends = malloc((size_t)n * sizeof(void *) + total);
  if (!sends) return false;
  uint8_t *p = (uint8_t *)(sends + n);
  for (int j = 0; j < n; j++) {
    size_t len = (c->kind == TCC_COLL_ALLTOALL ? c->send_counts[j] : c->count) * es;
    sends[j] = p;
    if (len) tcc__copy(p, c->sends[j], len);
    p += len;
  }
  *mem = sends;
  staged->sends = sends;
  return true;
}

const tcc_coll_t *tcc__coll_inputs_safe(const tcc_coll_t *c, int n, int me, tcc_coll_t *copy, void **mem) {
  const size_t es = tcc__dtype_size(c->dtype);
  *mem = NULL;
  if (!inputs_need_copy(c, n, me, es)) return c;
  return copy_inputs(c, n, es, copy, mem) ? copy : NULL;
}

bool tcc__coll_snapshot_inputs(const tcc_coll_t *c, int n, int me, tcc_coll_t *staged, void **mem) {
  const size_t es = tcc__dtype_size(c->dtype);
  *staged = *c;
  *mem = NULL;
  if (!inputs_need_copy(c, n, me, es)) return true;
  return copy_inputs(c, n, es, staged, mem);
}
