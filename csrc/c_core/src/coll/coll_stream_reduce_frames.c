/*
 * coll_stream_reduce_frames.c - all-reduces over streams too large for one
 * exchange (coll_stream_eager.c) whose reduce-scatter still fits in the
 * descriptor frames: two exchanges instead of three.
 *
 * The general path (coll_stream.c) exchanges descriptors, then moves each
 * rank's part of every chunk to the chunk's reducer, then the reduced
 * chunks to everyone: three one-way latencies. Here each rank's frame to
 * peer j carries chunk j of its input, exactly what the general path's
 * reduce-scatter sends j after the descriptors; once the descriptors
 * agree, each rank reduces its chunk and the all-gather follows. The
 * same bytes travel as on the general path (unlike the one-exchange path,
 * which sends the whole input to every peer), one latency sooner.
 *
 * The chunks, the reduction (all n contributions in rank order, the
 * function the general path's reducer uses) and so the bits are those of
 * the general path. Chunks land in scratch and outputs are written only
 * after the check, so a mismatch leaves every output as it was.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/stream_frames.h"

bool tcc__stream_reduce_frames_fits(const tcc_coll_t *c, int n) {
  if (c->kind != TCC_COLL_ALLREDUCE || n < 2 || tcc__stream_eager_fits(c, n)) return false;
  /* The largest chunk (the first count % n have one element more); every
   * rank decides alike from the count and dtype the check compares. */
  const size_t largest = c->count / (size_t)n + (c->count % (size_t)n != 0);
  return largest <= TCC_STREAM_PAYLOAD_MAX / tcc__dtype_size(c->dtype);
}

/* The scratch of one op (stream_frame_plan_t): a frame per peer (its
 * chunk of this rank's input after the descriptor), the peers' parts of
 * this rank's chunk. */
static bool plan(const stream_xfer_t *x, const tcc_coll_t *c, stream_frame_plan_t *p) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t es = tcc__dtype_size(c->dtype);
  size_t my_off, my_len, off, len, frames = 0;
  tcc__stream_chunk_of(c->count, n, me, &my_off, &my_len);
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    tcc__stream_chunk_of(c->count, n, j, &off, &len);
    frames += tcc__stream_round64(tcc__stream_frame_bytes(c, n, len * es));
  }
  const size_t ins = (size_t)(n - 1) * tcc__stream_round64(my_len * es);
  if (!tcc__stream_frame_plan_alloc(p, n, frames, ins, 0)) return false;
  uint8_t *frame = p->frames, *in = p->ins;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    tcc__stream_chunk_of(c->count, n, j, &off, &len);
    tcc__stream_frame_fill(c, x->seq, n, (const uint8_t *)c->send + off * es, len * es, frame);
    p->out[j] = frame;
    p->out_len[j] = tcc__stream_frame_bytes(c, n, len * es);
    frame += tcc__stream_round64(p->out_len[j]);
    /* A chunk of no element is expected as no payload (in NULL). */
    p->in_len[j] = my_len * es;
    p->in[j] = my_len ? in : NULL;
    in += tcc__stream_round64(my_len * es);
  }
  return true;
}

/* Once the descriptors agree: this rank's chunk reduced into its output,
 * then every reduced chunk to every rank. */
static tcc_result_t reduce_and_gather(stream_xfer_t *x, const tcc_coll_t *c, stream_frame_plan_t *p, int64_t deadline,
                                      tcc_err_t *err) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t es = tcc__dtype_size(c->dtype);
  size_t my_off, my_len, off, len;
  tcc__stream_chunk_of(c->count, n, me, &my_off, &my_len);
  uint8_t *recv = c->recv, *mine = recv + my_off * es;
  if (my_len) {
    for (int j = 0; j < n; j++) p->srcs[j] = j == me ? (const uint8_t *)c->send + my_off * es : p->in[j];
    tcc__reduce_n(mine, p->srcs, n, my_len, c->dtype, c->redop, c->premul);
  }
  x->phase = "data";
  memset(x->links, 0, (size_t)n * sizeof(*x->links));
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    tcc__stream_chunk_of(c->count, n, j, &off, &len);
    x->links[j] = (stream_link_t){.out_ptr = mine, .out_raw = my_len * es, .in_ptr = recv + off * es,
                                  .in_raw = len * es};
  }
  return tcc__stream_xfer_run(x, deadline, err);
}

tcc_result_t tcc__coll_stream_reduce_frames(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline,
                                            tcc_err_t *err) {
  const int n = x->comm->size;
  char pre[160];
  /* An output that overlaps the input without being it would overwrite
   * parts of the input still to be reduced: those read a copy. */
  tcc_coll_t staged;
  void *snapshot = NULL;
  stream_frame_plan_t p = {0};
  if (!tcc__coll_snapshot_inputs(c, n, x->comm->rank, &staged, &snapshot) || !plan(x, &staged, &p)) {
    free(snapshot);
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  const stream_frames_t f = tcc__stream_frame_plan_frames(&p);
  tcc_result_t r = tcc__stream_frames_exchange(x, &staged, &f, deadline, NULL, err);
  if (r == TCC_OK) r = reduce_and_gather(x, &staged, &p, deadline, err);
  free(p.mem);
  free(snapshot);
  return r;
}
