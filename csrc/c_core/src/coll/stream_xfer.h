/*
 * stream_xfer.h - moving the byte streams of one collective phase over the
 * transport's streams (tcc__stream_ops_t), with a pipelined reducer.
 * stream_xfer.c runs it; coll_stream.c builds the phases of each
 * collective from it.
 */
#ifndef TCC_COLL_STREAM_XFER_H
#define TCC_COLL_STREAM_XFER_H

#include "coll/coll_scratch.h"

/* What flows to and from one peer during a phase. Outgoing: out_raw bytes
 * from out_ptr, then out_red bytes of this rank's reduced chunk, released
 * segment by segment as the reducer produces them. Incoming: in_slot bytes
 * of the peer's contribution to this rank's chunk, into the reducer's
 * double-buffered slots, then in_raw bytes straight into in_ptr. */
typedef struct stream_link {
  /* sent before everything else (held frames of earlier ops, stream_frames.c) */
  const uint8_t *out_pre;
  size_t pre_len, pre_done;
  const uint8_t *out_ptr;
  size_t out_raw, out_red, out_done;
  size_t in_slot;
  uint8_t *in_ptr;
  size_t in_raw, in_done;
  bool in_closed; /* with a continuation (stream_xfer_t.in_next): it said no more */
  bool hung_up;   /* the peer reset or closed its stream (stream_xfer.c: hang-ups) */
} stream_link_t;

/* Reduces this rank's chunk in pipeline segments: segment k is reduced as
 * soon as every peer's part of it has arrived, over all n contributions in
 * rank order. Two slots per peer let segment k+1 arrive while k waits. */
typedef struct stream_reducer {
  tcc_dtype_t dtype;
  tcc_redop_t redop;
  double premul;
  size_t esize;
  const uint8_t *self_src; /* this rank's own contribution to the chunk */
  uint8_t *out;            /* the reduced chunk; NULL: two staging segments */
  size_t chunk;            /* bytes this rank reduces (0: no reduction) */
  size_t seg;              /* bytes per segment */
  size_t nseg, done_seg;
  uint8_t *slots;   /* [n][2][seg] */
  uint8_t *staging; /* [2][seg] when out == NULL */
  const void **srcs; /* [n] scratch */
} stream_reducer_t;

typedef struct stream_xfer stream_xfer_t;

/* Called each time the incoming bytes of peer's link are all in: either
 * points the link at what comes next (in_ptr, in_raw, with in_done and
 * in_slot 0) or sets its in_closed. So a stream can carry a frame whose
 * head says how long the rest is, and where the rest goes. */
typedef tcc_result_t (*stream_in_next_fn)(stream_xfer_t *x, int peer, tcc_err_t *err);

struct stream_xfer {
  tcc_comm_t *comm;
  const char *what;  /* collective name, for messages */
  const char *phase; /* "descriptor exchange" or "data" */
  uint64_t seq;
  stream_link_t *links; /* [n] */
  stream_reducer_t red;
  stream_in_next_fn in_next; /* NULL: every link's length is known up front */
  void *in_next_ctx;
  /* Called once, the first time the transfer finds nothing to move and is
   * not done, before it waits in any way: it may give links more to send
   * (out_pre). NULL: none. */
  void (*before_wait)(stream_xfer_t *x);
  bool hangup_seen; /* the last failure was a peer's reset or end of stream */
};

/* Moves every link's bytes (and runs the reducer) until all are done, the
 * deadline passes, the communicator is aborted or a peer fails. */
tcc_result_t tcc__stream_xfer_run(stream_xfer_t *x, int64_t deadline_ns, tcc_err_t *err);
/* Sizes the segments and allocates slots for a reduction of `chunk` bytes
 * (the rest of x->red is filled by the caller). */
tcc_result_t tcc__stream_reducer_alloc(stream_xfer_t *x, size_t chunk, bool need_staging,
                               tcc_err_t *err);
void tcc__stream_reducer_free(stream_reducer_t *red);
/* The pipeline segment of a reduction on n ranks, in bytes (each chunk's
 * own size when smaller, rounded down to whole elements). */
size_t tcc__stream_segment_bytes(int n);
/* "tcp allreduce #7 on communicator 'g' rank 2" (the transport's name first) */
void tcc__stream_xfer_prefix(const stream_xfer_t *x, char *buf, size_t len);

#endif /* TCC_COLL_STREAM_XFER_H */
