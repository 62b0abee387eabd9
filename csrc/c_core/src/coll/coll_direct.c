/*
 * coll_direct.c - single-copy data movement over staging spans whose
 * transport can reach into a peer's memory (tcc__spans_ops_t.peer_read,
 * peer_write).
 *
 * At the first stage of a movement op each rank publishes, after its
 * descriptor, a block saying where its stream's pieces lie in its own
 * memory, where the data it receives in a rooted op should go, and what
 * its transport offers (direct_bytes). After that barrier every rank sees
 * every block and makes the same choice: when every rank can reach all
 * peers and the longest stream reaches the size they agreed on, the bytes
 * move straight from the writers' buffers into the readers', and one more
 * barrier keeps every buffer alive until all copies are done. Otherwise
 * the op goes on through the windows (coll_staged.c).
 *
 * Each transfer is one copy, made by the reader, except in rooted ops,
 * where one side would idle while the other copies everything: there the
 * writer copies the tail of each transfer into the reader's buffer, sized
 * so both sides copy about as much (the root of a broadcast or scatter
 * 1/n of each transfer, each sender of a gather (n-1)/n of its own).
 *
 * A rank that expects the direct path (its own stream reaches its own
 * threshold) does not stage its first window; should the group fall back,
 * every rank sees that from the blocks and the first window is staged
 * again in one more stage.
 */
#include <string.h>

#include "coll/coll_scratch.h"

typedef struct direct_piece {
  uint64_t addr, len;
} direct_piece_t;

typedef struct direct_block {
  uint64_t direct_bytes; /* the publisher's verdict: SIZE_MAX, or the size from which it moves directly */
  uint64_t stream_len;   /* bytes of its stream */
  uint32_t npieces;
  uint32_t reserved;
  direct_piece_t pieces[]; /* [size], then uint64_t dests[size]: where data from rank j goes (rooted ops) */
} direct_block_t;

size_t tcc__coll_spans_desc_bytes(int size) {
  return tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, size) + sizeof(direct_block_t) +
         (size_t)size * (sizeof(direct_piece_t) + sizeof(uint64_t));
}

/* The block sits after the largest descriptor, so its place does not
 * depend on the op. */
static direct_block_t *block_in(char *desc_span, int size) {
  return (direct_block_t *)(desc_span + tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, size));
}

static uint64_t *dests_of(direct_block_t *b, int size) { return (uint64_t *)(b->pieces + size); }

/* Whether a stream of `longest` bytes may move directly at all: below the
 * group's agreed size no rank's verdict allows it. */
static bool direct_possible(tcc_comm_t *comm, size_t longest) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  return sp->peer_read && sp->peer_write && longest >= sp->direct_agreed_bytes(comm);
}

static bool skips_first_window(const direct_block_t *b) {
  return b->stream_len > 0 && b->stream_len >= b->direct_bytes;
}

bool tcc__direct_publish(tcc_comm_t *comm, const tcc_coll_t *c, char *desc_span, const coll_piece_t *pieces, int np,
                         size_t stream_len, size_t longest_bound) {
  /* Small ops leave the block alone: its lines then stay in this rank's
   * cache instead of crossing to every peer and back. */
  if (!direct_possible(comm, longest_bound)) return true;
  const tcc__spans_ops_t *sp = comm->ops->spans;
  const int n = comm->size, me = comm->rank;
  direct_block_t *b = block_in(desc_span, n);
  b->direct_bytes = sp->peer_read && sp->peer_write ? sp->direct_bytes(comm) : SIZE_MAX;
  b->stream_len = stream_len;
  b->npieces = (uint32_t)np;
  b->reserved = 0;
  for (int i = 0; i < np; i++) b->pieces[i] = (direct_piece_t){(uint64_t)(uintptr_t)pieces[i].ptr, pieces[i].len};
  uint64_t *dests = dests_of(b, n);
  const int root = c->root;
  if ((c->kind == TCC_COLL_BROADCAST || c->kind == TCC_COLL_SCATTER) && me != root)
    dests[root] = (uint64_t)(uintptr_t)c->recv;
  if (c->kind == TCC_COLL_GATHER && me == root)
    for (int j = 0; j < n; j++) dests[j] = (uint64_t)(uintptr_t)c->recvs[j];
  return !skips_first_window(b);
}

tcc__direct_plan_t tcc__direct_choose(tcc_comm_t *comm, const void *const *descs, size_t longest) {
  if (!direct_possible(comm, longest)) return TCC__DIRECT_NONE; /* no rank published nor skipped */
  bool every_rank_reads = true, someone_skipped = false;
  for (int j = 0; j < comm->size; j++) {
    const direct_block_t *b = block_in((char *)descs[j], comm->size);
    if (longest < b->direct_bytes) every_rank_reads = false;
    if (skips_first_window(b)) someone_skipped = true;
  }
  if (every_rank_reads) return TCC__DIRECT_READS;
  return someone_skipped ? TCC__DIRECT_RESTAGE : TCC__DIRECT_NONE;
}

/* The tail of a transfer of `len` bytes that its writer copies. */
static size_t writer_share(const tcc_coll_t *c, int n, size_t len) {
  size_t share;
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
    case TCC_COLL_SCATTER: share = len / (size_t)n; break;
    case TCC_COLL_GATHER: share = len - len / (size_t)n; break;
    default: return 0;
  }
  return share / 4096 * 4096; /* whole pages each side */
}

/* Moves bytes [off, off + len) of the stream that block b lists, piece by
 * piece, between those pieces and the contiguous range at `other`: from
 * peer j's pieces into this rank's memory at `other` (b is j's block), or
 * from this rank's own pieces to peer j's memory at `other` (b is this
 * rank's block). */
static tcc_result_t move_range(tcc_comm_t *comm, int j, const direct_block_t *b, size_t off, size_t len,
                               uint64_t other, bool write, const char *what, uint64_t seq, tcc_err_t *err) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  const uint32_t np = b->npieces < (uint32_t)comm->size ? b->npieces : (uint32_t)comm->size;
  size_t base = 0;
  for (uint32_t i = 0; i < np && len > 0; i++) {
    const size_t end = base + b->pieces[i].len;
    if (off < end) {
      const size_t in_piece = off - base;
      const size_t k = len < b->pieces[i].len - in_piece ? len : b->pieces[i].len - in_piece;
      const uint64_t at = b->pieces[i].addr + in_piece;
      tcc_result_t r = write ? sp->peer_write(comm, j, (const void *)(uintptr_t)at, other, k, what, seq, err)
                             : sp->peer_read(comm, j, (void *)(uintptr_t)other, at, k, what, seq, err);
      if (r != TCC_OK) return r;
      other += k;
      off += k;
      len -= k;
    }
    base = end;
  }
  return TCC_OK;
}

tcc_result_t tcc__direct_move(tcc_comm_t *comm, const tcc_coll_t *c, const void *const *descs,
                              const coll_read_t *reads, const coll_read_t *writes, uint64_t seq, int64_t deadline,
                              tcc_err_t *err) {
  const int n = comm->size, me = comm->rank;
  const char *what = tcc__coll_name(c->kind);
  direct_block_t *mine = block_in((char *)descs[me], n);
  for (int k = 1; k < n; k++) {
    /* Each rank starts with its next peer, so the copies spread over the peers. */
    const int j = (me + k) % n;
    direct_block_t *theirs = block_in((char *)descs[j], n);
    const coll_read_t *rd = &reads[j];
    if (rd->len > 0) {
      const size_t head = rd->len - writer_share(c, n, rd->len);
      tcc_result_t r = move_range(comm, j, theirs, rd->off, head, (uint64_t)(uintptr_t)rd->dst, false, what, seq, err);
      if (r != TCC_OK) return r;
    }
    const coll_read_t *wr = &writes[j];
    const size_t tail = writer_share(c, n, wr->len);
    if (tail > 0) {
      const size_t head = wr->len - tail;
      const uint64_t dest = dests_of(theirs, n)[me] + head;
      tcc_result_t r = move_range(comm, j, mine, wr->off + head, tail, dest, true, what, seq, err);
      if (r != TCC_OK) return r;
    }
  }
  /* Every buffer must outlive every copy into or out of it. */
  return comm->ops->spans->barrier(comm, deadline, what, seq, err);
}

bool tcc__direct_expected(tcc_comm_t *comm, const tcc_coll_t *c) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  if (!sp->peer_read || !sp->peer_write) return false;
  const size_t es = tcc__dtype_size(c->dtype);
  size_t longest = c->count * es;
  if (c->kind == TCC_COLL_SCATTER) longest *= (size_t)(comm->size - 1);
  if (c->kind == TCC_COLL_ALLTOALL) { /* this rank's own stream: the others' are not known here */
    longest = 0;
    for (int k = 0; k < comm->size; k++)
      if (k != comm->rank) longest += c->send_counts[k] * es;
  }
  return longest >= sp->direct_bytes(comm);
}
