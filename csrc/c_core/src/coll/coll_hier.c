/*
 * coll_hier.c - collectives on groups that span hosts, in phases on the
 * topology's views (transport.h): shared memory inside each host, the
 * hosts' TCP links between them.
 *
 * allreduce, hosts with equal rank counts: the host's ranks reduce-scatter
 *   over shared memory (local rank l holds the host's sum of shard l), each
 *   local rank allreduces its shard with the same local index on every
 *   other host (all local ranks at once, each on its own connections), and
 *   the host's ranks all-gather the shards. Every byte crosses a host's
 *   link once each way, the least an allreduce between hosts can send.
 * allreduce, uneven hosts: each host reduces to its leader (local index
 *   0), the leaders allreduce, each leader broadcasts to its host.
 * broadcast: the root's host broadcasts from the root, the leaders from
 *   the root's host leader, every other host from its leader.
 * allgather, hosts with equal rank counts: each rank gathers the blocks of
 *   the ranks with its local index on every host (across hosts, each local
 *   rank on its own connections), then the host's ranks all-gather those,
 *   one host's blocks at a time. Each block crosses each link once,
 *   instead of once per rank of the other host.
 * reduce_scatter, hosts with equal rank counts: for each host h, the
 *   host's ranks reduce-scatter the blocks destined for h's ranks (local
 *   rank l gets its host's sum of the block of h's rank l), then each rank
 *   reduce-scatters those partial sums with the ranks of its local index
 *   on the other hosts, ending with the sum of its own block.
 *
 * Every element is reduced in one fixed order on every rank: over the
 * ranks of its host in rank order, then over the hosts in the order of
 * their lowest rank, so every rank gets the same bits. Hierarchical
 * allgather and reduce_scatter need hosts of equal rank counts (each rank
 * has a partner of its local index on every host); on uneven hosts they
 * run flat. Reductions whose
 * result would change with a second rounding (float16/bfloat16, which
 * accumulate in float32 and round once) or that divide once at the end
 * (AVG) run flat, as do small messages, where the phases' latency costs
 * more than the network bytes they save, and the other collectives.
 *
 * Every hierarchical collective starts with the flat descriptor exchange
 * (tcc__coll_stream_agree), the same one the flat algorithms start with,
 * so ranks that disagree on an op fail alike, before any phase runs.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/coll_scratch.h"

/* Below this a message goes flat (the choice is made from the count every
 * rank agreed on, so every rank makes it alike). */
#define HIER_MIN_BYTES (64u << 10)
/* all_gather's phases (one per host within the host) cost more: measured
 * on 2 x 2 simulated hosts over 10 Gbit/s, flat is ahead up to 128 KiB of
 * output and behind from 256 KiB (381 against 406 us; 64 MiB: 49.5
 * against 79.2 ms). */
#define HIER_MIN_GATHER_BYTES (256u << 10)

static bool reduction_stages(const tcc_coll_t *c) {
  return c->dtype != TCC_FLOAT16 && c->dtype != TCC_BFLOAT16 && c->redop != TCC_AVG;
}

/* The size the choice goes by: a rank's input (allreduce, broadcast,
 * reduce_scatter) or output (allgather). */
static size_t op_bytes(const tcc_comm_t *comm, const tcc_coll_t *c) {
  size_t bytes = c->count * tcc_dtype_size(c->dtype);
  if (c->kind == TCC_COLL_ALLGATHER || c->kind == TCC_COLL_REDUCE_SCATTER) bytes *= (size_t)comm->size;
  return bytes;
}

bool tcc__coll_hier_chosen(const tcc_comm_t *comm, const tcc_coll_t *c) {
  if (!comm->topo || op_bytes(comm, c) < HIER_MIN_BYTES) return false;
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE: return reduction_stages(c);
    case TCC_COLL_BROADCAST: return true;
    case TCC_COLL_ALLGATHER: return comm->topo->uniform && op_bytes(comm, c) >= HIER_MIN_GATHER_BYTES;
    case TCC_COLL_REDUCE_SCATTER: return comm->topo->uniform && reduction_stages(c);
    default: return false;
  }
}

const char *tcc__coll_hier_algorithm(const tcc_comm_t *comm, const tcc_coll_t *c) {
  if (c->kind == TCC_COLL_BROADCAST) return "hierarchical broadcast (host, leaders, hosts)";
  if (c->kind == TCC_COLL_ALLGATHER) return "hierarchical allgather (across hosts by local index, then each host's blocks within the host)";
  if (c->kind == TCC_COLL_REDUCE_SCATTER)
    return "hierarchical reduce-scatter (each host's blocks within the host, then across hosts by local index)";
  return comm->topo->uniform ? "hierarchical allreduce (host reduce-scatter, cross-host allreduce, host all-gather)"
                             : "hierarchical allreduce (host reduce, leaders' allreduce, host broadcast)";
}

/* ---- phases ----------------------------------------------------------- */

static uint8_t *at(void *base, size_t off) { return (uint8_t *)base + off; }

/* One phase: a collective on a view (NULL: this rank has no part in it). */
static tcc_result_t phase(tcc_comm_t *view, const tcc_coll_t *c, uint64_t seq, int64_t deadline, tcc_err_t *err) {
  return view ? tcc__coll_run(view, c, seq, deadline, err) : TCC_OK;
}

/* A phase's collective: c's dtype and PREMUL_SUM factor, root 0. */
static tcc_coll_t reduction(tcc_coll_kind_t kind, const tcc_coll_t *c, tcc_redop_t redop, void *send, void *recv,
                            size_t count) {
  return (tcc_coll_t){.kind = kind, .dtype = c->dtype, .redop = redop, .premul = c->premul,
                      .count = count, .send = send, .recv = recv};
}

/* The op the phases after the first apply: they combine partial results,
 * already multiplied by PREMUL_SUM's factor. */
static tcc_redop_t later_op(tcc_redop_t op) { return op == TCC_PREMUL_SUM ? TCC_SUM : op; }

static tcc_result_t allreduce_by_shards(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                        tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  tcc_comm_t *local = t->local, *cross = t->cross;
  const int L = local->size, l = local->rank;
  const size_t es = tcc_dtype_size(c->dtype), shard = c->count / (size_t)L, main = shard * (size_t)L;
  /* [L] pointers into send / recv: the group's own scratch, which no
   * phase touches (each view runs on its own). */
  void **parts = (void **)coll_scratch_of(comm)->part_out;
  tcc_result_t r = TCC_OK;
  if (shard > 0) {
    for (int j = 0; j < L; j++) parts[j] = at(c->send, (size_t)j * shard * es);
    tcc_coll_t rs = reduction(TCC_COLL_REDUCE_SCATTER, c, c->redop, NULL, at(c->recv, (size_t)l * shard * es), shard);
    rs.sends = parts;
    r = phase(local, &rs, seq, deadline, err);
    tcc_coll_t ar = reduction(TCC_COLL_ALLREDUCE, c, later_op(c->redop), rs.recv, rs.recv, shard);
    if (r == TCC_OK) r = phase(cross, &ar, seq, deadline, err);
    for (int j = 0; j < L; j++) parts[j] = at(c->recv, (size_t)j * shard * es);
    tcc_coll_t ag = reduction(TCC_COLL_ALLGATHER, c, c->redop, rs.recv, NULL, shard);
    ag.recvs = parts;
    if (r == TCC_OK) r = phase(local, &ag, seq, deadline, err);
  }
  /* The count % L elements left: the same order, host first. */
  if (r == TCC_OK && main < c->count) {
    tcc_coll_t host = reduction(TCC_COLL_ALLREDUCE, c, c->redop, at(c->send, main * es), at(c->recv, main * es),
                                c->count - main);
    r = phase(local, &host, seq, deadline, err);
    tcc_coll_t hosts = reduction(TCC_COLL_ALLREDUCE, c, later_op(c->redop), host.recv, host.recv, host.count);
    if (r == TCC_OK) r = phase(cross, &hosts, seq, deadline, err);
  }
  return r;
}

static tcc_result_t allreduce_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                         tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const bool leader = t->local_index[comm->rank] == 0;
  tcc_result_t r = TCC_OK;
  if (t->local) {
    tcc_coll_t host = reduction(TCC_COLL_REDUCE, c, c->redop, c->send, c->recv, c->count);
    r = phase(t->local, &host, seq, deadline, err);
  } else if (c->redop == TCC_PREMUL_SUM) { /* alone on its host: the factor is still applied once */
    const void *src = c->send;
    tcc__reduce_n(c->recv, &src, 1, c->count, c->dtype, TCC_PREMUL_SUM, c->premul);
  } else if (c->send != c->recv) {
    memcpy(c->recv, c->send, c->count * tcc_dtype_size(c->dtype));
  }
  if (r == TCC_OK && leader) {
    tcc_coll_t hosts = reduction(TCC_COLL_ALLREDUCE, c, later_op(c->redop), c->recv, c->recv, c->count);
    r = phase(t->cross, &hosts, seq, deadline, err);
  }
  if (r == TCC_OK) {
    tcc_coll_t spread = {.kind = TCC_COLL_BROADCAST, .dtype = c->dtype, .count = c->count, .root = 0,
                         .send = c->recv, .recv = c->recv};
    r = phase(t->local, &spread, seq, deadline, err);
  }
  return r;
}

static tcc_result_t broadcast(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                              tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int root_host = t->host_of[c->root];
  const bool leader = t->local_index[comm->rank] == 0;
  void *buf = c->recv ? c->recv : c->send;
  tcc_coll_t b = {.kind = TCC_COLL_BROADCAST, .dtype = c->dtype, .count = c->count, .send = buf, .recv = buf};
  tcc_result_t r = TCC_OK;
  if (t->host == root_host) {
    b.root = t->local_index[c->root];
    r = phase(t->local, &b, seq, deadline, err);
  }
  /* The leaders' view holds one rank per host, in host order. */
  if (r == TCC_OK && leader) {
    b.root = root_host;
    r = phase(t->cross, &b, seq, deadline, err);
  }
  if (r == TCC_OK && t->host != root_host) {
    b.root = 0;
    r = phase(t->local, &b, seq, deadline, err);
  }
  return r;
}

/* Rank of host h at local index i. */
static int rank_at(const tcc__topology_t *t, int h, int i) { return t->by_host[t->host_start[h] + i]; }

static tcc_result_t allgather(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int H = t->nhosts, L = t->local->size, l = t->local->rank;
  void **parts = (void **)coll_scratch_of(comm)->part_out; /* [size]: H, then L pointers */
  for (int h = 0; h < H; h++) parts[h] = c->recvs[rank_at(t, h, l)];
  tcc_coll_t across = {.kind = TCC_COLL_ALLGATHER, .dtype = c->dtype, .count = c->count, .send = c->send,
                       .recvs = parts};
  tcc_result_t r = phase(t->cross, &across, seq, deadline, err);
  for (int h = 0; h < H && r == TCC_OK; h++) {
    for (int i = 0; i < L; i++) parts[i] = c->recvs[rank_at(t, h, i)];
    tcc_coll_t within = {.kind = TCC_COLL_ALLGATHER, .dtype = c->dtype, .count = c->count, .send = parts[l],
                         .recvs = parts};
    r = phase(t->local, &within, seq, deadline, err);
  }
  return r;
}

/* The partials buffer, at least `bytes` long (NULL: out of memory). */
static void *partials(tcc_comm_t *comm, size_t bytes) {
  tcc__coll_scratch_t *s = coll_scratch_of(comm);
  if (s->partials_bytes < bytes) {
    free(s->partials);
    s->partials = malloc(bytes);
    s->partials_bytes = s->partials ? bytes : 0;
  }
  return s->partials;
}

static tcc_result_t reduce_scatter(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                   tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int H = t->nhosts, L = t->local->size;
  const size_t block = c->count * tcc_dtype_size(c->dtype);
  uint8_t *sums = partials(comm, (size_t)H * block); /* [H] this host's sum of block (h, l) */
  if (!sums && block > 0)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm reduce_scatter #%llu on '%s' (rank %d): out of memory",
                        (unsigned long long)seq, comm->name, comm->rank);
  void **parts = (void **)coll_scratch_of(comm)->part_out; /* [size]: L, then H pointers */
  tcc_result_t r = TCC_OK;
  for (int h = 0; h < H && r == TCC_OK; h++) {
    for (int i = 0; i < L; i++) parts[i] = c->sends[rank_at(t, h, i)];
    tcc_coll_t within = reduction(TCC_COLL_REDUCE_SCATTER, c, c->redop, NULL, sums + (size_t)h * block, c->count);
    within.sends = parts;
    r = phase(t->local, &within, seq, deadline, err);
  }
  for (int h = 0; h < H; h++) parts[h] = sums + (size_t)h * block;
  tcc_coll_t across = reduction(TCC_COLL_REDUCE_SCATTER, c, later_op(c->redop), NULL, c->recv, c->count);
  across.sends = parts;
  if (r == TCC_OK) r = phase(t->cross, &across, seq, deadline, err);
  return r;
}

tcc_result_t tcc__coll_hier_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                tcc_err_t *err) {
  tcc_result_t r = tcc__coll_stream_agree(comm, c, seq, deadline_ns, err);
  if (r != TCC_OK) return r;
  tcc_coll_t staged;
  void *mem = NULL;
  if (!tcc__coll_snapshot_inputs(c, comm->size, comm->rank, &staged, &mem))
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s #%llu on '%s' (rank %d): out of memory",
                        tcc__coll_name(c->kind), (unsigned long long)seq, comm->name, comm->rank);
  if (staged.kind == TCC_COLL_BROADCAST) r = broadcast(comm, &staged, seq, deadline_ns, err);
  else if (staged.kind == TCC_COLL_ALLGATHER) r = allgather(comm, &staged, seq, deadline_ns, err);
  else if (staged.kind == TCC_COLL_REDUCE_SCATTER) r = reduce_scatter(comm, &staged, seq, deadline_ns, err);
  else if (comm->topo->uniform) r = allreduce_by_shards(comm, &staged, seq, deadline_ns, err);
  else r = allreduce_by_leaders(comm, &staged, seq, deadline_ns, err);
  free(mem);
  /* The descriptors agreed, so a phase cannot disagree; whatever failed in
   * one left the ranks out of step: the group must fail. */
  if (r == TCC_ERR_MISMATCH || r == TCC_ERR_INVALID || r == TCC_ERR_UNSUPPORTED) r = TCC_ERR_REMOTE;
  /* The phase's message names the phase's op; the caller knows its own. */
  if (r != TCC_OK)
    tcc__err_prefix(err, r, "tccomm %s #%llu on '%s' (rank %d), in a hierarchical phase: ", tcc__coll_name(c->kind),
                    (unsigned long long)seq, comm->name, comm->rank);
  return r;
}
