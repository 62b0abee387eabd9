/*
 * coll_stream.c - collectives over byte streams between every pair of
 * ranks (the transport's tcc__stream_ops_t; TCP's full mesh).
 *
 * Every collective starts with a descriptor exchange (stream_frames.c):
 * each rank sends its descriptor to every other rank, so all ranks hold the
 * same n descriptors and reach the same verdict in tcc__coll_desc_check. On
 * a mismatch nothing else is sent and the streams stay aligned for the
 * next collective. Small ops carry their data in the same frames
 * (coll_stream_eager.c): one exchange in all. So do an all-to-all's small
 * blocks (coll_stream_alltoall.c), and the reduce-scatter of a mid-sized
 * all-reduce (coll_stream_reduce_frames.c): two exchanges in all.
 *
 * Otherwise data then moves directly between the ranks that need it. Reductions are
 * a reduce-scatter by direct exchange (rank j reduces chunk j over all n
 * contributions in rank order) followed by an all-gather (allreduce) or a
 * gather to the root (reduce) of the reduced chunks, pipelined in segments
 * so every element is reduced by exactly one rank and every rank ends up
 * with the same bits.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/stream_frames.h"
#include "core/copy.h"

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

/* Every rank's descriptor to every other, nothing else (stream_frames.h). */
static tcc_result_t exchange_descs(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline,
                                   uint64_t *send_matrix, tcc_err_t *err) {
  const int n = x->comm->size;
  const size_t len = tcc__stream_frame_bytes(c, n, 0);
  uint8_t *frame = malloc(len);
  uint8_t **out = malloc((size_t)n * sizeof(*out));
  size_t *out_len = malloc((size_t)n * sizeof(*out_len));
  tcc_result_t r;
  if (!frame || !out || !out_len) {
    r = fail_nomem(x, err);
  } else {
    tcc__stream_frame_fill(c, x->seq, n, NULL, 0, frame);
    for (int j = 0; j < n; j++) {
      out[j] = frame;
      out_len[j] = len;
    }
    const stream_frames_t f = {.out = out, .out_len = out_len};
    r = tcc__stream_frames_exchange(x, c, &f, deadline, send_matrix, err);
  }
  free(frame);
  free(out);
  free(out_len);
  return r;
}

/* ---- data movement ---------------------------------------------------- */

static void copy_local(void *dst, const void *src, size_t len) {
  tcc__move(dst, src, len);
}

static uint8_t *at(void *base, size_t off) { return base ? (uint8_t *)base + off : NULL; }

void tcc__stream_chunk_of(size_t count, int n, int j, size_t *off, size_t *len) {
  size_t base = count / (size_t)n, extra = count % (size_t)n, uj = (size_t)j;
  *len = base + (uj < extra);
  *off = uj * base + (uj < extra ? uj : extra);
}

static tcc_result_t run_reduction(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline,
                                  tcc_err_t *err) {
  int n = x->comm->size, me = x->comm->rank;
  size_t es = tcc__dtype_size(c->dtype), chunk;
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
    tcc__stream_chunk_of(c->count, n, me, &my_off, &my_len);
    chunk = my_len * es;
    for (int j = 0; j < n; j++) {
      if (j == me) continue;
      size_t off, len;
      tcc__stream_chunk_of(c->count, n, j, &off, &len);
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
  size_t es = tcc__dtype_size(c->dtype), bytes = c->count * es;
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
    return tcc__stream_alltoall_move(x, c, false, deadline, err);
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

tcc_result_t tcc__coll_stream_root_check(const stream_xfer_t *x, const tcc_coll_t *c, tcc_err_t *err) {
  if (!has_root(c->kind) || (c->root >= 0 && c->root < x->comm->size)) return TCC_OK;
  char pre[160];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  return tcc__err_set(err, TCC_ERR_INVALID, "%s: root %d out of range [0, %d)", pre, c->root, x->comm->size);
}

/* Nothing runs on a failed communicator. */
static tcc_result_t refuse_if_failed(const stream_xfer_t *x, tcc_err_t *err) {
  tcc_comm_t *comm = x->comm;
  if (!atomic_load(&comm->aborted)) return TCC_OK;
  char pre[160], cause[TCC_ERRLEN];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  tcc__comm_failure(comm, cause, sizeof cause);
  return tcc__err_set(err, TCC_ERR_ABORTED, "%s: not run: %.300s", pre, cause);
}

/* The start every collective over streams shares: not run on a failed
 * communicator, the descriptor exchange, the root's range. */
static tcc_result_t agree(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline_ns, uint64_t *send_matrix,
                          tcc_err_t *err) {
  tcc_result_t r = refuse_if_failed(x, err);
  if (r == TCC_OK) r = exchange_descs(x, c, deadline_ns, send_matrix, err);
  if (r == TCC_OK) r = tcc__coll_stream_root_check(x, c, err);
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
  const bool whole = parts == (PART_AGREE | PART_DATA);
  const bool eager = whole && tcc__stream_eager_fits(c, comm->size);
  const bool reduce_frames = whole && !eager && tcc__stream_reduce_frames_fits(c, comm->size);
  if (whole && (c->kind == TCC_COLL_ALLTOALL || eager || reduce_frames)) {
    tcc_result_t r = refuse_if_failed(&x, err);
    if (r == TCC_OK)
      r = c->kind == TCC_COLL_ALLTOALL ? tcc__coll_stream_alltoall(&x, c, deadline_ns, err)
          : eager                      ? tcc__coll_stream_eager(&x, c, deadline_ns, err)
                                       : tcc__coll_stream_reduce_frames(&x, c, deadline_ns, err);
    free(links);
    return r;
  }
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
