/*
 * coll_hier.c - collectives on groups that span hosts, in phases on the
 * topology's views (transport.h): shared memory inside each host, the
 * hosts' TCP links between them. This file chooses, runs broadcast, and
 * runs the others on hosts with equal rank counts, where each rank has a
 * partner of its local index on every host; on uneven hosts they go
 * through each host's leader (coll_hier_leaders.c).
 *
 * allreduce: the host's ranks reduce-scatter over shared memory (local
 *   rank l holds the host's sum of shard l), each local rank allreduces
 *   its shard with the same local index on every other host (all local
 *   ranks at once, each on its own connections), and the host's ranks
 *   all-gather the shards. Every byte crosses a host's link once each
 *   way, the least an allreduce between hosts can send. From 8 MiB the
 *   shards go in 4 MiB segments, the cross-host phase of one on a thread
 *   of its own while the host's ranks reduce-scatter the next and
 *   all-gather the one before: the link and shared memory work at the
 *   same time.
 * broadcast (any hosts): the root's host broadcasts from the root, the
 *   leaders from the root's host leader, every other host from its leader.
 * allgather: each rank gathers the blocks of the ranks with its local
 *   index on every host (across hosts, each local rank on its own
 *   connections), then the host's ranks all-gather those, one host's
 *   blocks at a time. Each block crosses each link once, instead of once
 *   per rank of the other host.
 * reduce: every host reduces to its rank of the root's local index, and
 *   those ranks reduce across hosts to the root. Each host's link carries
 *   the message once.
 * alltoall: coll_hier_alltoall.c.
 * reduce_scatter: for each host h, the host's ranks reduce-scatter the
 *   blocks destined for h's ranks (local rank l gets its host's sum of the
 *   block of h's rank l), then each rank reduce-scatters those partial
 *   sums with the ranks of its local index on the other hosts, ending with
 *   the sum of its own block.
 *
 * Every element is reduced in one fixed order on every rank: over the
 * ranks of its host in rank order, then over the hosts in the order of
 * their lowest rank, so every rank gets the same bits. AVG sums in that
 * order and divides once, where the sum is complete. float16/bfloat16,
 * which accumulate in float32 and round once, would change with a second
 * rounding: their allreduce runs its phases on a float32 copy and rounds
 * once (coll_hier_half.c), where that still leaves the links less to
 * carry than the flat exchange; otherwise they run flat, as their other reductions do, as do small messages,
 * where the phases' latency costs more than the network bytes they save,
 * and the other collectives.
 *
 * Every hierarchical collective starts with the flat descriptor exchange
 * (tcc__coll_stream_agree), the same one the flat algorithms start with,
 * so ranks that disagree on an op fail alike, before any phase runs.
 */
#include <string.h>

#include "coll/hier_phase.h"

/* Below this a message goes flat (the choice is made from the count every
 * rank agreed on, so every rank makes it alike). */
#define HIER_MIN_BYTES (64u << 10)
/* all_gather's phases (one per host within the host) cost more: measured
 * on 2 x 2 simulated hosts over 10 Gbit/s, flat is ahead up to 128 KiB of
 * output and behind from 256 KiB (381 against 406 us; 64 MiB: 49.5
 * against 79.2 ms). */
#define HIER_MIN_GATHER_BYTES (256u << 10)
/* On uneven hosts the leaders' all_gather and reduce_scatter run their
 * phases one after another where the flat ring overlaps everything:
 * measured on simulated hosts of 2 + 1, 1 + 3 and 3 + 2 ranks over
 * 10 Gbit/s, flat is ahead or even up to 1 MiB and behind from 2 MiB
 * (bench/README.md). */
#define HIER_MIN_UNEVEN_BYTES (2u << 20)

static bool reduction_stages(const tcc_coll_t *c) { return c->dtype != TCC_FLOAT16 && c->dtype != TCC_BFLOAT16; }


/* The size the choice goes by: a rank's input (allreduce, broadcast,
 * reduce_scatter) or output (allgather). */
static size_t op_bytes(const tcc_comm_t *comm, const tcc_coll_t *c) {
  size_t bytes = c->count * tcc__dtype_size(c->dtype);
  if (c->kind == TCC_COLL_ALLGATHER || c->kind == TCC_COLL_REDUCE_SCATTER) bytes *= (size_t)comm->size;
  return bytes;
}

bool tcc__coll_hier_chosen(const tcc_comm_t *comm, const tcc_coll_t *c) {
  /* all-to-all chooses by its blocks, once every rank's counts are known */
  if (comm->topo && c->kind == TCC_COLL_ALLTOALL) return true;
  if (!comm->topo || op_bytes(comm, c) < HIER_MIN_BYTES) return false;
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE: return reduction_stages(c) || tcc__hier_widening_pays(comm);
    case TCC_COLL_BROADCAST: return true;
    case TCC_COLL_ALLGATHER:
      return op_bytes(comm, c) >= (comm->topo->uniform ? HIER_MIN_GATHER_BYTES : HIER_MIN_UNEVEN_BYTES);
    case TCC_COLL_REDUCE: return reduction_stages(c);
    case TCC_COLL_REDUCE_SCATTER:
      if (comm->topo->uniform) return reduction_stages(c);
      return reduction_stages(c) && op_bytes(comm, c) >= HIER_MIN_UNEVEN_BYTES &&
             tcc__hier_leaders_relieve_links(comm->topo, comm->size);
    default: return false;
  }
}

const char *tcc__coll_hier_algorithm(const tcc_comm_t *comm, const tcc_coll_t *c) {
  const bool even = comm->topo->uniform;
  switch (c->kind) {
    case TCC_COLL_ALLTOALL:
      return "all-to-all aggregated per host through leaders when every block is small, else direct between ranks";
    case TCC_COLL_BROADCAST: return "hierarchical broadcast (host, leaders, hosts)";
    case TCC_COLL_ALLGATHER:
      return even ? "hierarchical allgather (across hosts by local index, then each host's blocks within the host)"
                  : "hierarchical allgather (within each host, each host's blocks across the leaders, then to each "
                    "host from its leader)";
    case TCC_COLL_REDUCE_SCATTER:
      return even ? "hierarchical reduce-scatter (each host's blocks within the host, then across hosts by local index)"
                  : "hierarchical reduce-scatter (within each host to its leader, each host's blocks across the "
                    "leaders to its leader, then scattered within the host)";
    case TCC_COLL_REDUCE:
      return even ? "hierarchical reduce (within each host to the root's local index, then across hosts to the root)"
                  : "hierarchical reduce (within each host to its leader, leaders to the root's leader, then to the root)";
    default:
      if (!reduction_stages(c))
        return even ? "hierarchical allreduce in float32, rounded once (host reduce-scatter and cross-host "
                      "reduce-scatter in float32, cross-host and host all-gathers of the rounded sums)"
                    : "hierarchical allreduce in float32, rounded once (host reduce, leaders' allreduce, host "
                      "broadcast)";
      return even ? "hierarchical allreduce (host reduce-scatter, cross-host allreduce, host all-gather)"
                  : "hierarchical allreduce (host reduce, leaders' allreduce, host broadcast)";
  }
}

/* ---- allreduce --------------------------------------------------------- */

tcc_result_t tcc__hier_shard_reduce_scatter(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err) {
  const int L = comm->topo->local->size, l = comm->topo->local->rank;
  const size_t es = tcc__dtype_size(seg->sum->dtype), off = seg->first - (size_t)l * seg->shard;
  void **parts = (void **)coll_scratch_of(comm)->part_out;
  for (int i = 0; i < L; i++) parts[i] = at(seg->sum->send, ((size_t)i * seg->shard + off) * es);
  tcc_coll_t rs = reduction(TCC_COLL_REDUCE_SCATTER, seg->sum, seg->sum->redop, NULL,
                            at(seg->sum->recv, seg->first * es), seg->len);
  rs.sends = parts;
  return phase(comm->topo->local, &rs, seg->seq, seg->deadline, err);
}

tcc_result_t tcc__hier_shard_allgather(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err) {
  const int L = comm->topo->local->size, l = comm->topo->local->rank;
  const size_t es = tcc__dtype_size(seg->out->dtype), off = seg->first - (size_t)l * seg->shard;
  void **parts = (void **)coll_scratch_of(comm)->part_out;
  for (int i = 0; i < L; i++) parts[i] = at(seg->out->recv, ((size_t)i * seg->shard + off) * es);
  tcc_coll_t ag = reduction(TCC_COLL_ALLGATHER, seg->out, seg->out->redop, parts[l], NULL, seg->len);
  ag.recvs = parts;
  return phase(comm->topo->local, &ag, seg->seq, seg->deadline, err);
}

/* Starts `across` of seg: on the pipe's thread, or here and now. */
static tcc_result_t start_across(tcc_comm_t *comm, tcc__hier_pipe_t *pipe, const tcc__hier_job_t *seg,
                                 tcc_err_t *err) {
  if (pipe) {
    tcc__hier_pipe_post(pipe, seg);
    return TCC_OK;
  }
  return seg->run(comm, seg, (void **)coll_scratch_of(comm)->part_out, err);
}

tcc_result_t tcc__hier_in_segments(tcc_comm_t *comm, const hier_steps_t *steps, const tcc__hier_job_t *whole,
                                   size_t span, size_t nseg, tcc_err_t *err) {
  const size_t sub = (span + nseg - 1) / nseg;
  tcc__hier_pipe_t *pipe = nseg > 1 && steps->across ? tcc__hier_pipe_of(comm) : NULL;
  tcc_result_t r = TCC_OK;
  bool in_flight = false;
  tcc__hier_job_t prev = *whole;
  for (size_t k = 0; k * sub < span && r == TCC_OK; k++) {
    tcc__hier_job_t seg = *whole;
    seg.run = steps->across;
    seg.first = whole->first + k * sub;
    seg.len = sub < span - k * sub ? sub : span - k * sub;
    r = steps->before(comm, &seg, err);
    if (in_flight) {
      tcc_result_t done = tcc__hier_pipe_wait(pipe, err);
      in_flight = false;
      if (r == TCC_OK) r = done;
    }
    if (r == TCC_OK && seg.run) {
      r = start_across(comm, pipe, &seg, err);
      in_flight = pipe != NULL;
    }
    if (r == TCC_OK && k > 0) r = steps->after(comm, &prev, err);
    prev = seg;
  }
  if (in_flight) {
    tcc_result_t done = tcc__hier_pipe_wait(pipe, err); /* its buffers are the caller's: never left running */
    if (r == TCC_OK) r = done;
  }
  if (r == TCC_OK) r = steps->after(comm, &prev, err);
  return r;
}

/* The cross-host part of a segment of an allreduce whose phases reduce in
 * its own type: this rank's part allreduced with the ranks of its local
 * index on the other hosts, then averaged if AVG (the sum is complete). */
static tcc_result_t allreduce_across(tcc_comm_t *comm, const tcc__hier_job_t *j, void **parts, tcc_err_t *err) {
  (void)parts;
  void *mine = at(j->sum->recv, j->first * tcc__dtype_size(j->sum->dtype));
  tcc_coll_t ar = reduction(TCC_COLL_ALLREDUCE, j->sum, later_op(j->sum->redop), mine, mine, j->len);
  tcc_result_t r = phase(comm->topo->cross, &ar, j->seq, j->deadline, err);
  if (r == TCC_OK) average(comm, j->sum, mine, j->len);
  return r;
}

static tcc_result_t allreduce_by_shards(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                        tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  tcc_comm_t *local = t->local;
  const int L = local->size;
  const size_t es = tcc__dtype_size(c->dtype), shard = c->count / (size_t)L, main = shard * (size_t)L;
  tcc_result_t r = TCC_OK;
  if (shard > 0) {
    static const hier_steps_t steps = {tcc__hier_shard_reduce_scatter, allreduce_across, tcc__hier_shard_allgather};
    const tcc__hier_job_t whole = {.out = c, .sum = c, .first = (size_t)local->rank * shard, .shard = shard,
                                   .seq = seq, .deadline = deadline};
    r = tcc__hier_in_segments(comm, &steps, &whole, shard, hier_segment_count(main * es), err);
  }
  /* The count % L elements left: the same order, host first. */
  if (r == TCC_OK && main < c->count) {
    tcc_coll_t host = reduction(TCC_COLL_ALLREDUCE, c, c->redop, at(c->send, main * es), at(c->recv, main * es),
                                c->count - main);
    r = phase(local, &host, seq, deadline, err);
    tcc_coll_t hosts = reduction(TCC_COLL_ALLREDUCE, c, later_op(c->redop), host.recv, host.recv, host.count);
    if (r == TCC_OK) r = phase(t->cross, &hosts, seq, deadline, err);
    if (r == TCC_OK) average(comm, c, host.recv, host.count);
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

static tcc_result_t reduce_scatter(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                   tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int H = t->nhosts, L = t->local->size;
  const size_t block = c->count * tcc__dtype_size(c->dtype);
  uint8_t *sums = partials(comm, (size_t)H * block); /* [H] this host's sum of block (h, l) */
  if (!sums && block > 0) return out_of_memory(comm, c, seq, err);
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
  if (r == TCC_OK) average(comm, c, c->recv, c->count);
  return r;
}

static tcc_result_t reduce(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int gather_at = t->local_index[c->root]; /* on every host */
  const bool collects = t->local->rank == gather_at;
  void *sum = c->recv; /* the root's output; the other collectors' partials */
  if (collects && comm->rank != c->root) {
    sum = partials(comm, c->count * tcc__dtype_size(c->dtype));
    if (!sum && c->count > 0) return out_of_memory(comm, c, seq, err);
  }
  tcc_coll_t host = reduction(TCC_COLL_REDUCE, c, c->redop, c->send, collects ? sum : NULL, c->count);
  host.root = gather_at;
  tcc_result_t r = phase(t->local, &host, seq, deadline, err);
  if (r != TCC_OK || !collects) return r;
  /* The collectors' view holds one rank per host, in host order. */
  tcc_coll_t hosts = reduction(TCC_COLL_REDUCE, c, later_op(c->redop), sum, comm->rank == c->root ? sum : NULL,
                               c->count);
  hosts.root = t->host_of[c->root];
  r = phase(t->cross, &hosts, seq, deadline, err);
  if (r == TCC_OK && comm->rank == c->root) average(comm, c, sum, c->count);
  return r;
}

tcc_result_t tcc__coll_hier_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                tcc_err_t *err) {
  if (c->kind == TCC_COLL_ALLTOALL) return tcc__coll_hier_alltoall(comm, c, seq, deadline_ns, err);
  tcc_result_t r = tcc__coll_stream_agree(comm, c, seq, deadline_ns, NULL, err);
  if (r != TCC_OK) return r;
  tcc_coll_t staged;
  void *mem = NULL;
  if (!tcc__coll_snapshot_inputs(c, comm->size, comm->rank, &staged, &mem)) return out_of_memory(comm, c, seq, err);
  if (staged.kind == TCC_COLL_BROADCAST) r = broadcast(comm, &staged, seq, deadline_ns, err);
  else if (staged.kind == TCC_COLL_ALLREDUCE && !reduction_stages(&staged))
    r = tcc__coll_hier_allreduce_half(comm, &staged, seq, deadline_ns, err);
  else if (!comm->topo->uniform) r = tcc__coll_hier_by_leaders(comm, &staged, seq, deadline_ns, err);
  else if (staged.kind == TCC_COLL_ALLGATHER) r = allgather(comm, &staged, seq, deadline_ns, err);
  else if (staged.kind == TCC_COLL_REDUCE_SCATTER) r = reduce_scatter(comm, &staged, seq, deadline_ns, err);
  else if (staged.kind == TCC_COLL_REDUCE) r = reduce(comm, &staged, seq, deadline_ns, err);
  else r = allreduce_by_shards(comm, &staged, seq, deadline_ns, err);
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
