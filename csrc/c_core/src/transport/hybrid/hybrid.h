/*
 * hybrid.h - groups that span hosts: shared memory between the ranks of
 * each host, TCP between hosts.
 *
 * hybrid_setup.c  the topology, the group's TCP mesh, the views, the table
 * hybrid_cross.c  the cross-host view: a subset of the group's TCP streams
 *
 * The group's own connections are TCP's full mesh, so the algorithms over
 * streams (the flat ones, which serve every op) and point-to-point traffic
 * work on a hybrid group exactly as on a TCP group: comm->transport_state
 * is TCP's. The topology (transport.h, comm->topo) adds what the
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

#endif /* TCC_HYBRID_H */
