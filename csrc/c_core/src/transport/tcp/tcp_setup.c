/*
 * tcp_setup.c - the endpoint (listening socket + blob) and the full mesh.
 *
 * Rank i connects to every j < i and accepts from every j > i, twice per
 * pair (collective and point-to-point channel). Everything runs from one
 * non-blocking poll loop, so a slow, silent or hostile connection to the
 * listening port never holds up the legitimate ones: a connection that
 * does not present this rank's token is simply closed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/log.h"
#include "transport/tcp/tcp.h"

#define RETRY_NS 20000000LL   /* pause before reconnecting after a refusal */
#define SLICE_MS 100          /* how often the loop looks at `aborted` */
#define EXTRA_INCOMING 16     /* unauthenticated connections held at once */

/* ---- endpoint --------------------------------------------------------- */

/* A failed endpoint is a failed group creation to come: worth a warning. */
static tcc_result_t endpoint_failed(tcc_result_t code) {
  TCC_LOG_WARN(-1, "%s", tcc_last_error());
  return code;
}

tcc_result_t tcc_endpoint_open(const char *advertise_addr, tcc_endpoint_t **ep_out,
                               uint8_t blob_out[TCC_ENDPOINT_BLOB_SIZE]) {
  *ep_out = NULL;
  tcc__log_setup(); /* the first thing a process does with tccomm */
  const char *addr = advertise_addr && *advertise_addr ? advertise_addr : "127.0.0.1";
  struct in_addr advertised;
  if (inet_pton(AF_INET, addr, &advertised) != 1) {
    return endpoint_failed(tcc__fail(TCC_ERR_INVALID, "tcc_endpoint_open: '%s' is not an IPv4 address", addr));
  }
  uint8_t hier_overlap;
  tcc_err_t why = {TCC_OK, {0}};
  if (tcc__hier_overlap_from_env(&hier_overlap, &why) != TCC_OK)
    return endpoint_failed(tcc__fail_with(&why, why.code));
  tcc_endpoint_t *ep = calloc(1, sizeof(*ep));
  if (!ep) return endpoint_failed(tcc__fail(TCC_ERR_SYSTEM, "tcc_endpoint_open: out of memory"));
  const char *what = "socket";
  int one = 1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
  socklen_t salen = sizeof(sa);
  ep->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (ep->listen_fd < 0) goto sys_fail;
  what = "setsockopt(SO_REUSEADDR)";
  if (setsockopt(ep->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one))) goto sys_fail;
  what = "bind";
  if (bind(ep->listen_fd, (struct sockaddr *)&sa, sizeof(sa))) goto sys_fail;
  what = "listen";
  if (listen(ep->listen_fd, SOMAXCONN)) goto sys_fail;
  what = "getsockname";
  if (getsockname(ep->listen_fd, (struct sockaddr *)&sa, &salen)) goto sys_fail;
  what = "getrandom";
  if (tcc__random_bytes(ep->blob.token, TCC_TOKEN_BYTES) != TCC_OK) goto sys_fail;

  tcc__fd_close_on_fork(ep->listen_fd);
  ep->blob.magic = TCC_BLOB_MAGIC;
  ep->blob.pid = (uint32_t)getpid();
  ep->blob.port = ntohs(sa.sin_port);
  ep->blob.ipv4 = advertised.s_addr;
  tcc__host_identity(ep->blob.hostname, ep->blob.boot_id);
  tcc__shm_identity(&ep->blob.shm_dev, &ep->blob.shm_ino);
  ep->blob.hier_overlap = hier_overlap;
  const int cpus = tcc__cpu_mask(ep->blob.cpu_mask, TCC_BLOB_CPU_BITS);
  ep->blob.cpus = (uint16_t)(cpus > UINT16_MAX ? UINT16_MAX : cpus);
  memset(blob_out, 0, TCC_ENDPOINT_BLOB_SIZE);
  memcpy(blob_out, &ep->blob, sizeof(ep->blob));
  *ep_out = ep;
  return TCC_OK;

sys_fail:;
  const int errnum = errno;
  if (ep->listen_fd >= 0) close(ep->listen_fd);
  free(ep);
  return endpoint_failed(tcc__fail(TCC_ERR_SYSTEM, "tcc_endpoint_open: %s failed: %s", what, strerror(errnum)));
}

void tcc_endpoint_close(tcc_endpoint_t *ep) {
  if (!ep) return;
  tcc__fd_close(ep->listen_fd);
  free(ep);
}

/* ---- mesh setup ------------------------------------------------------- */

typedef enum { C_IDLE, C_CONNECTING, C_SEND, C_RECV, C_DONE } conn_phase_t;

/* One connection being set up. Outgoing: connect, send hello, read ack.
 * Incoming: read hello, send ack. */
typedef struct conn {
  int fd;
  int peer, chan;      /* incoming: known once the hello checks out */
  bool outgoing;
  conn_phase_t phase;
  tcp_hello_t msg;     /* the message being sent or received */
  size_t done;
  int64_t time_ns;     /* outgoing, C_IDLE: when to try again; incoming: accepted */
  char last_error[120];
} conn_t;

typedef struct mesh {
  tcc_comm_t *comm;
  tcp_state_t *st;
  const tcc_blob_t *blobs;
  const uint8_t *token; /* this rank's */
  int listen_fd;
  conn_t *out;          /* [2 * me]: peer j < me, channel c at 2 * j + c */
  conn_t *in;           /* [in_cap]: accepted, not yet finished */
  int nin, in_cap;
  bool *claimed;        /* [2 * n]: an incoming hello took (peer, chan) */
  int connected, needed;
  tcp_congestion_t congestion;
  struct pollfd *pfd;
  conn_t **pfd_conn;    /* NULL: the listening socket */
} mesh_t;

static int *chan_fds(tcp_state_t *st, int chan) {
  return chan == TCP_CHAN_COLL ? st->coll_fd : st->p2p_fd;
}

/* SO_SNDBUF/SO_RCVBUF are left alone on purpose: setting them turns off
 * the kernel's buffer autotuning and is capped by net.core.rmem_max
 * (often 208 KiB), which would make buffers smaller, not larger. */
static void set_nodelay(int fd) {
  int one = 1;
  /* small messages (descriptors, headers) must not wait for Nagle */
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

static void conn_retry(conn_t *c, const char *why, int errnum) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  c->phase = C_IDLE;
  c->time_ns = tcc__now_ns() + RETRY_NS;
  snprintf(c->last_error, sizeof(c->last_error), "%s%s%s", why, errnum ? ": " : "",
           errnum ? strerror(errnum) : "");
}

static void conn_start(mesh_t *m, conn_t *c) {
  const tcc_blob_t *b = &m->blobs[c->peer];
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(b->port),
                           .sin_addr.s_addr = b->ipv4};
  c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    conn_retry(c, "socket", errno);
    return;
  }
  set_nodelay(c->fd);
  c->msg = (tcp_hello_t){.magic = TCP_HELLO_MAGIC, .rank = (uint32_t)m->st->me,
                         .chan = (uint32_t)c->chan, .size = (uint32_t)m->st->n};
  memcpy(c->msg.token, b->token, TCC_TOKEN_BYTES);
  c->done = 0;
  if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) c->phase = C_SEND;
  else if (errno == EINPROGRESS || errno == EINTR) c->phase = C_CONNECTING;
  else conn_retry(c, "connect", errno);
}

/* Sends or receives the rest of c->msg; 1 when complete, 0 when it would
 * block, -1 (with *errnum, 0 for end of stream) when the socket failed. */
static int move_msg(conn_t *c, bool sending, int *errnum) {
  while (c->done < sizeof(c->msg)) {
    uint8_t *p = (uint8_t *)&c->msg + c->done;
    size_t left = sizeof(c->msg) - c->done;
    ssize_t k = sending ? send(c->fd, p, left, MSG_NOSIGNAL) : recv(c->fd, p, left, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (k <= 0) {
      *errnum = k < 0 ? errno : 0;
      return -1;
    }
    c->done += (size_t)k;
  }
  c->done = 0;
  return 1;
}

static void conn_finish(mesh_t *m, conn_t *c) {
  const tcc_blob_t *mine = &m->blobs[m->st->me], *theirs = &m->blobs[c->peer];
  tcc__tcp_congestion_apply(&m->congestion, c->fd,
                            strncmp(mine->boot_id, theirs->boot_id, sizeof mine->boot_id) == 0);
  chan_fds(m->st, c->chan)[c->peer] = c->fd;
  tcc__fd_close_on_fork(c->fd);
  c->fd = -1;
  c->phase = C_DONE;
  m->connected++;
}

bool tcc__tcp_ack_valid(const tcp_hello_t *ack, int peer, int chan, const uint8_t *token) {
  return ack->magic == TCP_ACK_MAGIC && ack->rank == (uint32_t)peer && ack->chan == (uint32_t)chan &&
         memcmp(ack->token, token, TCC_TOKEN_BYTES) == 0;
}

/* Every field is range-checked before it indexes `claimed`: the sender
 * has not proven anything yet. */
bool tcc__tcp_hello_accept(const tcp_hello_t *h, int n, int me, const uint8_t *token, const bool *claimed,
                      int *peer, int *chan) {
  if (h->magic != TCP_HELLO_MAGIC || h->size != (uint32_t)n || memcmp(h->token, token, TCC_TOKEN_BYTES) != 0)
    return false;
  if (h->rank >= (uint32_t)n || (int)h->rank <= me || h->chan >= TCP_NCHAN) return false;
  if (claimed[2 * h->rank + h->chan]) return false;
  *peer = (int)h->rank;
  *chan = (int)h->chan;
  return true;
}

/* Advances an outgoing connection; on failure it is closed and retried
 * after RETRY_NS until the deadline (the peer may be slow to accept). */
static void step_outgoing(mesh_t *m, conn_t *c) {
  int errnum = 0, rc;
  if (c->phase == C_CONNECTING) {
    socklen_t len = sizeof(errnum);
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &errnum, &len) || errnum) {
      conn_retry(c, "connect", errnum ? errnum : errno);
      return;
    }
    c->phase = C_SEND;
  }
  if (c->phase == C_SEND) {
    if ((rc = move_msg(c, true, &errnum)) < 0) conn_retry(c, "sending hello", errnum);
    if (rc <= 0) return;
    c->phase = C_RECV;
  }
  if ((rc = move_msg(c, false, &errnum)) < 0)
    conn_retry(c, errnum ? "reading reply" : "closed by the peer during the handshake",
               errnum);
  if (rc <= 0) return;
  if (!tcc__tcp_ack_valid(&c->msg, c->peer, c->chan, m->token))
    conn_retry(c, "the process at that address is not this rank's peer", 0);
  else
    conn_finish(m, c);
}

static void drop_incoming(mesh_t *m, int i) {
  close(m->in[i].fd);
  m->in[i] = m->in[--m->nin];
}

/* Returns false when c was dropped (the slot now holds another conn). */
static bool step_incoming(mesh_t *m, int i) {
  conn_t *c = &m->in[i];
  int errnum = 0, rc;
  if (c->phase == C_RECV) {
    if ((rc = move_msg(c, false, &errnum)) < 0) return drop_incoming(m, i), false;
    if (rc == 0) return true;
    int peer, chan;
    if (!tcc__tcp_hello_accept(&c->msg, m->st->n, m->st->me, m->token, m->claimed, &peer, &chan))
      return drop_incoming(m, i), false;
    m->claimed[2 * peer + chan] = true;
    c->peer = peer;
    c->chan = chan;
    c->msg = (tcp_hello_t){.magic = TCP_ACK_MAGIC, .rank = (uint32_t)m->st->me,
                           .chan = (uint32_t)chan, .size = (uint32_t)m->st->n};
    memcpy(c->msg.token, m->blobs[peer].token, TCC_TOKEN_BYTES);
    c->phase = C_SEND;
  }
  if ((rc = move_msg(c, true, &errnum)) < 0) {
    m->claimed[2 * c->peer + c->chan] = false; /* let the peer try again */
    return drop_incoming(m, i), false;
  }
  if (rc == 0) return true;
  conn_finish(m, c);
  m->in[i] = m->in[--m->nin];
  return false;
}

static tcc_result_t accept_all(mesh_t *m, tcc_err_t *err) {
  for (;;) {
    int fd = accept4(m->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return TCC_OK;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      return tcc__err_set(err, TCC_ERR_SYSTEM,
                         "tcp setup of communicator '%s' rank %d: accept failed: %s",
                         m->comm->name, m->st->me, strerror(errno));
    }
    /* full of unfinished handshakes: the oldest unauthenticated one gives
     * way (authenticated ones number at most in_cap - EXTRA_INCOMING) */
    if (m->nin == m->in_cap) {
      int oldest = -1;
      for (int i = 0; i < m->nin; i++)
        if (m->in[i].phase == C_RECV &&
            (oldest < 0 || m->in[i].time_ns < m->in[oldest].time_ns))
          oldest = i;
      if (oldest < 0) { /* cannot happen: see in_cap */
        close(fd);
        continue;
      }
      drop_incoming(m, oldest);
    }
    set_nodelay(fd);
    m->in[m->nin++] = (conn_t){.fd = fd, .peer = -1, .phase = C_RECV,
                               .time_ns = tcc__now_ns()};
  }
}

/* "rank 1 (coll, p2p: connect: Connection refused), rank 3 (p2p)" */
static void describe_missing(const mesh_t *m, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int j = 0; j < m->st->n && used + 1 < len; j++) {
    if (j == m->st->me) continue;
    bool coll = m->st->coll_fd[j] < 0, p2p = m->st->p2p_fd[j] < 0;
    if (!coll && !p2p) continue;
    const char *why = "";
    if (j < m->st->me) {
      const conn_t *c = &m->out[2 * j + (coll ? TCP_CHAN_COLL : TCP_CHAN_P2P)];
      why = c->last_error[0] ? c->last_error : "no handshake reply";
    }
    int k = snprintf(buf + used, len - used, "%srank %d (%s%s%s%s)", used ? ", " : "", j,
                     coll && p2p ? "coll, p2p" : coll ? "coll" : "p2p", *why ? ": " : "",
                     why, j > m->st->me ? ": it never connected" : "");
    if (k < 0 || (size_t)k >= len - used) {
      if (len > 4) snprintf(buf + len - 4, 4, "...");
      return;
    }
    used += (size_t)k;
  }
}

/* Starts due (re)connections and lists the sockets to poll; returns when
 * the loop must wake next at the latest. */
static int64_t mesh_prepare_poll(mesh_t *m, int64_t now, int *npfd) {
  int64_t wake = now + (int64_t)SLICE_MS * 1000000;
  int k = 0;
  if (m->st->n - 1 - m->st->me > 0) {
    m->pfd[k] = (struct pollfd){.fd = m->listen_fd, .events = POLLIN};
    m->pfd_conn[k++] = NULL;
  }
  for (int i = 0; i < 2 * m->st->me; i++) {
    conn_t *c = &m->out[i];
    if (c->phase == C_IDLE) {
      if (c->time_ns <= now) conn_start(m, c);
      if (c->phase == C_IDLE && c->time_ns < wake) wake = c->time_ns;
    }
    if (c->phase == C_IDLE || c->phase == C_DONE) continue;
    m->pfd[k] = (struct pollfd){.fd = c->fd, .events = c->phase == C_RECV ? POLLIN : POLLOUT};
    m->pfd_conn[k++] = c;
  }
  for (int i = 0; i < m->nin; i++) {
    m->pfd[k] = (struct pollfd){.fd = m->in[i].fd,
                                .events = m->in[i].phase == C_RECV ? POLLIN : POLLOUT};
    m->pfd_conn[k++] = &m->in[i];
  }
  *npfd = k;
  return wake;
}

static tcc_result_t mesh_run(mesh_t *m, int64_t deadline, tcc_err_t *err) {
  while (m->connected < m->needed) {
    int64_t now = tcc__now_ns();
    const char *why = NULL;
    tcc_result_t code = TCC_ERR_TIMEOUT;
    if (atomic_load(&m->comm->aborted)) why = "aborted", code = TCC_ERR_ABORTED;
    else if (now >= deadline) why = "timed out";
    if (why) {
      char missing[TCC_ERRLEN / 2];
      describe_missing(m, missing, sizeof(missing));
      return tcc__err_set(err, code, "tcp setup of communicator '%s' rank %d: %s; not "
                         "connected to %s", m->comm->name, m->st->me, why, missing);
    }
    int npfd;
    int64_t wake = mesh_prepare_poll(m, now, &npfd);
    if (wake > deadline) wake = deadline;
    int timeout = wake > now ? (int)((wake - now + 999999) / 1000000) : 0;
    int rc = poll(m->pfd, (nfds_t)npfd, timeout);
    if (rc < 0 && errno != EINTR)
      return tcc__err_set(err, TCC_ERR_SYSTEM, "tcp setup: poll failed: %s", strerror(errno));
    if (rc <= 0) continue;
    /* outgoing first: stepping incoming ones may reorder m->in */
    bool accept_ready = false;
    for (int k = 0; k < npfd; k++) {
      if (!m->pfd[k].revents) continue;
      if (!m->pfd_conn[k]) accept_ready = true;
      else if (m->pfd_conn[k]->outgoing) step_outgoing(m, m->pfd_conn[k]);
    }
    for (int i = 0; i < m->nin;)
      if (step_incoming(m, i)) i++;
    if (accept_ready) {
      tcc_result_t r = accept_all(m, err);
      if (r != TCC_OK) return r;
    }
  }
  return TCC_OK;
}

static void mesh_free(mesh_t *m) {
  for (int i = 0; i < 2 * m->st->me; i++)
    if (m->out && m->out[i].fd >= 0) close(m->out[i].fd);
  for (int i = 0; i < m->nin; i++) close(m->in[i].fd);
  free(m->out);
  free(m->in);
  free(m->claimed);
  free(m->pfd);
  free(m->pfd_conn);
}

/* How waits treat CPUs (core/cpu_share.h), from the ranks that run on this
 * machine's CPUs: those with this rank's boot id, whatever their hostname
 * (hosts simulated in namespaces, containers, share one kernel's CPUs). */
static void share_cpus_with_machine_mates(tcc_comm_t *comm, const tcc_blob_t *blobs) {
  const char *mine = blobs[comm->rank].boot_id;
  int mates = 0;
  for (int q = 0; q < comm->size; q++)
    mates += strncmp(blobs[q].boot_id, mine, sizeof blobs[q].boot_id) == 0;
  char why[160];
  tcc__cpu_share_init(&comm->cpu_share, mates, tcc__blobs_cpus(blobs, comm->size, mine), why, sizeof why);
  TCC_LOG_INFO(comm->rank, "communicator '%s' over TCP: %s", comm->name, why);
}

tcc_result_t tcc__tcp_setup(tcc_comm_t *comm, tcc_endpoint_t *ep, const tcc_blob_t *blobs,
                           tcc_err_t *err) {
  int n = comm->size, me = comm->rank;
  int64_t deadline = tcc__deadline_after_ms(atomic_load(&comm->timeout_ms));
  for (int j = 0; j < n; j++)
    if (blobs[j].magic != TCC_BLOB_MAGIC) {
      tcc__fd_close(ep->listen_fd);
      ep->listen_fd = -1;
      return tcc__err_set(err, TCC_ERR_INVALID, "tcp setup of communicator '%s' rank %d: "
                         "endpoint blob of rank %d is not valid", comm->name, me, j);
    }
  tcp_state_t *st = tcc__tcp_state_new(n, me, err);
  if (!st) {
    tcc__fd_close(ep->listen_fd);
    ep->listen_fd = -1;
    return err ? err->code : TCC_ERR_SYSTEM;
  }
  mesh_t m = {.comm = comm, .st = st, .blobs = blobs, .token = ep->blob.token,
              .listen_fd = ep->listen_fd, .needed = 2 * (n - 1)};
  m.in_cap = 2 * (n - 1 - me) + EXTRA_INCOMING;
  int max_pfd = 1 + 2 * me + m.in_cap;
  m.out = calloc((size_t)(2 * me + 1), sizeof(conn_t));
  m.in = calloc((size_t)m.in_cap, sizeof(conn_t));
  m.claimed = calloc((size_t)(2 * n), sizeof(bool));
  m.pfd = calloc((size_t)max_pfd, sizeof(struct pollfd));
  m.pfd_conn = calloc((size_t)max_pfd, sizeof(conn_t *));
  tcc_result_t r = tcc__tcp_congestion_choose(&m.congestion, ep->listen_fd, err);
  if (r != TCC_OK) tcc__err_prefix(err, r, "tcp setup of communicator '%s' rank %d: ", comm->name, me);
  if (r == TCC_OK && (!m.out || !m.in || !m.claimed || !m.pfd || !m.pfd_conn))
    r = tcc__err_set(err, TCC_ERR_SYSTEM, "tcp setup: out of memory");
  if (r == TCC_OK) {
    for (int i = 0; i < 2 * me; i++)
      m.out[i] = (conn_t){.fd = -1, .peer = i / 2, .chan = i % 2, .outgoing = true,
                          .phase = C_IDLE};
    r = mesh_run(&m, deadline, err);
  }
  mesh_free(&m);
  tcc__fd_close(ep->listen_fd); /* no one else may connect from now on */
  ep->listen_fd = -1;
  if (r != TCC_OK) {
    tcc__tcp_state_free(st);
    return r;
  }
  comm->transport_state = st;
  comm->ops = &tcc__tcp_transport_ops;
  share_cpus_with_machine_mates(comm, blobs);
  return TCC_OK;
}
