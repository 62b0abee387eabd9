/*
 * stream_frames.h - the frames every collective over streams starts with:
 * each rank sends each peer its descriptor, optionally followed by a
 * payload (the data that peer needs from it, when the whole op fits in
 * one exchange: coll_stream_eager.c), and checks every rank's descriptor.
 *
 * On the wire, per peer: stream_frame_head_t, the descriptor's tail (an
 * all-to-all's counts), then `payload` bytes. The head says how long the
 * rest is, so a receiver always takes exactly what was sent, whatever it
 * expected: ranks that disagree on an op leave the streams in step for the
 * next one.
 */
#ifndef TCC_COLL_STREAM_FRAMES_H
#define TCC_COLL_STREAM_FRAMES_H

#include "coll/stream_xfer.h"

/* The most payload a frame may carry to one peer (a larger one means the
 * streams are out of step). */
#define TCC_STREAM_PAYLOAD_MAX (64u << 10)
/* The most one-sided ops whose frames from a peer a rank may leave unread
 * (it did not wait for that peer in them): it then reads them before it
 * goes on, so its peers' frames never fill a stream's buffer (64
 * descriptor frames take about 3 KB). */
#define TCC_STREAM_UNREAD_MAX 64
/* The most frames a rank holds back for one peer (see stream_frames_t's
 * hold): half of what that peer may leave unread, so a peer that must
 * read them finds most of them sent. */
#define TCC_STREAM_HOLD_MAX (TCC_STREAM_UNREAD_MAX / 2)

/* Bytes of this rank's frame for c carrying `payload` bytes. */
size_t tcc__stream_frame_bytes(const tcc_coll_t *c, int n, size_t payload);
/* Writes that frame into out: head, descriptor tail, a copy of the payload
 * (at out + tcc__stream_frame_bytes(c, n, 0)). */
void tcc__stream_frame_fill(const tcc_coll_t *c, uint64_t seq, int n, const void *payload, size_t len,
                            uint8_t *out);

/* What one exchange of frames moves for this rank: out[j] (out_len[j]
 * bytes, a filled frame) goes to peer j; peer j's payload lands in in[j]
 * when it is in_len[j] bytes long (in NULL: no payload is expected).
 * Payloads of any other length are read and dropped: only ranks that
 * disagree on the op send them, and the check then fails the op. */
typedef struct stream_frames {
  uint8_t *const *out;
  const size_t *out_len;
  uint8_t *const *in;
  const size_t *in_len;
  /* NULL: every peer's frame is read and every rank's descriptor checked.
   * Else a one-sided op (coll_stream_eager.c): this rank reads the frames
   * of the peers marked, each checked against its own descriptor (a
   * disagreement fails the communicator, as the senders went on); the
   * others' frames of the op stay in the streams, read and checked when
   * it next reads from them. */
  const bool *listen;
  /* NULL, or in a one-sided op: the peers whose frame no one waits for
   * (this rank only receives, or the peer only sends). Such a frame, a
   * descriptor with no payload, is held back and sent with this rank's
   * next frame to that peer, or before this rank first waits for
   * anything, or once TCC_STREAM_HOLD_MAX are held, or when the
   * communicator goes idle (tcc__stream_frames_send_held). A receiver
   * whose data is already there then makes no send at all, and the
   * frames travel in one send later. A rank that waits has sent every
   * frame it held, so two ranks that both wait on each other (they
   * disagree) still find each other at once. */
  const bool *hold;
} stream_frames_t;

/* Each frame and payload of a plan starts on a cache line of its own. */
static inline size_t tcc__stream_round64(size_t len) { return (len + 63) & ~(size_t)63; }

/* The scratch of one exchange whose frames carry payloads, in one
 * allocation: `frame_bytes` for the frames this rank sends (`frames`),
 * `in_bytes` for the payloads that arrive (`ins`), `extra_bytes` for the
 * caller (`extra`; each region a multiple of 64 bytes), then the tables:
 * a stream_frames_t's (every out and in NULL, every length 0, no peer
 * listened to, not one-sided) and n sources for a reduction over the
 * payloads. */
typedef struct stream_frame_plan {
  uint8_t **out;
  size_t *out_len;
  uint8_t **in;
  size_t *in_len;
  bool *listen; /* the frames' when one_sided */
  bool *hold;   /* the frames' when one_sided */
  bool one_sided;
  const void **srcs;
  uint8_t *frames, *ins, *extra;
  void *mem;
} stream_frame_plan_t;

/* false: out of memory (nothing to free). */
bool tcc__stream_frame_plan_alloc(stream_frame_plan_t *p, int n, size_t frame_bytes, size_t in_bytes,
                                  size_t extra_bytes);
static inline stream_frames_t tcc__stream_frame_plan_frames(const stream_frame_plan_t *p) {
  return (stream_frames_t){
      .out = p->out,
      .out_len = p->out_len,
      .in = p->in,
      .in_len = p->in_len,
      .listen = p->one_sided ? p->listen : NULL,
      .hold = p->one_sided ? p->hold : NULL};
}

/* Sends and receives every peer's frame at once, then checks every rank's
 * descriptor (tcc__coll_desc_check: the same verdict on every rank). For
 * an all-to-all, send_matrix (NULL, or size x size) gets every rank's
 * send counts. A peer's frames of earlier one-sided ops that this rank did
 * not read are read first, each checked against this rank's descriptor of
 * that op (a disagreement fails the communicator); from a peer a one-sided
 * op does not listen to, only where TCC_STREAM_UNREAD_MAX are waiting. */
tcc_result_t tcc__stream_frames_exchange(stream_xfer_t *x, const tcc_coll_t *c, const stream_frames_t *f,
                                         int64_t deadline, uint64_t *send_matrix, tcc_err_t *err);

/* Before a healthy communicator closes its streams: reads the frames of
 * one-sided ops that no op read (until the deadline, or a stream ends),
 * so that no stream closes with bytes unread, which TCP answers with a
 * reset that can cost the peer what it has yet to read. */
void tcc__stream_frames_settle(tcc_comm_t *comm, int64_t deadline);

/* The frames this rank held back (stream_frames_t's hold): their space,
 * made with the scratch of a communicator whose rooted ops may run
 * one-sided (false: out of memory), and sending them, until the deadline
 * (0: as far as the streams take them now). Whether all went. */
bool tcc__stream_held_alloc(tcc__coll_scratch_t *sc, int n);
bool tcc__stream_frames_send_held(tcc_comm_t *comm, int64_t deadline);

/* coll_stream_eager.c: whether c goes in one exchange, descriptors and
 * data together (small ops; every rank chooses alike from the descriptor
 * fields the check compares), and that path. */
bool tcc__stream_eager_fits(const tcc_coll_t *c, int n);
/* Whether comm's small rooted ops may run one-sided (at attach), and
 * whether c, which fits that path, does: every rank still sends its frame
 * to every other, but the senders of a broadcast or scatter (the root) or
 * of a gather or reduce (the other ranks) wait for nothing, and a
 * receiver waits for its senders alone. */
bool tcc__stream_one_sided_wanted(const tcc_comm_t *comm);
bool tcc__stream_one_sided(tcc_comm_t *comm, const tcc_coll_t *c);
tcc_result_t tcc__coll_stream_eager(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline, tcc_err_t *err);

/* coll_stream_reduce_frames.c: whether c is an all-reduce too large for
 * one exchange whose chunks (tcc__stream_chunk_of) still fit in frames,
 * and that path: the reduce-scatter in the descriptor frames, then the
 * all-gather. */
bool tcc__stream_reduce_frames_fits(const tcc_coll_t *c, int n);
tcc_result_t tcc__coll_stream_reduce_frames(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline, tcc_err_t *err);

/* coll_stream_alltoall.c: an all-to-all whose small blocks go in the
 * frames. Whether a block of `bytes` does (both ends decide alike from the
 * block's size; the check confirms they agree on it). */
bool tcc__stream_block_in_frame(size_t bytes, int n);
/* How many of this rank's blocks, sent and received, go in frames: what
 * the op log calls its algorithm. */
typedef enum { ALLTOALL_FRAMES_NONE, ALLTOALL_FRAMES_SOME, ALLTOALL_FRAMES_ALL } alltoall_frames_t;
alltoall_frames_t tcc__stream_alltoall_frames(const tcc_coll_t *c, int n, int me);
/* The descriptors and small blocks in one exchange, then the rest. */
tcc_result_t tcc__coll_stream_alltoall(stream_xfer_t *x, const tcc_coll_t *c, int64_t deadline, tcc_err_t *err);
/* Moves the blocks by direct exchange, except the small ones where
 * small_sent (they went in the frames), then this rank's own block. */
tcc_result_t tcc__stream_alltoall_move(stream_xfer_t *x, const tcc_coll_t *c, bool small_sent, int64_t deadline,
                                       tcc_err_t *err);

/* coll_stream.c: rank j's share of `count` elements of a reduction, which
 * rank j reduces (the first count % n ranks get one more). */
void tcc__stream_chunk_of(size_t count, int n, int j, size_t *off, size_t *len);
/* After the exchange, so all ranks (which agree on the
 * root) fail alike: a rooted op's root must be a rank of the group. */
tcc_result_t tcc__coll_stream_root_check(const stream_xfer_t *x, const tcc_coll_t *c, tcc_err_t *err);

#endif /* TCC_COLL_STREAM_FRAMES_H */
