/*
 * tcp.h - private declarations of the TCP transport.
 *
 * tcp_setup.c   endpoint (listening socket + blob) and the full-mesh setup
 * tcp_p2p.c     point-to-point byte streams, wakeups, teardown, ops table
 * tcp_stream.c  the poll loop that moves the byte streams of one collective
 * tcp_coll.c    descriptor exchange and the collective algorithms
 *
 * Every pair of ranks has two connections: one carries only collectives
 * (used by the engine's collective thread), the other only point-to-point
 * traffic (the p2p thread), so the two threads never share a socket.
 */
#ifndef TCC_TCP_H
#define TCC_TCP_H

#include <poll.h>

#include "internal.h"

enum { TCP_CHAN_COLL = 0, TCP_CHAN_P2P = 1, TCP_NCHAN = 2 };

#define TCP_HELLO_MAGIC 0x54434348u /* connector -> acceptor */
#define TCP_ACK_MAGIC 0x5443434bu   /* acceptor -> connector */

/* The handshake, both directions. The connector proves it knows the
 * acceptor's token (hello); the acceptor proves it knows the connector's
 * (ack), so neither side talks to a stranger that reused a port. */
typedef struct tcp_hello {
  uint32_t magic;
  uint32_t rank;  /* sender's rank */
  uint32_t chan;  /* TCP_CHAN_* */
  uint32_t size;  /* communicator size, a sanity check */
  uint8_t token[TCC_TOKEN_BYTES]; /* the RECEIVER's token */
} tcp_hello_t;

/* The acceptor's check of a hello from a connection nobody vouched for:
 * true (with the sender's *peer and *chan) when it carries this rank's
 * `token` and the group size n, comes from a rank above `me`, names a
 * channel, and that (peer, chan) is not yet claimed[2 * peer + chan]. */
bool tcp_hello_accept(const tcp_hello_t *h, int n, int me, const uint8_t *token, const bool *claimed,
                      int *peer, int *chan);
/* The connector's check of the reply: from `peer` on `chan`, carrying this
 * rank's `token`. */
bool tcp_ack_valid(const tcp_hello_t *ack, int peer, int chan, const uint8_t *token);

typedef struct tcp_state {
  int n, me;
  int *coll_fd;   /* [n]; -1 for this rank */
  int *p2p_fd;    /* [n]; -1 for this rank */
  bool *p2p_dead; /* [n]; the stream failed: no longer polled */
  int wake_fd;    /* eventfd written by p2p_notify */
  /* poll scratch, one set per thread that polls */
  struct pollfd *p2p_pfd;
  struct pollfd *coll_pfd;
  int *coll_pfd_peer;
  size_t desc_max; /* largest descriptor any kind can have on n ranks */
} tcp_state_t;

/* tcp_p2p.c */
extern const tcc_transport_ops_t tcp_transport_ops;
tcp_state_t *tcp_state_new(int n, int me, tcc_err_t *err);
void tcp_state_free(tcp_state_t *st);

/* ---- tcp_stream.c: the byte streams of one collective phase ---------- */

/* What flows to and from one peer during a phase. Outgoing: out_raw bytes
 * from out_ptr, then out_red bytes of this rank's reduced chunk, released
 * segment by segment as the reducer produces them. Incoming: in_slot bytes
 * of the peer's contribution to this rank's chunk, into the reducer's
 * double-buffered slots, then in_raw bytes straight into in_ptr. */
typedef struct tcp_link {
  const uint8_t *out_ptr;
  size_t out_raw, out_red, out_done;
  size_t in_slot;
  uint8_t *in_ptr;
  size_t in_raw, in_done;
} tcp_link_t;

/* Reduces this rank's chunk in pipeline segments: segment k is reduced as
 * soon as every peer's part of it has arrived, over all n contributions in
 * rank order. Two slots per peer let segment k+1 arrive while k waits. */
typedef struct tcp_reducer {
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
} tcp_reducer_t;

typedef struct tcp_xfer {
  tcc_comm_t *comm;
  tcp_state_t *st;
  const char *what;  /* collective name, for messages */
  const char *phase; /* "descriptor exchange" or "data" */
  uint64_t seq;
  tcp_link_t *links; /* [n] */
  tcp_reducer_t red;
} tcp_xfer_t;

/* Moves every link's bytes (and runs the reducer) until all are done, the
 * deadline passes, the communicator is aborted or a peer fails. */
tcc_result_t tcp_xfer_run(tcp_xfer_t *x, int64_t deadline_ns, tcc_err_t *err);
/* Sizes the segments and allocates slots for a reduction of `chunk` bytes
 * (the rest of x->red is filled by the caller). */
tcc_result_t tcp_reducer_alloc(tcp_xfer_t *x, size_t chunk, bool need_staging,
                               tcc_err_t *err);
void tcp_reducer_free(tcp_reducer_t *red);
/* "tcp allreduce #7 on communicator 'g' rank 2" */
void tcp_xfer_prefix(const tcp_xfer_t *x, char *buf, size_t len);

/* tcp_coll.c */
tcc_result_t tcp_run_collective(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq,
                                int64_t deadline_ns, tcc_err_t *err);

#endif /* TCC_TCP_H */
