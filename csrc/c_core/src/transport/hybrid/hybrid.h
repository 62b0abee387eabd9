/*
 * hybrid.h - groups that span hosts: shared memory between the ranks of
 * each host, TCP between hosts.
 *
 * hybrid_setup.c  the topology, the group's TCP mesh, the views, the table
 * hybrid_cross.c  the cross-host view: a subset of the group's TCP streams
 * hybrid_p2p.c    point-to-point: rings within the host, TCP across
 *
 * The group's own connections are TCP's full mesh, so the algorithms over
 * streams (the flat ones, which serve every op) work on a hybrid group
 * exactly as on a TCP group: comm->transport_state is TCP's.
 * Point-to-point traffic with a rank of another host is TCP's too; with a
 * rank of this host it goes through the local view's rings. The topology (transport.h, comm->topo) adds what the
 * hierarchical algorithms (coll/coll_hier.c) run their phases on: a view
 * of this host's ranks over a shared-memory segment of their own, and a
 * view of the ranks of the other hosts that share this rank's local index,
 * over the group's TCP connections to them (each local rank on its own
 * connections, so the hosts' links carry all local ranks' shards at once).
 */
#ifndef TCC_HYBRID_H
#define TCC_HYBRID_H

#include "transport/tcp/tcp.h"

/* Makes `view` (members: ranks of `group`) move its bytes over the
 * group's TCP collective connections. */
tcc_result_t tcc__hybrid_cross_attach(tcc_comm_t *view, tcc_comm_t *group, tcc_err_t *err);

/* hybrid_p2p.c: the group's p2p functions (the table's), and the relay
 * that lets the p2p thread sleep in TCP's poll while ring peers can still
 * wake it. start: after the views; stop: before the views go (also takes
 * a half-made state or NULL). */
typedef struct tcc__hybrid_p2p tcc__hybrid_p2p_t;
ssize_t tcc__hybrid_p2p_write(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt, tcc_err_t *err);
ssize_t tcc__hybrid_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err);
/* Whether a write to a rank of this host takes `bytes` whole (its ring's
 * room); never for a rank of another host, whose TCP write may take a
 * prefix. */
bool tcc__hybrid_p2p_fits(tcc_comm_t *comm, int peer, size_t bytes);
/* Single-copy messages with the ranks of this host (shared memory's). */
bool tcc__hybrid_p2p_direct(tcc_comm_t *comm, int peer, size_t bytes, bool to_peer);
tcc_result_t tcc__hybrid_p2p_peer_read(tcc_comm_t *comm, int peer, void *dst, uint64_t remote, size_t len,
                                       uint64_t seq, tcc_err_t *err);
void tcc__hybrid_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns);
tcc_result_t tcc__hybrid_p2p_start(tcc_comm_t *comm, tcc_err_t *err);
void tcc__hybrid_p2p_stop(tcc__hybrid_p2p_t *p);

#endif /* TCC_HYBRID_H */
