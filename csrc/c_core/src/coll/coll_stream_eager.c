/*
 * coll_stream_eager.c - small collectives over streams in one exchange.
 *
 * The general path (coll_stream.c) agrees on the op, then moves its data:
 * an allreduce costs three one-way latencies (descriptors, reduce-scatter,
 * all-gather), a broadcast two. A small message costs its latency, not its
 * bytes, so here each rank's descriptor frame carries what the peer needs
 * from it (an allreduce: the whole input), and each rank computes its
 * result from the payloads once the descriptors agree: one latency.
 * Payloads land in scratch and outputs are written only after the check,
 * so a mismatch leaves every output as it was, as on the general path.
 *
 * Reductions reduce all n contributions in rank order with the function
 * the general path's reduce-scatter uses, so the bits are the same
 * whichever path ran.
 *
 * One-sided rooted ops. Even in one exchange, the root of a broadcast
 * waits for every peer's descriptor before it returns, so a loop of them
 * costs a latency per op where a root that returns at once lets the next
 * op's frames follow while the receivers still take the last. Where the
 * group's streams are its own (TCC__TRANSPORT_STREAMS_ALONE), the senders
 * of a small broadcast or scatter (the root) and of a small gather or
 * reduce (the other ranks) send their frames and return, and a receiver
 * waits for its senders' frames only. Every rank still sends its frame to
 * every other before it waits, so a rank that waits on a peer always gets
 * that peer's frame of the op, whatever op the peer thinks it is, and two
 * ranks never wait on each other in vain. The frames nobody waited for
 * are read when their receiver next reads from that peer, and checked
 * against its own descriptor then (stream_frames.c). A disagreement fails
 * the communicator: the ranks went on, and frames of the op may be left
 * where another op reads. The frames nobody waits for (a receiver's, and
 * a gather's or reduce's senders' to each other) are not even sent at
 * once: held back, they go in one send later, or as soon as their rank
 * waits for anything (stream_frames_t's hold), so a receiver whose data
 * is there makes no send at all.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/stream_frames.h"
#include "core/copy.h"

/* The most a rank sends or receives in one op on this path, the payloads
 * of all its peers together. An allreduce here sends n - 1 times its input
 * where reduce-scatter + all-gather send less than twice, so past some
 * size the bytes cost more than the latencies saved. Over loopback TCP
 * (2 CPUs, bench/README.md) this path was still ahead with 64 KiB to each
 * of 3 peers; the budget leaves room for links slower than loopback. */
#define EAGER_BYTES (64u << 10)
_Static_assert(EAGER_BYTES <= TCC_STREAM_PAYLOAD_MAX, "a peer accepts every payload this path sends");

bool tcc__stream_eager_fits(const tcc_coll_t *c, int n) {
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE:
    case TCC_COLL_REDUCE:
    case TCC_COLL_BROADCAST:
    case TCC_COLL_ALLGATHER:
    case TCC_COLL_GATHER:
    case TCC_COLL_SCATTER:
    case TCC_COLL_REDUCE_SCATTER: break;
    default: return false; /* a barrier is one exchange already; all-to-all counts differ by rank */
  }
  /* The choice depends on nothing but descriptor fields every rank checks,
   * so ranks that choose differently have issued different ops. */
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  return n > 1 && c->count <= EAGER_BYTES && bytes <= EAGER_BYTES / (size_t)(n - 1);
}

bool tcc__stream_one_sided_wanted(const tcc_comm_t *comm) {
  if (comm->parent || !(comm->ops->caps & TCC__TRANSPORT_STREAMS_ALONE)) return false;
  const char *s = getenv("TCCOMM_STREAM_ONE_SIDED");
  return !(s && strcmp(s, "0") == 0);
}

bool tcc__stream_one_sided(tcc_comm_t *comm, const tcc_coll_t *c) {
  switch (c->kind) {
    case TCC_COLL_BROADCAST:
    case TCC_COLL_SCATTER:
    case TCC_COLL_GATHER:
    case TCC_COLL_REDUCE:
      /* A root out of range takes the exchange, which fails it on every
       * rank alike (the senders are not known). */
      return coll_scratch_of(comm)->stream_one_sided && c->root >= 0 && c->root < comm->size;
    default:
      return false;
  }
}

static bool sends_only(const tcc_coll_t *c, int rank) {
  const bool root = rank == c->root;
  return c->kind == TCC_COLL_BROADCAST || c->kind == TCC_COLL_SCATTER ? root : !root;
}

/* The payload this rank sends to peer j (*len 0: none), and the length it
 * expects from j. */
static const void *payload_to(const tcc_coll_t *c, int me, int j, size_t bytes, size_t *len) {
  const void *p = NULL;
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE:
    case TCC_COLL_ALLGATHER: p = c->send; break;
    case TCC_COLL_REDUCE:
    case TCC_COLL_GATHER: p = j == c->root ? c->send : NULL; break;
    case TCC_COLL_BROADCAST: p = me == c->root ? (c->recv ? c->recv : c->send) : NULL; break;
    case TCC_COLL_SCATTER: p = me == c->root ? c->sends[j] : NULL; break;
    case TCC_COLL_REDUCE_SCATTER: p = c->sends[j]; break;
    default: break;
  }
  *len = p ? bytes : 0;
  return p;
}

static size_t expected_from(const tcc_coll_t *c, int me, int j, size_t bytes) {
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE:
    case TCC_COLL_ALLGATHER:
    case TCC_COLL_REDUCE_SCATTER: return bytes;
    case TCC_COLL_REDUCE:
    case TCC_COLL_GATHER: return me == c->root ? bytes : 0;
    case TCC_COLL_BROADCAST:
    case TCC_COLL_SCATTER: return j == c->root ? bytes : 0;
    default: return 0;
  }
}

/* This rank's own contribution, when it reduces: a private copy, as the
 * output may overlap it. */
static const void *own_input(const tcc_coll_t *c, int me) {
  if (c->kind == TCC_COLL_REDUCE_SCATTER) return c->sends[me];
  if (c->kind == TCC_COLL_REDUCE && me == c->root) return c->send;
  return NULL;
}

/* The scratch of one op (stream_frame_plan_t): one frame per run of
 * peers that get the same payload, the payloads that arrive, and in
 * `extra` this rank's own input when it reduces it (see own_input). */
static bool plan(const stream_xfer_t *x, const tcc_coll_t *c, stream_frame_plan_t *p) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  size_t frames = 0, ins = 0, len;
  const void *prev = NULL;
  size_t prev_len = 0;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    const void *data = payload_to(c, me, j, bytes, &len);
    if (frames == 0 || data != prev || len != prev_len)
      frames += tcc__stream_round64(tcc__stream_frame_bytes(c, n, len));
    prev = data;
    prev_len = len;
    ins += tcc__stream_round64(expected_from(c, me, j, bytes));
  }
  const void *own = own_input(c, me);
  if (!tcc__stream_frame_plan_alloc(p, n, frames, ins, own ? bytes : 0)) return false;
  /* One-sided: a receiver listens to its senders only; a sender to none. */
  p->one_sided = tcc__stream_one_sided(x->comm, c);
  /* Held back: the frames whose peer does not listen to this rank. */
  for (int j = 0; j < n; j++) {
    p->listen[j] = p->one_sided && j != me && !sends_only(c, me) && sends_only(c, j);
    p->hold[j] = p->one_sided && j != me && !(sends_only(c, me) && !sends_only(c, j));
  }
  uint8_t *frame = p->frames, *in = p->ins, *last = NULL;
  prev = NULL;
  for (int j = 0; j < n; j++) {
    if (j == me) continue;
    const void *data = payload_to(c, me, j, bytes, &len);
    if (!last || data != prev || len != prev_len) {
      tcc__stream_frame_fill(c, x->seq, n, data, len, frame);
      last = frame;
      frame += tcc__stream_round64(tcc__stream_frame_bytes(c, n, len));
    }
    prev = data;
    prev_len = len;
    p->out[j] = last;
    p->out_len[j] = tcc__stream_frame_bytes(c, n, len);
    p->in_len[j] = expected_from(c, me, j, bytes);
    p->in[j] = p->in_len[j] ? in : NULL;
    in += tcc__stream_round64(p->in_len[j]);
  }
  if (own) tcc__copy(p->extra, own, bytes);
  return true;
}

/* The op's results from the payloads, after the check accepted it. */
static void finish(const stream_xfer_t *x, const tcc_coll_t *c, stream_frame_plan_t *p) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t bytes = c->count * tcc__dtype_size(c->dtype);
  const size_t payload_at = tcc__stream_frame_bytes(c, n, 0); /* in a frame */
  const int any_peer = me == 0 ? 1 : 0;
  if (bytes == 0) return; /* no payloads arrived, and nothing is to be written */
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE:
    case TCC_COLL_REDUCE:
    case TCC_COLL_REDUCE_SCATTER:
      if (c->kind == TCC_COLL_REDUCE && me != c->root) return;
      for (int j = 0; j < n; j++) p->srcs[j] = p->in[j];
      /* an allreduce sent its input to every peer: the frame holds a copy */
      p->srcs[me] = own_input(c, me) ? p->extra : p->out[any_peer] + payload_at;
      tcc__reduce_n(c->recv, p->srcs, n, c->count, c->dtype, c->redop, c->premul);
      return;
    case TCC_COLL_BROADCAST:
      if (me != c->root) tcc__copy(c->recv ? c->recv : c->send, p->in[c->root], bytes);
      return;
    case TCC_COLL_ALLGATHER:
    case TCC_COLL_GATHER:
      if (c->kind == TCC_COLL_GATHER && me != c->root) return;
      /* this rank's block first: the others may overwrite its input */
      tcc__move(c->recvs[me], c->send, bytes);
      for (int j = 0; j < n; j++)
        if (j != me) tcc__copy(c->recvs[j], p->in[j], bytes);
      return;
    case TCC_COLL_SCATTER:
      /* the root's other blocks went out in its frames, already copied */
      if (me == c->root) tcc__move(c->recv, c->sends[me], bytes);
      else tcc__copy(c->recv, p->in[c->root], bytes);
      return;
    default: return;
  }
}

tcc_result_t tcc__coll_stream_eager(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline, tcc_err_t *err) {
  stream_frame_plan_t p;
  if (!plan(x, c, &p)) {
    char pre[160];
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  const stream_frames_t f = tcc__stream_frame_plan_frames(&p);
  tcc_result_t r = tcc__stream_frames_exchange(x, c, &f, deadline, NULL, err);
  if (r == TCC_OK) r = tcc__coll_stream_root_check(x, c, err);
  if (r == TCC_OK) finish(x, c, &p);
  free(p.mem);
  return r;
}
