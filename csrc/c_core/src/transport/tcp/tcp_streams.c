/*
 * tcp_streams.c - the collective connections (one per pair of ranks,
 * used by no one but the collective runner) as the byte streams the
 * collective algorithms move data over (tcc__stream_ops_t).
 */
#include <errno.h>
#include <sys/socket.h>

#include "transport/tcp/tcp.h"

static ssize_t stream_send(tcc_comm_t *comm, int peer, const void *buf, size_t len) {
  tcp_state_t *st = comm->transport_state;
  return send(st->coll_fd[peer], buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static ssize_t stream_recv(tcc_comm_t *comm, int peer, void *buf, size_t len) {
  tcp_state_t *st = comm->transport_state;
  return recv(st->coll_fd[peer], buf, len, MSG_DONTWAIT);
}

static int stream_poll(tcc_comm_t *comm, int n, const int *peers, const short *events, short *revents,
                       int timeout_ms) {
  tcp_state_t *st = comm->transport_state;
  for (int i = 0; i < n; i++) st->coll_pfd[i] = (struct pollfd){.fd = st->coll_fd[peers[i]], .events = events[i]};
  int rc = poll(st->coll_pfd, (nfds_t)n, timeout_ms);
  for (int i = 0; i < n; i++) revents[i] = rc > 0 ? st->coll_pfd[i].revents : 0;
  return rc;
}

const tcc__stream_ops_t tcc__tcp_streams = {
    .send = stream_send,
    .recv = stream_recv,
    .poll = stream_poll,
};
