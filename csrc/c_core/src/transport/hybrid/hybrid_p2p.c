/*
 * hybrid_p2p.c - point-to-point traffic of a group that spans hosts: with
 * a rank of this host over the local view's shared-memory rings, with a
 * rank of another host over the group's TCP connection to it.
 *
 * The group's p2p thread sleeps in TCP's poll. Shared-memory peers wake a
 * sleeper through this rank's doorbell, a futex no poll can wait on, so a
 * relay thread sleeps on the doorbell and turns each ring into a wake-up
 * of the poll (TCP's notify). Both ends of a pair decide the same way from
 * the same topology, so each pair's stream lives on one transport only.
 */
#include <pthread.h>
#include <stdlib.h>

#include "transport/hybrid/hybrid.h"
#include "transport/shm/shm.h"

struct tcc__hybrid_p2p {
  tcc_comm_t *group;
  atomic_bool stop;
  bool relay_started;
  pthread_t relay;
};

/* The local view's rank of group rank `peer`, or -1 when on another host. */
static int local_peer(const tcc_comm_t *comm, int peer) {
  const tcc__topology_t *t = comm->topo;
  return t->local && peer >= 0 && peer < comm->size && t->host_of[peer] == t->host ? t->local_index[peer] : -1;
}

ssize_t tcc__hybrid_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt, tcc_err_t *err) {
  const int lp = local_peer(comm, peer);
  return lp >= 0 ? tcc__shm_p2p_write(comm->topo->local, lp, iov, iovcnt, err)
                 : tcc__tcp_p2p_write(comm, peer, iov, iovcnt, err);
}

ssize_t tcc__hybrid_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err) {
  const int lp = local_peer(comm, peer);
  return lp >= 0 ? tcc__shm_p2p_read(comm->topo->local, lp, buf, len, err)
                 : tcc__tcp_p2p_read(comm, peer, buf, len, err);
}

bool tcc__hybrid_p2p_fits(tcc_comm_t *comm, int peer, size_t bytes) {
  const int lp = local_peer(comm, peer);
  return lp >= 0 && tcc__shm_p2p_fits(comm->topo->local, lp, bytes);
}

bool tcc__hybrid_p2p_direct(tcc_comm_t *comm, int peer, size_t bytes, bool to_peer) {
  const int lp = local_peer(comm, peer);
  return lp >= 0 && tcc__shm_p2p_direct(comm->topo->local, lp, bytes, to_peer);
}

tcc_result_t tcc__hybrid_p2p_peer_read(tcc_comm_t *comm, int peer, void *dst, uint64_t remote, size_t len,
                                       uint64_t seq, tcc_err_t *err) {
  const int lp = local_peer(comm, peer);
  if (lp < 0) /* a sender on another host never sends a reference: p2p_direct said no there */
    return tcc__err_set(err, TCC_ERR_REMOTE,
                        "tccomm recv #%llu on '%s' (rank %d): rank %d, on another host, sent a message by reference",
                        (unsigned long long)seq, comm->name, comm->rank, peer);
  return tcc__shm_p2p_peer_read(comm->topo->local, lp, dst, remote, len, seq, err);
}

void tcc__hybrid_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns) {
  const tcc__topology_t *t = comm->topo;
  if (!t->p2p) {
    tcc__tcp_p2p_wait(comm, want_write, max_ns);
    return;
  }
  /* Per call: the p2p thread and a waiter running rounds may both sleep here. */
  const size_t slots = (size_t)comm->size + (size_t)t->local->size;
  bool small[128], *tcp_want = slots <= 128 ? small : malloc(slots);
  if (!tcp_want) { /* a nap instead: the caller's next round looks again */
    tcc__tcp_p2p_wait(comm, NULL, max_ns < 1000000 ? max_ns : 1000000);
    return;
  }
  bool *local_want = tcp_want + comm->size;
  for (int q = 0; q < comm->size; q++) {
    const int lp = local_peer(comm, q);
    if (lp >= 0) local_want[lp] = want_write && want_write[q];
    /* A ring's peer never appears in TCP's poll as writable: its socket
     * always is, and would end every sleep at once. */
    tcp_want[q] = lp < 0 && want_write && want_write[q];
  }
  /* Rings that can move now; once asleep, a peer's write or read rings
   * the doorbell, which the relay turns into a wake-up of the poll. */
  if (tcc__shm_p2p_sleep_begin(t->local, local_want)) {
    tcc__tcp_p2p_wait(comm, tcp_want, max_ns);
    tcc__shm_p2p_sleep_end(t->local);
  }
  if (tcp_want != small) free(tcp_want);
}

static void wake_poll(void *group) { tcc__tcp_p2p_notify(group); }

static void *relay_main(void *arg) {
  tcc__hybrid_p2p_t *p = arg;
  tcc__shm_doorbell_relay(p->group->topo->local, &p->stop, wake_poll, p->group);
  return NULL;
}

tcc_result_t tcc__hybrid_p2p_start(tcc_comm_t *comm, tcc_err_t *err) {
  tcc__topology_t *t = comm->topo;
  if (!t->local) return TCC_OK; /* alone on its host: every peer is over TCP */
  tcc__hybrid_p2p_t *p = calloc(1, sizeof *p);
  if (!p) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", comm->name, comm->rank);
  p->group = comm;
  atomic_store(&p->stop, false);
  int rc = pthread_create(&p->relay, NULL, relay_main, p);
  if (rc != 0) {
    tcc__hybrid_p2p_stop(p);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): cannot start the doorbell relay thread (%d)",
                        comm->name, comm->rank, rc);
  }
  p->relay_started = true;
  t->p2p = p;
  return TCC_OK;
}

void tcc__hybrid_p2p_stop(tcc__hybrid_p2p_t *p) {
  if (!p) return;
  if (p->relay_started) {
    atomic_store(&p->stop, true);
    tcc__shm_doorbell_wake(p->group->topo->local); /* the relay sleeps on it */
    pthread_join(p->relay, NULL);
  }
  free(p);
}
