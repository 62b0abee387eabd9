/*
 * tcp.h - private declarations of the TCP transport.
 *
 * tcp_setup.c   endpoint (listening socket + blob) and the full-mesh setup
 * tcp_p2p.c     point-to-point byte streams, wakeups, teardown, ops table
 * tcp_streams.c the collective connections as byte streams for coll/
 * tcp_congestion.c the congestion control each connection sends with
 *
 * Every pair of ranks has two connections: one carries only collectives
 * (used by the engine's collective thread), the other only point-to-point
 * traffic (the p2p thread), so the two threads never share a socket.
 */
#ifndef TCC_TCP_H
#define TCC_TCP_H

#include <poll.h>
#include <stdatomic.h>

#include "transport/transport.h"

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
bool tcc__tcp_hello_accept(const tcp_hello_t *h, int n, int me, const uint8_t *token, const bool *claimed,
                      int *peer, int *chan);
/* The connector's check of the reply: from `peer` on `chan`, carrying this
 * rank's `token`. */
bool tcc__tcp_ack_valid(const tcp_hello_t *ack, int peer, int chan, const uint8_t *token);

typedef struct tcp_state {
  int n, me;
  int *coll_fd;   /* [n]; -1 for this rank */
  int *p2p_fd;    /* [n]; -1 for this rank */
  /* [n]; the stream failed: no longer polled. Set by whoever runs p2p
   * rounds, read by p2p_wait on any thread (host/host.h). */
  atomic_bool *p2p_dead;
  int wake_fd;    /* eventfd written by p2p_notify */
  /* poll scratch of the collectives (one runner at a time); p2p_wait,
   * which two threads may enter at once, keeps its own */
  struct pollfd *coll_pfd;
  struct tcp_ahead *coll_ahead; /* [n] what was read from each collective stream and not yet taken (tcp_streams.c) */
} tcp_state_t;

/* Bytes read from a collective stream ahead of the reader's asking, kept
 * until it asks (its buffer made at the first small read). */
typedef struct tcp_ahead {
  uint8_t *buf;
  uint32_t pos, len; /* buf[pos, len) is unread */
} tcp_ahead_t;

/* tcp_congestion.c: TCCOMM_TCP_CONGESTION, read once per setup. */
typedef struct tcp_congestion {
  bool system_only; /* "system": no connection is changed */
  char name[16];    /* the one named for every connection ("": the default policy) */
} tcp_congestion_t;
/* Reads the setting; a name is tried on probe_fd (a TCP socket of this
 * process), and one the kernel refuses is a TCC_ERR_INVALID naming what
 * it offers. */
tcc_result_t tcc__tcp_congestion_choose(tcp_congestion_t *cc, int probe_fd, tcc_err_t *err);
/* Sets a connection's congestion control: the named one, or, by default,
 * reno when the peer runs on this machine. */
void tcc__tcp_congestion_apply(const tcp_congestion_t *cc, int fd, bool same_machine);

/* tcp_p2p.c. The p2p functions of the table are also the hybrid
 * transport's, whose point-to-point traffic is TCP's. */
extern const tcc_transport_ops_t tcc__tcp_transport_ops;
/* The transport's `failed`: ends every connection when announcing. */
void tcc__tcp_failed(tcc_comm_t *comm, bool announce);
ssize_t tcc__tcp_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt, tcc_err_t *err);
ssize_t tcc__tcp_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err);
void tcc__tcp_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns);
void tcc__tcp_p2p_notify(tcc_comm_t *comm);
tcp_state_t *tcc__tcp_state_new(int n, int me, tcc_err_t *err);
void tcc__tcp_state_free(tcp_state_t *st);

/* tcp_streams.c: the collective connections as the algorithms see them. */
extern const tcc__stream_ops_t tcc__tcp_streams;

#endif /* TCC_TCP_H */
