/*
 * coll_hier_half.c - float16/bfloat16 allreduce on groups that span hosts.
 *
 * These accumulate in float32 and round once; partial sums staged in the
 * half type would be rounded at every phase. So the phases run on a
 * float32 copy of the input (kept with the communicator: a fresh buffer
 * per op would fault its pages in every time), in the documented order of
 * a hierarchical sum (each host's ranks, then the hosts), and only the
 * finished sums are rounded. On hosts of equal size:
 *   1. the host's ranks reduce-scatter the copy (local rank l gets its
 *      host's float32 sum of shard l);
 *   2. the ranks of local index l reduce-scatter shard l across hosts, in
 *      float32: each ends with the total of one H-th of it;
 *   3. that part is rounded once into the output;
 *   4. the same ranks all-gather shard l across hosts, in the half type;
 *   5. the host's ranks all-gather the shards, in the half type.
 * Out of each host's link go (H - 1) / H of the vector in float32 and again
 * in the half type: 3 (H - 1) / H times its bytes, against 2 (H - 1) / H
 * for an allreduce whose sums stay in its type. Elements left over when a
 * shard or the vector does not divide evenly are summed the same way by
 * allreduces. From two segments of the copy on (hier_phase.h), steps 2-4
 * of one segment run on the pipe's thread while the host's ranks run
 * steps 1 and 5 of its neighbours, as the float32 allreduce does. On
 * uneven hosts the leaders' allreduce runs on the copy
 * (coll_hier_leaders.c) and the result is rounded at the end.
 */
#include "coll/hier_phase.h"

bool tcc__hier_widening_pays(const tcc_comm_t *comm) {
  /* Bytes out of a host of L of the n ranks, in units of the vector's
   * bytes: flat (every rank reduce-scatters and all-gathers with every
   * other directly) 2 L (n - L) / n; here 3 (H - 1) / H on even hosts,
   * 4 (H - 1) / H through the leaders (their allreduce in float32). */
  const tcc__topology_t *t = comm->topo;
  const long n = comm->size, hosts = t->nhosts, here = t->uniform ? 3 : 4;
  for (int h = 0; h < t->nhosts; h++) {
    const long local = t->host_size[h];
    if (2 * local * (n - local) * hosts > here * (hosts - 1) * n) return true;
  }
  return false;
}

/* Rounds count float32 sums at `sum` once into `out` (half), AVG divided first. */
static void finish(const tcc_comm_t *comm, const tcc_coll_t *c, const tcc_coll_t *w, float *sum, void *out,
                   size_t count) {
  average(comm, w, sum, count);
  tcc__half_narrow(out, sum, count, c->dtype);
}

/* The cross-host job of a segment (`len` elements of shard l from element
 * `first`): summed across hosts in float32, rounded once, gathered across
 * hosts in the half type. */
static tcc_result_t segment_across_hosts(tcc_comm_t *comm, const tcc__hier_job_t *j, void **parts, tcc_err_t *err) {
  tcc_comm_t *cross = comm->topo->cross;
  const tcc_coll_t *c = j->out, *w = j->sum;
  const int H = cross->size, me = cross->rank;
  const size_t part = j->len / (size_t)H, main = part * (size_t)H, es = tcc__dtype_size(c->dtype);
  float *wide = w->recv;
  tcc_result_t r = TCC_OK;
  if (part > 0) {
    for (int h = 0; h < H; h++) parts[h] = wide + j->first + (size_t)h * part;
    tcc_coll_t rs = reduction(TCC_COLL_REDUCE_SCATTER, w, later_op(w->redop), NULL, parts[me], part);
    rs.sends = parts;
    r = phase(cross, &rs, j->seq, j->deadline, err);
    if (r != TCC_OK) return r;
    finish(comm, c, w, parts[me], at(c->recv, (j->first + (size_t)me * part) * es), part);
    for (int h = 0; h < H; h++) parts[h] = at(c->recv, (j->first + (size_t)h * part) * es);
    tcc_coll_t ag = reduction(TCC_COLL_ALLGATHER, c, c->redop, parts[me], NULL, part);
    ag.recvs = parts;
    r = phase(cross, &ag, j->seq, j->deadline, err);
  }
  if (r == TCC_OK && main < j->len) {
    float *tail = wide + j->first + main;
    tcc_coll_t ar = reduction(TCC_COLL_ALLREDUCE, w, later_op(w->redop), tail, tail, j->len - main);
    r = phase(cross, &ar, j->seq, j->deadline, err);
    if (r == TCC_OK) finish(comm, c, w, tail, at(c->recv, (j->first + main) * es), j->len - main);
  }
  return r;
}

static tcc_result_t by_shards(tcc_comm_t *comm, const tcc_coll_t *c, const tcc_coll_t *w, uint64_t seq,
                              int64_t deadline, tcc_err_t *err) {
  const size_t shard = c->count / (size_t)comm->topo->local->size, main = shard * (size_t)comm->topo->local->size;
  const size_t es = tcc__dtype_size(c->dtype);
  tcc_result_t r = TCC_OK;
  if (shard > 0) {
    static const hier_steps_t steps = {tcc__hier_shard_reduce_scatter, segment_across_hosts,
                                       tcc__hier_shard_allgather};
    const tcc__hier_job_t whole = {.out = c, .sum = w, .first = (size_t)comm->topo->local->rank * shard,
                                   .shard = shard, .seq = seq, .deadline = deadline};
    r = tcc__hier_in_segments(comm, &steps, &whole, shard, hier_segment_count(main * sizeof(float)), err);
  }
  if (r == TCC_OK && main < c->count) {
    float *tail = (float *)w->recv + main;
    tcc_coll_t host = reduction(TCC_COLL_ALLREDUCE, w, w->redop, tail, tail, c->count - main);
    r = phase(comm->topo->local, &host, seq, deadline, err);
    tcc_coll_t hosts = reduction(TCC_COLL_ALLREDUCE, w, later_op(w->redop), tail, tail, host.count);
    if (r == TCC_OK) r = phase(comm->topo->cross, &hosts, seq, deadline, err);
    if (r == TCC_OK) finish(comm, c, w, tail, at(c->recv, main * es), host.count);
  }
  return r;
}

tcc_result_t tcc__coll_hier_allreduce_half(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                           tcc_err_t *err) {
  tcc__coll_scratch_t *s = coll_scratch_of(comm);
  const size_t bytes = c->count * sizeof(float);
  if (s->widened_bytes < bytes) {
    free(s->widened);
    s->widened = malloc(bytes);
    s->widened_bytes = s->widened ? bytes : 0;
  }
  if (!s->widened) return out_of_memory(comm, c, seq, err);
  tcc_coll_t w = *c;
  w.dtype = TCC_FLOAT32;
  w.send = w.recv = s->widened;
  tcc__half_widen(w.recv, c->send, c->count, c->dtype);
  if (comm->topo->uniform) return by_shards(comm, c, &w, seq, deadline, err);
  tcc_result_t r = tcc__coll_hier_by_leaders(comm, &w, seq, deadline, err);
  /* The leaders' allreduce leaves every rank the average already divided. */
  if (r == TCC_OK) tcc__half_narrow(c->recv, w.recv, c->count, c->dtype);
  return r;
}
