/*
 * hybrid_setup.c - a hybrid group's topology, connections and views (see
 * hybrid.h), its teardown, and its transport table.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "transport/hybrid/hybrid.h"

static void topology_free(tcc__topology_t *t) {
  if (!t) return;
  tcc__hybrid_p2p_stop(t->p2p); /* its relay sleeps on the local view */
  tcc__comm_view_free(t->local);
  tcc__comm_view_free(t->cross);
  free(t->host_of);
  free(t->local_index);
  free(t->host_size);
  free(t->by_host);
  free(t->host_start);
  free(t);
}

tcc_result_t tcc__hier_overlap_from_env(uint8_t *out, tcc_err_t *err) {
  const char *s = getenv("TCCOMM_HIER_OVERLAP");
  *out = TCC_HIER_OVERLAP_AUTO;
  if (!s || !*s || strcmp(s, "auto") == 0) return TCC_OK;
  if (strcmp(s, "0") == 0) *out = TCC_HIER_OVERLAP_OFF;
  else if (strcmp(s, "1") == 0) *out = TCC_HIER_OVERLAP_ON;
  else return tcc__err_set(err, TCC_ERR_INVALID, "tccomm: TCCOMM_HIER_OVERLAP='%s' is not one of auto, 0, 1", s);
  return TCC_OK;
}

/* transport.h: rank 0's setting, or whether every machine has a CPU for each
 * of its ranks and each of its leaders' threads. Every rank decides from
 * the same blobs, so all agree (the segments are collectives of them all). */
static bool leaders_may_overlap(const tcc__topology_t *t, int n, const tcc_blob_t *blobs) {
  if (blobs[0].hier_overlap == TCC_HIER_OVERLAP_ON) return true;
  if (blobs[0].hier_overlap == TCC_HIER_OVERLAP_OFF) return false;
  for (int q = 0; q < n; q++) {
    int threads = 0, cpus = INT32_MAX;
    for (int r = 0; r < n; r++) {
      if (strncmp(blobs[r].boot_id, blobs[q].boot_id, sizeof blobs[r].boot_id) != 0) continue;
      threads += t->local_index[r] == 0 ? 2 : 1; /* a leader and its thread */
      if (blobs[r].cpus < cpus) cpus = blobs[r].cpus;
    }
    if (threads > cpus) return false; /* cpus 0 (unknown) included */
  }
  return true;
}

/* Hosts from the blobs: ranks that can map each other's shared memory
 * are on one host (the proof select.c uses), numbered in the order of
 * their lowest rank. */
static tcc__topology_t *topology_new(int n, int me, const tcc_blob_t *blobs) {
  tcc__topology_t *t = calloc(1, sizeof *t);
  int *first = calloc((size_t)n, sizeof *first); /* lowest rank of each host */
  if (t) {
    t->host_of = calloc((size_t)n, sizeof *t->host_of);
    t->local_index = calloc((size_t)n, sizeof *t->local_index);
    t->host_size = calloc((size_t)n, sizeof *t->host_size);
    t->by_host = calloc((size_t)n, sizeof *t->by_host);
    t->host_start = calloc((size_t)n, sizeof *t->host_start);
  }
  if (!t || !first || !t->host_of || !t->local_index || !t->host_size || !t->by_host || !t->host_start) {
    free(first);
    topology_free(t);
    return NULL;
  }
  for (int r = 0; r < n; r++) {
    int h = 0;
    while (h < t->nhosts && !tcc__blobs_share_shm(&blobs[first[h]], &blobs[r])) h++;
    if (h == t->nhosts) first[t->nhosts++] = r;
    t->host_of[r] = h;
    t->local_index[r] = t->host_size[h]++;
  }
  free(first);
  for (int h = 1; h < t->nhosts; h++) t->host_start[h] = t->host_start[h - 1] + t->host_size[h - 1];
  for (int r = 0; r < n; r++) t->by_host[t->host_start[t->host_of[r]] + t->local_index[r]] = r;
  t->host = t->host_of[me];
  t->uniform = true;
  for (int h = 1; h < t->nhosts; h++) t->uniform &= t->host_size[h] == t->host_size[0];
  t->leaders_overlap = leaders_may_overlap(t, n, blobs);
  return t;
}

/* This host's ranks over a shared-memory segment of their own. */
static tcc_result_t local_view_setup(tcc_comm_t *comm, tcc__topology_t *t, const tcc_blob_t *blobs,
                                     tcc_err_t *err) {
  const int n = comm->size, size = t->host_size[t->host];
  if (size < 2) return TCC_OK;
  int *members = calloc((size_t)size, sizeof *members);
  tcc_blob_t *local_blobs = calloc((size_t)size, sizeof *local_blobs);
  tcc_result_t r = TCC_OK;
  if (!members || !local_blobs) {
    r = tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", comm->name, comm->rank);
    goto out;
  }
  for (int q = 0, k = 0; q < n; q++)
    if (t->host_of[q] == t->host) {
      members[k] = q;
      local_blobs[k++] = blobs[q];
    }
  t->local = tcc__comm_view_new(comm, t->local_index[comm->rank], size, members, err);
  if (!t->local) r = err->code;
  if (r == TCC_OK) r = tcc__shm_setup(t->local, local_blobs, err);
  if (r == TCC_OK) r = tcc__coll_attach(t->local, err);
out:
  free(members);
  free(local_blobs);
  return r;
}

/* The ranks of every host that share this rank's local index, in host
 * order, over the group's TCP connections. */
static tcc_result_t cross_view_setup(tcc_comm_t *comm, tcc__topology_t *t, tcc_err_t *err) {
  const int n = comm->size, mine = t->local_index[comm->rank];
  int *members = calloc((size_t)t->nhosts, sizeof *members);
  if (!members) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", comm->name, comm->rank);
  int size = 0, me = 0;
  for (int h = 0; h < t->nhosts; h++)
    for (int q = 0; q < n; q++)
      if (t->host_of[q] == h && t->local_index[q] == mine) {
        if (q == comm->rank) me = size;
        members[size++] = q;
      }
  tcc_result_t r = TCC_OK;
  if (size >= 2) {
    t->cross = tcc__comm_view_new(comm, me, size, members, err);
    if (!t->cross) r = err->code;
    if (r == TCC_OK) r = tcc__hybrid_cross_attach(t->cross, comm, err);
    if (r == TCC_OK) r = tcc__coll_attach(t->cross, err);
  }
  free(members);
  return r;
}

/* INFO: how the group splits into hosts, so a log shows what runs where. */
static void log_topology(tcc_comm_t *comm, const tcc__topology_t *t) {
  char hosts[256];
  size_t used = 0;
  for (int h = 0; h < t->nhosts && used < sizeof hosts - 16; h++)
    used += (size_t)snprintf(hosts + used, sizeof hosts - used, "%s%d", h ? "+" : "", t->host_size[h]);
  TCC_LOG_INFO(comm->rank,
               "communicator '%s' spans %d hosts (ranks per host %s%s): this rank is on host %d at local "
               "index %d; shared memory with %d rank(s) of its host, TCP to the other hosts%s",
               comm->name, t->nhosts, hosts, t->uniform ? "" : ", uneven", t->host, t->local_index[comm->rank],
               t->host_size[t->host] - 1,
               t->uniform ? ""
               : t->leaders_overlap ? "; the leaders' allreduce overlaps the host phases (TCCOMM_HIER_OVERLAP)"
                                    : "; the leaders' allreduce runs in one piece (TCCOMM_HIER_OVERLAP)");
}

static void hybrid_destroy(tcc_comm_t *comm) {
  topology_free(comm->topo);
  comm->topo = NULL;
  tcc__tcp_transport_ops.destroy(comm);
}

/* The group failed: phases waiting in a view see it at their next check.
 * Announced, the failure reaches every rank that may be waiting on this
 * one: the ranks of its host through the local view's segment, the
 * others through the ends of its TCP connections. */
static void hybrid_failed(tcc_comm_t *comm, bool announce) {
  tcc__topology_t *t = comm->topo;
  if (t && t->local) tcc__comm_view_fail(t->local);
  if (t && t->cross) tcc__comm_view_fail(t->cross);
  if (!announce) return;
  if (t && t->local && t->local->ops && t->local->ops->failed) t->local->ops->failed(t->local, true);
  tcc__tcp_failed(comm, true);
}

static const tcc_transport_ops_t hybrid_ops = {
    .name = "shm+tcp",
    .streams = &tcc__tcp_streams,
    .p2p_write = tcc__hybrid_p2p_write,
    .p2p_read = tcc__hybrid_p2p_read,
    .p2p_fits = tcc__hybrid_p2p_fits,
    .p2p_direct = tcc__hybrid_p2p_direct,
    .p2p_peer_read = tcc__hybrid_p2p_peer_read,
    .p2p_wait = tcc__hybrid_p2p_wait,
    .p2p_notify = tcc__tcp_p2p_notify,
    .destroy = hybrid_destroy,
    .failed = hybrid_failed,
};

tcc_result_t tcc__hybrid_setup(tcc_comm_t *comm, tcc_endpoint_t *ep, const tcc_blob_t *blobs, tcc_err_t *err) {
  tcc__topology_t *t = topology_new(comm->size, comm->rank, blobs);
  if (!t)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", comm->name, comm->rank);
  /* The mesh first: every rank takes part in it, so a rank that never
   * arrives fails every rank's setup alike, within the timeout. */
  tcc_result_t r = tcc__tcp_setup(comm, ep, blobs, err);
  if (r == TCC_OK) r = local_view_setup(comm, t, blobs, err);
  if (r == TCC_OK) r = cross_view_setup(comm, t, err);
  comm->topo = t; /* the p2p relay reads it */
  if (r == TCC_OK) r = tcc__hybrid_p2p_start(comm, err);
  if (r != TCC_OK) {
    comm->topo = NULL;
    topology_free(t);
    if (comm->ops) comm->ops->destroy(comm);
    comm->ops = NULL;
    return r;
  }
  comm->ops = &hybrid_ops;
  if (TCC__LOG_ON(TCC__LOG_INFO)) log_topology(comm, t);
  return TCC_OK;
}
