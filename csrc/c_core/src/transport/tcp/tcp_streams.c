/*
 * tcp_streams.c - the collective connections (one per pair of ranks,
 * used by no one but the collective runner) as the byte streams the
 * collective algorithms move data over (tcc__stream_ops_t).
 *
 * Small reads read ahead: a collective takes a frame in parts (head,
 * descriptor tail, payload), each part's length known from the one before,
 * and asked for each part with its own recv. A small op's frame arrives
 * whole, so a small read takes up to READ_AHEAD_BYTES into the stream's
 * buffer, and the next parts come from there without a system call (a
 * small op over TCP made 2 receives per peer, at about 0.2 us each, of a
 * 6 us op). What is read ahead may belong to the peer's next op, so the
 * buffer stays with the stream from op to op. Large reads go straight to
 * their destination: their bytes would be copied twice.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "transport/tcp/tcp.h"

#define READ_AHEAD_BYTES 4096u

static ssize_t stream_send(tcc_comm_t *comm, int peer, const void *buf, size_t len) {
  tcp_state_t *st = comm->transport_state;
  return send(st->coll_fd[peer], buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static bool has_ahead(const tcp_ahead_t *a) { return a->pos < a->len; }

/* Reads from the socket what it holds now, up to len: through the buffer
 * when the read is small (and the buffer could be made), else straight. */
static ssize_t read_socket(int fd, tcp_ahead_t *a, uint8_t *dst, size_t len) {
  if (len >= READ_AHEAD_BYTES || (!a->buf && !(a->buf = malloc(READ_AHEAD_BYTES))))
    return recv(fd, dst, len, MSG_DONTWAIT);
  const ssize_t k = recv(fd, a->buf, READ_AHEAD_BYTES, MSG_DONTWAIT);
  if (k <= 0) return k;
  const size_t take = (size_t)k < len ? (size_t)k : len;
  memcpy(dst, a->buf, take);
  a->pos = (uint32_t)take;
  a->len = (uint32_t)k;
  return (ssize_t)take;
}

/* recv(2)'s contract, read-ahead included: the bytes that are there now,
 * up to len; -1 with errno (EAGAIN: none yet), 0 at the end of the stream,
 * both only once the bytes read ahead are taken. */
static ssize_t stream_recv(tcc_comm_t *comm, int peer, void *buf, size_t len) {
  tcp_state_t *st = comm->transport_state;
  tcp_ahead_t *a = &st->coll_ahead[peer];
  uint8_t *dst = buf;
  size_t got = 0;
  if (has_ahead(a)) {
    got = a->len - a->pos < len ? a->len - a->pos : len;
    memcpy(dst, a->buf + a->pos, got);
    a->pos += (uint32_t)got;
    if (got == len) return (ssize_t)got;
  }
  const ssize_t k = read_socket(st->coll_fd[peer], a, dst + got, len - got);
  if (k <= 0) return got ? (ssize_t)got : k;
  return (ssize_t)(got + (size_t)k);
}

/* A stream with bytes read ahead is readable whatever its socket says; then
 * poll is not asked at all (the caller takes those bytes and asks again
 * for the others). */
static int stream_poll(tcc_comm_t *comm, int n, const int *peers, const short *events, short *revents,
                       int timeout_ms) {
  tcp_state_t *st = comm->transport_state;
  int ready = 0;
  for (int i = 0; i < n; i++) {
    revents[i] = (events[i] & POLLIN) && has_ahead(&st->coll_ahead[peers[i]]) ? POLLIN : 0;
    ready += revents[i] != 0;
  }
  if (ready) return ready;
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
