/*
 * hier_phase.h - what the hierarchical collectives (coll_hier.c,
 * coll_hier_leaders.c, coll_hier_alltoall.c) build their phases from: a
 * phase is a flat collective on one of the topology's views.
 */
#ifndef TCC_COLL_HIER_PHASE_H
#define TCC_COLL_HIER_PHASE_H

#include <stdlib.h>

#include "coll/coll_scratch.h"

static inline uint8_t *at(void *base, size_t off) { return (uint8_t *)base + off; }

/* Rank of host h at local index i. */
static inline int rank_at(const tcc__topology_t *t, int h, int i) { return t->by_host[t->host_start[h] + i]; }

/* One phase: a collective on a view (NULL: this rank has no part in it). */
static inline tcc_result_t phase(tcc_comm_t *view, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                 tcc_err_t *err) {
  return view ? tcc__coll_run(view, c, seq, deadline, err) : TCC_OK;
}

/* A phase's collective: c's dtype and PREMUL_SUM factor, root 0. AVG's
 * phases sum; the rank that ends with a sum divides it once (average). */
static inline tcc_coll_t reduction(tcc_coll_kind_t kind, const tcc_coll_t *c, tcc_redop_t redop, void *send,
                                   void *recv, size_t count) {
  return (tcc_coll_t){.kind = kind, .dtype = c->dtype, .redop = redop == TCC_AVG ? TCC_SUM : redop,
                      .premul = c->premul, .count = count, .send = send, .recv = recv};
}

/* AVG's division of a finished sum, by the group's size, as a flat AVG
 * divides its sum. */
static inline void average(const tcc_comm_t *comm, const tcc_coll_t *c, void *sum, size_t count) {
  if (c->redop == TCC_AVG) tcc__reduce_average(sum, count, c->dtype, comm->size);
}

/* The op the phases after the first apply: they combine partial results,
 * already multiplied by PREMUL_SUM's factor. */
static inline tcc_redop_t later_op(tcc_redop_t op) { return op == TCC_PREMUL_SUM || op == TCC_AVG ? TCC_SUM : op; }

/* The partials buffer, at least `bytes` long (NULL: out of memory). */
static inline void *partials(tcc_comm_t *comm, size_t bytes) {
  tcc__coll_scratch_t *s = coll_scratch_of(comm);
  if (s->partials_bytes < bytes) {
    free(s->partials);
    s->partials = malloc(bytes);
    s->partials_bytes = s->partials ? bytes : 0;
  }
  return s->partials;
}

/* The error of a phase's buffer that could not be had. */
static inline tcc_result_t out_of_memory(const tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, tcc_err_t *err) {
  return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s #%llu on '%s' (rank %d): out of memory",
                      tcc__coll_name(c->kind), (unsigned long long)seq, comm->name, comm->rank);
}

/* Sharded allreduces of at least two of these (of the type their phases
 * reduce in) run in segments, the cross-host phases of one overlapping the
 * host phases of its neighbours. */
#define HIER_SEGMENT_BYTES (4u << 20)

/* How many segments an allreduce of `bytes` (in the type its phases
 * reduce in) runs in. */
static inline size_t hier_segment_count(size_t bytes) {
  return bytes >= 2 * HIER_SEGMENT_BYTES ? (bytes + HIER_SEGMENT_BYTES - 1) / HIER_SEGMENT_BYTES : 1;
}

/* One segment's steps of a hierarchical allreduce: `before` and `after`
 * are phases of the host's ranks, `across` (NULL: none on this rank) the
 * cross-host part between them. */
typedef struct hier_steps {
  tcc_result_t (*before)(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err);
  tcc__hier_job_fn across;
  tcc_result_t (*after)(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err);
} hier_steps_t;

/* coll_hier.c: runs `steps` on `span` elements from whole->first in
 * `nseg` segments (whole's first and len set to each). The host's phases
 * go in one order on every rank of a host, whatever the timing and
 * whether it has an `across`: before 0, before 1, after 0, before 2,
 * after 1, ..., after the last. From two segments on, `across` of segment
 * k runs on the pipe's thread between before k+1 and after k-1, so the
 * link and shared memory work at the same time (in line, at the same
 * point, where the thread cannot be had). */
tcc_result_t tcc__hier_in_segments(tcc_comm_t *comm, const hier_steps_t *steps, const tcc__hier_job_t *whole,
                                   size_t span, size_t nseg, tcc_err_t *err);

/* coll_hier.c: the host phases of an allreduce on even hosts (whole->shard
 * elements per local rank): the host's ranks reduce-scatter whole->sum
 * and all-gather whole->out. */
tcc_result_t tcc__hier_shard_reduce_scatter(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err);
tcc_result_t tcc__hier_shard_allgather(tcc_comm_t *comm, const tcc__hier_job_t *seg, tcc_err_t *err);

/* coll_hier_half.c: float16/bfloat16 allreduce in float32 phases, rounded
 * once; and whether that puts fewer bytes on the busiest host link than
 * the flat exchange. */
bool tcc__hier_widening_pays(const tcc_comm_t *comm);
tcc_result_t tcc__coll_hier_allreduce_half(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                           tcc_err_t *err);

/* coll_hier_leaders.c: allreduce, reduce, allgather and reduce_scatter on
 * hosts with different rank counts, through each host's first rank. */
tcc_result_t tcc__coll_hier_by_leaders(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                       tcc_err_t *err);

/* Whether the leaders' exchange of a reduce_scatter puts fewer blocks on
 * the busiest host link than a flat ring of the group's `size` ranks
 * (size - 1 each way on every link it crosses). */
bool tcc__hier_leaders_relieve_links(const tcc__topology_t *t, int size);

#endif /* TCC_COLL_HIER_PHASE_H */
