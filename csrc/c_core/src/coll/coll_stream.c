/*
 * coll_stream.c - collectives over byte streams between every pair of
 * ranks (the transport's tcc__stream_ops_t; TCP's full mesh).
 *
 * Every collective starts with a descriptor exchange: each rank sends its
 * descriptor to every other rank, so all ranks hold the same n descriptors
 * and reach the same verdict in tcc__coll_desc_check. On a mismatch nothing
 * else is sent and the streams stay aligned for the next collective.
 *
 * Data then moves directly between the ranks that need it. Reductions are
 * a reduce-scatter by direct exchange (rank j reduces chunk j over all n
 * contributions in rank order) followed by an all-gather (allreduce) or a
 * gather to the root (reduce) of the reduced chunks, pipelined in segments
 * so every element is reduced by exactly one rank and every rank ends up
 * with the same bits.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/stream_xfer.h"
#include "core/copy.h"

#define DESC_MAGIC 0x54434344u

/* The fixed first part of a descriptor message; for kinds whose
 * descriptor is longer (all-to-all counts) the rest follows separately,
 * so a receiver always knows how much to read even when the ranks
 * disagree on the kind. */
typedef struct desc_frame {
  uint32_t magic;
  uint32_t len; /* bytes of the whole descriptor */
  uint8_t head[sizeof(tcc_coll_desc_t)];
} desc_frame_t;

static size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

static void reset_links(stream_xfer_t *x) {
  memset(x->links, 0, (size_t)x->comm->size * sizeof(*x->links));
  memset(&x->red, 0, sizeof(x->red));
}

static tcc_result_t fail_nomem(const stream_xfer_t *x, tcc_err_t *err) {
  char pre[160];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
}

/* ---- descriptor exchange ---------------------------------------------- */

/* Receives every peer's frame, checks it is one, then the descriptor
 * tails. descs[j] gets a zero-padded buffer at least as long as this
 * rank's own descriptor, so the check may compare field by field. An
 * all-to-all's accepted counts go into send_matrix when it is not NULL. */
static tcc_result_t exchange_descs(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline,
                                   uint64_t *send_matrix, tcc_err_t *err) {
  int n = x->comm->size, me = x->comm->rank;
  const size_t head = sizeof(tcc_coll_desc_t);
  size_t mine_len = tcc__coll_desc_bytes(c->kind, n);
  size_t mine_cap = max_size(mine_len, head);
  tcc_result_t r = TCC_OK;
  uint8_t *mine = calloc(1, mine_cap), *block = NULL;
  desc_frame_t *frames = calloc((size_t)n, sizeof(*frames));
  const void **descs = calloc((size_t)n, sizeof(*descs));
  if (!mine || !frames || !descs) {
    r = fail_nomem(x, err);
    goto out;
  }
  tcc__coll_desc_fill(c, x->seq, n, mine);
  frames[me].magic = DESC_MAGIC;
  frames[me].len = (uint32_t)mine_len;
  memcpy(frames[me].head, mine, head);

  x->phase = "descriptor exchange";
  reset_links(x);
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    x->links[j] = (stream_link_t){.out_ptr = (const uint8_t *)&frames[me],
                               .out_raw = sizeof(desc_frame_t),
                               .in_ptr = (uint8_t *)&frames[j],
                               .in_raw = sizeof(desc_frame_t)};
  }
  if ((r = tcc__stream_xfer_run(x, deadline, err)) != TCC_OK) goto out;

  size_t total = 0;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    if (frames[j].magic != DESC_MAGIC || frames[j].len > tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, n)) {
      char pre[160];
      tcc__stream_xfer_prefix(x, pre, sizeof(pre));
      r = tcc__err_set(err, TCC_ERR_REMOTE,
                      "%s: rank %d sent a malformed descriptor (the streams are out "
                      "of step)", pre, j);
      goto out;
    }
    total += max_size(frames[j].len, mine_cap);
  }
  block = calloc(1, total ? total : 1);
  if (!block) {
    r = fail_nomem(x, err);
    goto out;
  }
  reset_links(x);
  uint8_t *p = block;
  for (int j = 0; j < n; j++) {
    if (j == me) {
      descs[j] = mine;
      continue;
    }
    memcpy(p, frames[j].head, head);
    descs[j] = p;
    x->links[j] = (stream_link_t){.out_ptr = mine + head,
                               .out_raw = mine_len > head ? mine_len - head : 0,
                               .in_ptr = p + head,
                               .in_raw = frames[j].len > head ? frames[j].len - head : 0};
    p += max_size(frames[j].len, mine_cap);
  }
  if ((r = tcc__stream_xfer_run(x, deadline, err)) != TCC_OK) goto out;
  r = tcc__coll_desc_check(x->comm, c, descs, err);
  if (r == TCC_OK && send_matrix && c->kind == TCC_COLL_ALLTOALL)
    for (int j = 0; j < n; j++) /* each rank's send counts follow its descriptor's head */
      memcpy(send_matrix + (size_t)j * (size_t)n, (const uint8_t *)descs[j] + head, (size_t)n * sizeof(uint64_t));
out:
  free(mine);
  free(frames);
  free(descs);
  free(block);
  return r;
}

/* ---- data movement ---------------------------------------------------- */

static void copy_local(void *dst, const void *src, size_t len) {
  tcc__move(dst, src, len);
}

static uint8_t *at(void *base, size_t off) { return base ? (uint8_t *)base + off : NULL; }

/* Rank j's share of `count` elements: the first count % n ranks get one more. */
static void chunk_of(size_t count, int n, int j, size_t *off, size_t *len) {
  size_t base = count / (size_t)n, extra = count % (size_t)n, uj = (size_t)j;
  *len = base + (uj < extra);
  *off = uj * base + (uj < extra ? uj : extra);
}

static tcc_result_t run_reduction(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline,
                                  tcc_err_t *err) {
  int n = x->comm->size, me = x->comm->rank;
  size_t es = tcc_dtype_size(c->dtype), chunk;
  stream_reducer_t *red = &x->red;
  red->dtype = c->dtype;
  red->redop = c->redop;
  red->premul = c->premul;
  red->esize = es;
  if (c->kind == TCC_COLL_REDUCE_SCATTER) {
    /* chunk j is sends[j]: every rank sends it to j, j reduces it into recv */
    chunk = c->count * es;
    for (int j = 0; j < n; j++)
      if (j != me)
        x->links[j] = (stream_link_t){.out_ptr = c->sends[j], .out_raw = chunk, .in_slot = chunk};
    red->self_src = c->sends[me];
    red->out = c->recv;
  } else {
    bool all = c->kind == TCC_COLL_ALLREDUCE, root = me == c->root;
    size_t my_off, my_len;
    chunk_of(c->count, n, me, &my_off, &my_len);
    chunk = my_len * es;
    for (int j = 0; j < n; j++) {
      if (j == me) continue;
      size_t off, len;
      chunk_of(c->count, n, j, &off, &len);
      stream_link_t *l = &x->links[j];
      l->out_ptr = at(c->send, off * es);
      l->out_raw = len * es;
      l->out_red = all || j == c->root ? chunk : 0;
      l->in_slot = chunk;
      if (all || root) {
        l->in_ptr = at(c->recv, off * es);
        l->in_raw = len * es;
      }
    }
    red->self_src = at(c->send, my_off * es);
    red->out = all || root ? at(c->recv, my_off * es) : NULL;
  }
  tcc_result_t r = tcc__stream_reducer_alloc(x, chunk, red->out == NULL, err);
  if (r != TCC_OK) return r;
  r = tcc__stream_xfer_run(x, deadline, err);
  tcc__stream_reducer_free(red);
  return r;
}

static tcc_result_t run_data(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline,
                             tcc_err_t *err) {
  int n = x->comm->size, me = x->comm->rank;
  size_t es = tcc_dtype_size(c->dtype), bytes = c->count * es;
  void *self_dst = NULL;
  const void *self_src = NULL;
  size_t self_len = 0;
  x->phase = "data";
  reset_links(x);
  switch (c->kind) {
  case TCC_COLL_BARRIER:
    return TCC_OK; /* the descriptor exchange was the barrier */
  case TCC_COLL_ALLREDUCE:
  case TCC_COLL_REDUCE:
  case TCC_COLL_REDUCE_SCATTER:
    return run_reduction(x, c, deadline, err);
  case TCC_COLL_BROADCAST: {
    void *buf = c->recv ? c->recv : c->send;
    for (int j = 0; j < n; j++) {
      if (j == me) continue;
      if (me == c->root) x->links[j] = (stream_link_t){.out_ptr = buf, .out_raw = bytes};
      else if (j == c->root) x->links[j] = (stream_link_t){.in_ptr = buf, .in_raw = bytes};
    }
    break;
  }
  case TCC_COLL_ALLGATHER:
  case TCC_COLL_GATHER: {
    bool all = c->kind == TCC_COLL_ALLGATHER;
    for (int j = 0; j < n; j++) {
      if (j == me) continue;
      if (all || j == c->root) {
        x->links[j].out_ptr = c->send;
        x->links[j].out_raw = bytes;
      }
      if (all || me == c->root) {
        x->links[j].in_ptr = c->recvs[j];
        x->links[j].in_raw = bytes;
      }
    }
    if (all || me == c->root) {
      self_dst = c->recvs[me];
      self_src = c->send;
      self_len = bytes;
    }
    break;
  }
  case TCC_COLL_SCATTER:
    for (int j = 0; j < n; j++) {
      if (j == me) continue;
      if (me == c->root) x->links[j] = (stream_link_t){.out_ptr = c->sends[j], .out_raw = bytes};
      else if (j == c->root) x->links[j] = (stream_link_t){.in_ptr = c->recv, .in_raw = bytes};
    }
    if (me == c->root) {
      self_dst = c->recv;
      self_src = c->sends[me];
      self_len = bytes;
    }
    break;
  case TCC_COLL_ALLTOALL:
    for (int j = 0; j < n; j++) {
      if (j == me) continue;
      x->links[j] = (stream_link_t){.out_ptr = c->sends[j], .out_raw = c->send_counts[j] * es,
                                 .in_ptr = c->recvs[j], .in_raw = c->recv_counts[j] * es};
    }
    self_dst = c->recvs[me];
    self_src = c->sends[me];
    self_len = (c->send_counts[me] < c->recv_counts[me] ? c->send_counts[me]
                                                         : c->recv_counts[me]) * es;
    break;
  }
  tcc_result_t r = tcc__stream_xfer_run(x, deadline, err);
  /* after the transfers: the copy may not disturb bytes still to be sent */
  if (r == TCC_OK) copy_local(self_dst, self_src, self_len);
  return r;
}

static bool has_root(tcc_coll_kind_t kind) {
  return kind == TCC_COLL_BROADCAST || kind == TCC_COLL_REDUCE ||
         kind == TCC_COLL_GATHER || kind == TCC_COLL_SCATTER;
}

/* The start every collective over streams shares: not run on a failed
 * communicator, the descriptor exchange, the root's range. */
static tcc_result_t agree(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline_ns, uint64_t *send_matrix,
                          tcc_err_t *err) {
  tcc_comm_t *comm = x->comm;
  char pre[160];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  if (atomic_load(&comm->aborted)) {
    char cause[TCC_ERRLEN];
    tcc__comm_failure(comm, cause, sizeof cause);
    return tcc__err_set(err, TCC_ERR_ABORTED, "%s: not run: %.300s", pre, cause);
  }
  tcc_result_t r = exchange_descs(x, c, deadline_ns, send_matrix, err);
  /* after the exchange, so all ranks (which agree on the root) fail alike */
  if (r == TCC_OK && has_root(c->kind) && (c->root < 0 || c->root >= comm->size))
    r = tcc__err_set(err, TCC_ERR_INVALID, "%s: root %d out of range [0, %d)", pre, c->root, comm->size);
  return r;
}

/* The parts of a collective over streams: the agreement (send_matrix as in
 * tcc__coll_stream_agree), the data (inputs snapshotted where they overlap
 * outputs), or both. */
typedef enum { PART_AGREE = 1, PART_DATA = 2 } stream_part_t;

static tcc_result_t run_parts(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns, int parts,
                              uint64_t *send_matrix, tcc_err_t *err) {
  stream_link_t *links = calloc((size_t)comm->size, sizeof(*links));
  stream_xfer_t x = {.comm = comm, .what = tcc__coll_name(c->kind), .phase = "start", .seq = seq, .links = links};
  if (!links) return fail_nomem(&x, err);
  tcc_result_t r = parts & PART_AGREE ? agree(&x, c, deadline_ns, send_matrix, err) : TCC_OK;
  if (r == TCC_OK && (parts & PART_DATA)) {
    tcc_coll_t staged;
    void *mem = NULL;
    if (!tcc__coll_snapshot_inputs(c, comm->size, comm->rank, &staged, &mem)) {
      r = fail_nomem(&x, err);
    } else {
      r = run_data(&x, &staged, deadline_ns, err);
      free(mem);
    }
  }
  free(links);
  return r;
}

tcc_result_t tcc__coll_stream_agree(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                    uint64_t *send_matrix, tcc_err_t *err) {
  return run_parts(comm, c, seq, deadline_ns, PART_AGREE, send_matrix, err);
}

tcc_result_t tcc__coll_stream_run_agreed(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                         tcc_err_t *err) {
  return run_parts(comm, c, seq, deadline_ns, PART_DATA, NULL, err);
}

tcc_result_t tcc__coll_stream_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                  tcc_err_t *err) {
  return run_parts(comm, c, seq, deadline_ns, PART_AGREE | PART_DATA, NULL, err);
}
