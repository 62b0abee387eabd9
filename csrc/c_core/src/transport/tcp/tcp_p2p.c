/*
 * tcp_p2p.c - point-to-point byte streams, wakeups, teardown, ops table.
 *
 * The engine frames and matches messages; this file only moves bytes on
 * each peer's p2p socket, without ever blocking, and lets the p2p thread
 * sleep in one poll over all of them plus an eventfd that p2p_notify
 * writes, so new local work or an abort wakes it at once.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "transport/tcp/tcp.h"

tcp_state_t *tcc__tcp_state_new(int n, int me, tcc_err_t *err) {
  tcp_state_t *st = calloc(1, sizeof(*st));
  if (!st) goto nomem;
  st->n = n;
  st->me = me;
  st->wake_fd = -1;
  st->coll_fd = malloc((size_t)n * sizeof(int));
  st->p2p_fd = malloc((size_t)n * sizeof(int));
  st->p2p_dead = calloc((size_t)n, sizeof(atomic_bool));
  st->coll_pfd = calloc((size_t)n, sizeof(struct pollfd));
  st->coll_ahead = calloc((size_t)n, sizeof(tcp_ahead_t));
  if (!st->coll_fd || !st->p2p_fd || !st->p2p_dead || !st->coll_pfd || !st->coll_ahead) goto nomem;
  for (int j = 0; j < n; j++) {
    st->coll_fd[j] = st->p2p_fd[j] = -1;
    atomic_init(&st->p2p_dead[j], false);
  }
  st->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (st->wake_fd < 0) {
    tcc__err_set(err, TCC_ERR_SYSTEM, "tcp: eventfd failed: %s", strerror(errno));
    tcc__tcp_state_free(st);
    return NULL;
  }
  tcc__fd_close_on_fork(st->wake_fd);
  return st;
nomem:
  tcc__err_set(err, TCC_ERR_SYSTEM, "tcp: out of memory");
  tcc__tcp_state_free(st);
  return NULL;
}

void tcc__tcp_state_free(tcp_state_t *st) {
  if (!st) return;
  for (int j = 0; j < st->n; j++) {
    if (st->coll_fd && st->coll_fd[j] >= 0) tcc__fd_close(st->coll_fd[j]);
    if (st->p2p_fd && st->p2p_fd[j] >= 0) tcc__fd_close(st->p2p_fd[j]);
    if (st->coll_ahead) free(st->coll_ahead[j].buf);
  }
  tcc__fd_close(st->wake_fd);
  free(st->coll_fd);
  free(st->p2p_fd);
  free(st->p2p_dead);
  free(st->coll_pfd);
  free(st->coll_ahead);
  free(st);
}

static int p2p_fd_of(tcc_comm_t *comm, int peer, tcc_err_t *err) {
  tcp_state_t *st = comm->transport_state;
  if (peer < 0 || peer >= st->n || peer == st->me) {
    tcc__err_set(err, TCC_ERR_INVALID, "tcp p2p on communicator '%s' rank %d: no channel "
                "to rank %d", comm->name, tcc__self_label(comm), peer);
    return -1;
  }
  return st->p2p_fd[peer];
}

static ssize_t p2p_failed(tcc_comm_t *comm, int peer, const char *how, int errnum,
                          tcc_err_t *err) {
  tcp_state_t *st = comm->transport_state;
  atomic_store(&st->p2p_dead[peer], true); /* stop polling it: it would wake p2p_wait forever */
  if (errnum == ECONNRESET || errnum == EPIPE || errnum == 0)
    tcc__err_set(err, TCC_ERR_REMOTE, "tcp p2p on communicator '%s' rank %d: the connection to rank %d %s "
                "(its process exited, or its communicator failed or was destroyed)", comm->name,
                tcc__self_label(comm), peer, errnum ? "was reset" : "closed");
  else
    tcc__err_set(err, TCC_ERR_REMOTE, "tcp p2p on communicator '%s' rank %d: %s rank %d "
                "failed: %s", comm->name, tcc__self_label(comm), how, peer, strerror(errnum));
  return -1;
}

ssize_t tcc__tcp_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt,
                             tcc_err_t *err) {
  int fd = p2p_fd_of(comm, peer, err);
  if (fd < 0) return -1;
  size_t len = 0;
  for (int i = 0; i < iovcnt; i++) len += iov[i].iov_len;
  if (len == 0) return 0;
  struct msghdr msg = {.msg_iov = (struct iovec *)iov, .msg_iovlen = (size_t)iovcnt};
  for (;;) {
    ssize_t k = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k >= 0) return k;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return p2p_failed(comm, peer, "sending to", errno, err);
  }
}

ssize_t tcc__tcp_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len,
                            tcc_err_t *err) {
  int fd = p2p_fd_of(comm, peer, err);
  if (fd < 0) return -1;
  if (len == 0) return 0;
  for (;;) {
    ssize_t k = recv(fd, buf, len, MSG_DONTWAIT);
    if (k > 0) return k;
    if (k == 0) return p2p_failed(comm, peer, NULL, 0, err);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return p2p_failed(comm, peer, "receiving from", errno, err);
  }
}

void tcc__tcp_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns) {
  tcp_state_t *st = comm->transport_state;
  /* The p2p thread and a waiter running p2p rounds may both sleep here. */
  struct pollfd small[65], *pfd = st->n < 65 ? small : malloc(((size_t)st->n + 1) * sizeof *pfd);
  if (!pfd) { /* a nap instead of a poll: the caller's next round looks again */
    struct timespec nap = {0, 1000000};
    nanosleep(&nap, NULL);
    return;
  }
  int k = 0;
  pfd[k++] = (struct pollfd){.fd = st->wake_fd, .events = POLLIN};
  for (int j = 0; j < st->n; j++) {
    if (j == st->me || atomic_load(&st->p2p_dead[j]) || st->p2p_fd[j] < 0) continue;
    short ev = (short)(POLLIN | (want_write && want_write[j] ? POLLOUT : 0));
    pfd[k++] = (struct pollfd){.fd = st->p2p_fd[j], .events = ev};
  }
  if (max_ns < 0) max_ns = 0;
  struct timespec ts = {.tv_sec = max_ns / 1000000000, .tv_nsec = max_ns % 1000000000};
  if (ppoll(pfd, (nfds_t)k, &ts, NULL) > 0 && (pfd[0].revents & POLLIN)) {
    uint64_t v;
    /* drain so the next wait sleeps again; notifications are not counted */
    while (read(st->wake_fd, &v, sizeof(v)) < 0 && errno == EINTR) {
    }
  }
  if (pfd != small) free(pfd);
}

void tcc__tcp_p2p_notify(tcc_comm_t *comm) {
  tcp_state_t *st = comm->transport_state;
  uint64_t one = 1;
  /* EAGAIN means the counter is already non-zero: the wakeup is pending */
  while (write(st->wake_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void tcc__tcp_failed(tcc_comm_t *comm, bool announce) {
  tcp_state_t *st = comm->transport_state;
  if (!announce || !st) return;
  /* A peer waiting on this rank would otherwise wait for its own timeout:
   * ending both directions of every connection makes its next poll see
   * the end of the stream. Descriptors stay open (other threads of this
   * rank may be using them) until the transport is destroyed. */
  for (int j = 0; j < st->n; j++) {
    if (st->coll_fd[j] >= 0) shutdown(st->coll_fd[j], SHUT_RDWR);
    if (st->p2p_fd[j] >= 0) shutdown(st->p2p_fd[j], SHUT_RDWR);
  }
}

static void tcp_destroy(tcc_comm_t *comm) {
  tcc__tcp_state_free(comm->transport_state);
  comm->transport_state = NULL;
}

const tcc_transport_ops_t tcc__tcp_transport_ops = {
    .name = "tcp",
    .caps = TCC__TRANSPORT_STREAMS_ALONE,
    .streams = &tcc__tcp_streams,
    .p2p_write = tcc__tcp_p2p_write,
    .p2p_read = tcc__tcp_p2p_read,
    .p2p_wait = tcc__tcp_p2p_wait,
    .p2p_notify = tcc__tcp_p2p_notify,
    .destroy = tcp_destroy,
    .failed = tcc__tcp_failed,
};
