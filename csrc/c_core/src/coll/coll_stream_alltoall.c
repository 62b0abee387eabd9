/*
 * coll_stream_alltoall.c - all-to-all over streams, small blocks in the
 * descriptor frames.
 *
 * An all-to-all first exchanges descriptors (the counts every rank sends
 * and expects), then moves the blocks: two one-way latencies. Each block
 * concerns one pair, and both ends know its size before anything is sent
 * (the sender its send count, the receiver its receive count; the check
 * later confirms they agree). So where a block is small, the sender puts
 * it in its frame to that peer and the receiver expects it there: one
 * exchange for an all-to-all whose blocks are all small, and only the
 * large blocks in a second. Unlike the other ops' one-exchange path
 * (coll_stream_eager.c) this sends no extra byte: every block travels
 * once either way.
 *
 * Blocks that arrive in frames land in scratch and are copied to the
 * outputs only after the check, so a mismatch writes no output.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/stream_frames.h"
#include "core/copy.h"

/* The most one rank receives in frames in one op, over all its peers (a
 * scratch copy each); per block the budget's share of one peer. Over
 * loopback a block of this size costs less than the latency it saves. */
#define FRAME_BLOCKS_BYTES (64u << 10)
_Static_assert(FRAME_BLOCKS_BYTES <= TCC_STREAM_PAYLOAD_MAX, "a peer accepts every block this path sends");

bool tcc__stream_block_in_frame(size_t bytes, int n) {
  return n > 1 && bytes <= FRAME_BLOCKS_BYTES / (size_t)(n - 1);
}

alltoall_frames_t tcc__stream_alltoall_frames(const tcc_coll_t *c, int n, int me) {
  const size_t es = tcc__dtype_size(c->dtype);
  int in_frames = 0, blocks = 0;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    blocks += 2;
    in_frames += tcc__stream_block_in_frame(c->send_counts[j] * es, n);
    in_frames += tcc__stream_block_in_frame(c->recv_counts[j] * es, n);
  }
  return in_frames == 0 ? ALLTOALL_FRAMES_NONE : in_frames == blocks ? ALLTOALL_FRAMES_ALL : ALLTOALL_FRAMES_SOME;
}

tcc_result_t tcc__stream_alltoall_move(stream_xfer_t *x, const tcc_coll_t *c, bool small_sent, int64_t deadline,
                                       tcc_err_t *err) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t es = tcc__dtype_size(c->dtype);
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    const size_t out = c->send_counts[j] * es, in = c->recv_counts[j] * es;
    const bool out_sent = small_sent && tcc__stream_block_in_frame(out, n);
    const bool in_sent = small_sent && tcc__stream_block_in_frame(in, n);
    x->links[j] = (stream_link_t){.out_ptr = c->sends[j], .out_raw = out_sent ? 0 : out,
                                  .in_ptr = c->recvs[j], .in_raw = in_sent ? 0 : in};
  }
  tcc_result_t r = tcc__stream_xfer_run(x, deadline, err);
  /* after the transfers: the copy may not disturb bytes still to be sent */
  const size_t self = (c->send_counts[me] < c->recv_counts[me] ? c->send_counts[me] : c->recv_counts[me]) * es;
  if (r == TCC_OK) tcc__move(c->recvs[me], c->sends[me], self);
  return r;
}

/* The scratch of one op (stream_frame_plan_t): a frame per peer, the
 * blocks that arrive in frames. */
static bool plan(const stream_xfer_t *x, const tcc_coll_t *c, stream_frame_plan_t *p) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t es = tcc__dtype_size(c->dtype);
  size_t frames = 0, ins = 0;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    const size_t out = c->send_counts[j] * es, in = c->recv_counts[j] * es;
    frames += tcc__stream_round64(tcc__stream_frame_bytes(c, n, tcc__stream_block_in_frame(out, n) ? out : 0));
    ins += tcc__stream_round64(tcc__stream_block_in_frame(in, n) ? in : 0);
  }
  if (!tcc__stream_frame_plan_alloc(p, n, frames, ins, 0)) return false;
  uint8_t *frame = p->frames, *in = p->ins;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    const size_t out_bytes = c->send_counts[j] * es, in_bytes = c->recv_counts[j] * es;
    const size_t payload = tcc__stream_block_in_frame(out_bytes, n) ? out_bytes : 0;
    tcc__stream_frame_fill(c, x->seq, n, c->sends[j], payload, frame);
    p->out[j] = frame;
    p->out_len[j] = tcc__stream_frame_bytes(c, n, payload);
    frame += tcc__stream_round64(p->out_len[j]);
    if (in_bytes > 0 && tcc__stream_block_in_frame(in_bytes, n)) {
      p->in[j] = in;
      p->in_len[j] = in_bytes;
      in += tcc__stream_round64(in_bytes);
    }
  }
  return true;
}

tcc_result_t tcc__coll_stream_alltoall(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline, tcc_err_t *err) {
  const int n = x->comm->size;
  stream_frame_plan_t p;
  char pre[160];
  if (!plan(x, c, &p)) {
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  const stream_frames_t f = tcc__stream_frame_plan_frames(&p);
  tcc_result_t r = tcc__stream_frames_exchange(x, c, &f, deadline, NULL, err);
  tcc_coll_t staged;
  void *snapshot = NULL;
  /* The inputs the second exchange sends, taken before any output is
   * written where outputs overlap them. */
  if (r == TCC_OK && !tcc__coll_snapshot_inputs(c, n, x->comm->rank, &staged, &snapshot)) {
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    r = tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  if (r == TCC_OK) {
    for (int j = 0; j < n; j++)
      if (p.in[j]) tcc__copy(c->recvs[j], p.in[j], p.in_len[j]);
    x->phase = "data";
    memset(x->links, 0, (size_t)n * sizeof(*x->links));
    r = tcc__stream_alltoall_move(x, &staged, true, deadline, err);
  }
  free(snapshot);
  free(p.mem);
  return r;
}
