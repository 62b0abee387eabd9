/*
 * coll_hier_leaders.c - hierarchical collectives on hosts with different
 * rank counts (coll_hier.c runs them on even hosts). A rank has no partner
 * of its local index on every host there, so only each host's leader (its
 * first rank) talks across hosts, for its whole host; the leaders' view
 * holds one rank per host, in host order.
 *
 * allreduce: each host reduces to its leader, the leaders allreduce, each
 *   leader broadcasts to its host (as steps of tcc__hier_in_segments, in
 *   one segment: see allreduce_by_leaders).
 * reduce: each host reduces to its leader, the leaders reduce to the root's
 *   host's leader, which hands the root the result (a broadcast within
 *   that host, unless the root is the leader).
 * allgather: the host's ranks all-gather their blocks; the leaders
 *   exchange their hosts' blocks (an all-to-all among them, so each link
 *   carries both ways at once), and each leader broadcasts every other
 *   host's blocks to its host. Each block crosses to each other host once,
 *   instead of once per rank there.
 * reduce_scatter: the host's ranks reduce-scatter their own host's blocks
 *   (each rank gets its host's sum of its block) and reduce the other
 *   hosts' blocks to the leader; the leaders exchange those sums (an
 *   all-to-all), each scatters what came for its host's ranks, and each
 *   rank sums its block's partials of every host in host order. Chosen
 *   only where that exchange loads the busiest link less than a flat ring
 *   (tcc__hier_leaders_relieve_links): not with a rank alone on one of two
 *   hosts, where both send size - 1 blocks one way.
 *
 * The sum keeps the order coll_hier.c documents: a host's ranks in rank
 * order, then the hosts in the order of their lowest rank.
 *
 * A host's blocks go as one message, in the host's rank order. Where a
 * rank's buffers for them do not lie back to back in that order (ranks of
 * one host that are not consecutive, outputs given as separate tensors),
 * they pass through the partials buffer.
 */
#include <string.h>

#include "coll/hier_phase.h"
#include "core/copy.h"

/* A rank's own input (count elements at src) as its host's partial when
 * it is alone on its host: PREMUL_SUM's factor applied, as the host phase
 * would have. */
static void own_partial(const tcc_coll_t *c, const void *src, void *out, size_t count) {
  if (c->redop == TCC_PREMUL_SUM) tcc__reduce_n(out, &src, 1, count, c->dtype, TCC_PREMUL_SUM, c->premul);
  else if (src != out) tcc__copy(out, src, count * tcc__dtype_size(c->dtype));
}

/* allreduce, segment by segment (coll_hier.c runs the steps): the host's
 * sum of the segment to its leader; the leaders' allreduce of it; the
 * leader's broadcast of the result to its host. */
static tcc_result_t leaders_reduce(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err) {
  const tcc_coll_t *c = seg->out;
  const size_t off = seg->first * tcc__dtype_size(c->dtype);
  if (!comm->topo->local) {
    own_partial(c, at(c->send, off), at(c->recv, off), seg->len);
    return TCC_OK;
  }
  tcc_coll_t host = reduction(TCC_COLL_REDUCE, c, c->redop, at(c->send, off), at(c->recv, off), seg->len);
  return phase(comm->topo->local, &host, seg->seq, seg->deadline, err);
}

static tcc_result_t leaders_allreduce(tcc_comm_t *comm, const tcc__hier_job_t *seg, void **parts, tcc_err_t *err) {
  (void)parts;
  const tcc_coll_t *c = seg->out;
  void *mine = at(c->recv, seg->first * tcc__dtype_size(c->dtype));
  tcc_coll_t hosts = reduction(TCC_COLL_ALLREDUCE, c, later_op(c->redop), mine, mine, seg->len);
  tcc_result_t r = phase(comm->topo->cross, &hosts, seg->seq, seg->deadline, err);
  if (r == TCC_OK) average(comm, c, mine, seg->len);
  return r;
}

static tcc_result_t leaders_broadcast(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err) {
  const tcc_coll_t *c = seg->out;
  void *mine = at(c->recv, seg->first * tcc__dtype_size(c->dtype));
  tcc_coll_t spread = {.kind = TCC_COLL_BROADCAST, .dtype = c->dtype, .count = seg->len, .root = 0, .send = mine,
                       .recv = mine};
  return phase(comm->topo->local, &spread, seg->seq, seg->deadline, err);
}

static tcc_result_t allreduce_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                         tcc_err_t *err) {
  const bool leader = comm->topo->local_index[comm->rank] == 0;
  const hier_steps_t steps = {leaders_reduce, leader ? leaders_allreduce : NULL, leaders_broadcast};
  const tcc__hier_job_t whole = {.out = c, .sum = c, .seq = seq, .deadline = deadline};
  /* Segments overlap the leaders' allreduce with the host's phases only
   * where the machines have a CPU for the leaders' threads
   * (transport.h, tcc__hier_overlap_t). */
  const size_t nseg = comm->topo->leaders_overlap ? hier_segment_count(c->count * tcc__dtype_size(c->dtype)) : 1;
  return tcc__hier_in_segments(comm, &steps, &whole, c->count, nseg, err);
}

static tcc_result_t reduce_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                      tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const bool leader = t->local_index[comm->rank] == 0, root_host = t->host == t->host_of[c->root];
  /* Where a leader's host sum goes, and where the ranks of the root's host
   * take the result their leader hands the root: the root's output, or the
   * partials. */
  void *sum = c->recv;
  if (comm->rank != c->root && (leader || (root_host && t->local_index[c->root] != 0))) {
    sum = partials(comm, c->count * tcc__dtype_size(c->dtype));
    if (!sum && c->count > 0) return out_of_memory(comm, c, seq, err);
  }
  tcc_result_t r = TCC_OK;
  if (t->local) {
    tcc_coll_t host = reduction(TCC_COLL_REDUCE, c, c->redop, c->send, leader ? sum : NULL, c->count);
    r = phase(t->local, &host, seq, deadline, err);
  } else {
    own_partial(c, c->send, sum, c->count);
  }
  /* The leaders' view holds one rank per host, in host order. */
  if (r == TCC_OK && leader) {
    tcc_coll_t hosts = reduction(TCC_COLL_REDUCE, c, later_op(c->redop), sum, root_host ? sum : NULL, c->count);
    hosts.root = t->host_of[c->root];
    r = phase(t->cross, &hosts, seq, deadline, err);
  }
  if (r == TCC_OK && root_host && t->local_index[c->root] != 0) {
    tcc_coll_t hand = {.kind = TCC_COLL_BROADCAST, .dtype = c->dtype, .count = c->count, .root = 0, .send = sum,
                       .recv = sum};
    r = phase(t->local, &hand, seq, deadline, err);
  }
  if (r == TCC_OK && comm->rank == c->root) average(comm, c, sum, c->count);
  return r;
}

/* The blocks of positions [k0, k1) of the host order (by_host) as one
 * buffer: the ranks' own buffers in bufs when they lie back to back in
 * that order, else NULL. */
static uint8_t *adjacent(const tcc__topology_t *t, void *const *bufs, int k0, int k1, size_t block) {
  uint8_t *first = bufs[t->by_host[k0]];
  for (int k = k0 + 1; k < k1; k++)
    if ((uint8_t *)bufs[t->by_host[k]] != first + (size_t)(k - k0) * block) return NULL;
  return first;
}

static void pack(const tcc__topology_t *t, void *const *bufs, int k0, int k1, size_t block, uint8_t *dst) {
  for (int k = k0; k < k1; k++) tcc__copy(dst + (size_t)(k - k0) * block, bufs[t->by_host[k]], block);
}

static void unpack(const tcc__topology_t *t, void *const *bufs, int k0, int k1, size_t block, const uint8_t *src) {
  for (int k = k0; k < k1; k++) tcc__copy(bufs[t->by_host[k]], src + (size_t)(k - k0) * block, block);
}

/* The leaders' exchange, an all-to-all on their view (one rank per host,
 * in host order), so each link carries its messages both ways at once:
 * this leader sends sends[g] (send_counts[g] elements) to host g's leader
 * and receives recv_counts[g] elements from it at recvs[g]. Entries of
 * this rank's own host are not used. */
typedef struct leaders_exchange {
  void **sends, **recvs;
  size_t *send_counts, *recv_counts;
} leaders_exchange_t;

static bool exchange_alloc(leaders_exchange_t *x, int nhosts) {
  void **ptrs = calloc((size_t)nhosts * 2, sizeof *ptrs);
  size_t *counts = calloc((size_t)nhosts * 2, sizeof *counts);
  if (!ptrs || !counts) {
    free(ptrs);
    free(counts);
    return false;
  }
  *x = (leaders_exchange_t){ptrs, ptrs + nhosts, counts, counts + nhosts};
  return true;
}

static void exchange_free(leaders_exchange_t *x) {
  free(x->sends);
  free(x->send_counts);
}

static tcc_result_t exchange_run(tcc_comm_t *comm, const tcc_coll_t *c, leaders_exchange_t *x, uint64_t seq,
                                 int64_t deadline, tcc_err_t *err) {
  const int h = comm->topo->host;
  x->send_counts[h] = x->recv_counts[h] = 0;
  tcc_coll_t a2a = {.kind = TCC_COLL_ALLTOALL, .dtype = c->dtype, .sends = x->sends, .recvs = x->recvs,
                    .send_counts = x->send_counts, .recv_counts = x->recv_counts};
  return phase(comm->topo->cross, &a2a, seq, deadline, err);
}

static tcc_result_t allgather_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                         tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int H = t->nhosts, h = t->host;
  const bool leader = t->local_index[comm->rank] == 0;
  const size_t block = c->count * tcc__dtype_size(c->dtype);
  tcc_result_t r = TCC_OK;
  if (t->local) {
    void **parts = (void **)coll_scratch_of(comm)->part_out;
    for (int i = 0; i < t->local->size; i++) parts[i] = c->recvs[rank_at(t, h, i)];
    tcc_coll_t within = {.kind = TCC_COLL_ALLGATHER, .dtype = c->dtype, .count = c->count, .send = c->send,
                         .recvs = parts};
    r = phase(t->local, &within, seq, deadline, err);
  } else if (c->recvs[comm->rank] != c->send) {
    tcc__copy(c->recvs[comm->rank], c->send, block);
  }
  /* Each host's blocks as one run: where the output holds them back to
   * back in host order, else in the partials buffer (at their place in
   * host order). */
  leaders_exchange_t x;
  if (!exchange_alloc(&x, H)) return out_of_memory(comm, c, seq, err);
  uint8_t *stage = NULL;
  for (int g = 0; g < H && r == TCC_OK; g++) {
    const int k0 = t->host_start[g];
    x.recvs[g] = adjacent(t, c->recvs, k0, k0 + t->host_size[g], block);
    if (!x.recvs[g] && !stage && !(stage = partials(comm, (size_t)comm->size * block))) r = out_of_memory(comm, c, seq, err);
    if (!x.recvs[g] && stage) x.recvs[g] = stage + (size_t)k0 * block;
    x.recv_counts[g] = (size_t)t->host_size[g] * c->count;
  }
  const bool mine_staged = r == TCC_OK && stage && x.recvs[h] == stage + (size_t)t->host_start[h] * block;
  if (r == TCC_OK && leader) {
    if (mine_staged) pack(t, c->recvs, t->host_start[h], t->host_start[h] + t->host_size[h], block, x.recvs[h]);
    for (int g = 0; g < H; g++) {
      x.sends[g] = x.recvs[h];
      x.send_counts[g] = x.recv_counts[h];
    }
    r = exchange_run(comm, c, &x, seq, deadline, err);
  }
  for (int g = 0; g < H && r == TCC_OK; g++) {
    if (g == h) continue;
    tcc_coll_t b = {.kind = TCC_COLL_BROADCAST, .dtype = c->dtype, .count = x.recv_counts[g], .root = 0,
                    .send = x.recvs[g], .recv = x.recvs[g]};
    r = phase(t->local, &b, seq, deadline, err);
    const int k0 = t->host_start[g];
    if (r == TCC_OK && stage && x.recvs[g] == stage + (size_t)k0 * block)
      unpack(t, c->recvs, k0, k0 + t->host_size[g], block, x.recvs[g]);
  }
  exchange_free(&x);
  return r;
}

/* Host g's sum of the blocks of g's ranks, reduced within this host to
 * its leader's `sums` at their place in host order (a rank alone on its
 * host takes its own input). The blocks go as one run: the input's own
 * memory where it holds them back to back in host order, else packed into
 * `stage` (a leader's stage is its sums: it reduces in place). */
static tcc_result_t host_sum_of_run(tcc_comm_t *comm, const tcc_coll_t *c, int g, uint8_t *sums, uint8_t *stage,
                                    uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const size_t block = c->count * tcc__dtype_size(c->dtype), off = (size_t)t->host_start[g] * block;
  const int k0 = t->host_start[g], k1 = k0 + t->host_size[g];
  uint8_t *run = adjacent(t, c->sends, k0, k1, block);
  if (!run) pack(t, c->sends, k0, k1, block, run = (sums ? sums : stage) + off);
  const size_t count = (size_t)t->host_size[g] * c->count;
  if (!t->local) {
    own_partial(c, run, sums + off, count);
    return TCC_OK;
  }
  tcc_coll_t host = reduction(TCC_COLL_REDUCE, c, c->redop, run, sums ? sums + off : NULL, count);
  return phase(t->local, &host, seq, deadline, err);
}

static tcc_result_t reduce_scatter_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                              tcc_err_t *err) {
  const tcc__topology_t *t = comm->topo;
  const int H = t->nhosts, h = t->host, L = t->host_size[h];
  const bool leader = t->local_index[comm->rank] == 0;
  const size_t block = c->count * tcc__dtype_size(c->dtype);
  /* Partials: every other host's partial of this rank's block (slot g of
   * H); on a leader then its host's sums of the other hosts' blocks (at
   * their place in host order) and what each other host's leader sends
   * for this host's blocks (L blocks from each, slot g of H); on another
   * rank whose input is not in host order, a stage to pack it in. */
  bool in_order = true;
  for (int g = 0; g < H; g++)
    in_order &= adjacent(t, c->sends, t->host_start[g], t->host_start[g] + t->host_size[g], block) != NULL;
  const size_t theirs_bytes = (size_t)H * block, sums_bytes = leader || !in_order ? (size_t)comm->size * block : 0;
  uint8_t *theirs = partials(comm, theirs_bytes + sums_bytes + (leader ? (size_t)H * L * block : 0));
  if (!theirs) return out_of_memory(comm, c, seq, err);
  uint8_t *sums = leader ? theirs + theirs_bytes : NULL, *stage = theirs + theirs_bytes;
  uint8_t *arrivals = theirs + theirs_bytes + sums_bytes;
  /* This host's sum of this rank's block, into the output, over the
   * host's ranks at once. */
  tcc_result_t r = TCC_OK;
  if (t->local) {
    void **parts = (void **)coll_scratch_of(comm)->part_out;
    for (int i = 0; i < L; i++) parts[i] = c->sends[rank_at(t, h, i)];
    tcc_coll_t within = reduction(TCC_COLL_REDUCE_SCATTER, c, c->redop, NULL, c->recv, c->count);
    within.sends = parts;
    r = phase(t->local, &within, seq, deadline, err);
  } else {
    own_partial(c, c->sends[comm->rank], c->recv, c->count);
  }
  for (int g = 0; g < H && r == TCC_OK; g++)
    if (g != h) r = host_sum_of_run(comm, c, g, sums, stage, seq, deadline, err);
  if (r == TCC_OK && leader) {
    leaders_exchange_t x;
    if (!exchange_alloc(&x, H)) return out_of_memory(comm, c, seq, err);
    for (int g = 0; g < H; g++) {
      x.sends[g] = sums + (size_t)t->host_start[g] * block;
      x.send_counts[g] = (size_t)t->host_size[g] * c->count;
      x.recvs[g] = arrivals + (size_t)g * L * block;
      x.recv_counts[g] = (size_t)L * c->count;
    }
    r = exchange_run(comm, c, &x, seq, deadline, err);
    exchange_free(&x);
  }
  /* Each other host's partial of each local rank's block, from the leader. */
  void **parts = (void **)coll_scratch_of(comm)->part_out;
  for (int g = 0; g < H && r == TCC_OK; g++) {
    if (g == h) continue;
    for (int i = 0; i < L && leader; i++) parts[i] = arrivals + ((size_t)g * L + (size_t)i) * block;
    tcc_coll_t spread = {.kind = TCC_COLL_SCATTER, .dtype = c->dtype, .count = c->count, .root = 0,
                         .sends = leader ? parts : NULL, .recv = theirs + (size_t)g * block};
    if (t->local) r = phase(t->local, &spread, seq, deadline, err);
    else tcc__copy(spread.recv, arrivals + (size_t)g * block, block);
  }
  if (r != TCC_OK) return r;
  /* Every host's partial of this rank's block, summed in host order. */
  const void **terms = (const void **)coll_scratch_of(comm)->part_src;
  for (int g = 0; g < H; g++) terms[g] = g == h ? c->recv : theirs + (size_t)g * block;
  tcc__reduce_n(c->recv, terms, H, c->count, c->dtype, later_op(c->redop), c->premul);
  average(comm, c, c->recv, c->count);
  return TCC_OK;
}

bool tcc__hier_leaders_relieve_links(const tcc__topology_t *t, int size) {
  /* Host h's link sends its blocks to every other host and receives the
   * blocks of every other rank. With a rank alone on one of two hosts that
   * is size - 1 one way, no better than the ring. */
  for (int h = 0; h < t->nhosts; h++) {
    const int out = t->host_size[h] * (t->nhosts - 1), in = size - t->host_size[h];
    if (out >= size - 1 || in >= size - 1) return false;
  }
  return true;
}

tcc_result_t tcc__coll_hier_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                       tcc_err_t *err) {
  switch (c->kind) {
    case TCC_COLL_ALLREDUCE: return allreduce_by_leaders(comm, c, seq, deadline, err);
    case TCC_COLL_REDUCE: return reduce_by_leaders(comm, c, seq, deadline, err);
    case TCC_COLL_ALLGATHER: return allgather_by_leaders(comm, c, seq, deadline, err);
    case TCC_COLL_REDUCE_SCATTER: return reduce_scatter_by_leaders(comm, c, seq, deadline, err);
    default:
      return tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm %s #%llu on '%s' (rank %d): no hierarchical algorithm",
                          tcc__coll_name(c->kind), (unsigned long long)seq, comm->name, comm->rank);
  }
}
