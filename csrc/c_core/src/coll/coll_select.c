/*
 * coll_select.c - the collective algorithms' entry: per-communicator
 * scratch, and the choice of algorithm family for each op from what the
 * transport offers (shared staging spans where every rank shares memory,
 * else byte streams). Every rank of a group chooses alike: the offer is a
 * property of the group's transport, agreed at creation.
 */
#include <stdlib.h>

#include "coll/coll_scratch.h"

tcc_result_t tcc__coll_attach(tcc_comm_t *comm, tcc_err_t *err) {
  const size_t n = (size_t)comm->size;
  tcc__coll_scratch_t *s = calloc(1, sizeof *s);
  if (s) {
    s->srcs = calloc(n, sizeof *s->srcs);
    s->descs = calloc(n, sizeof *s->descs);
    s->pieces = calloc(n, sizeof *s->pieces);
    s->reads = calloc(n, sizeof *s->reads);
    s->part_src = calloc(n, sizeof *s->part_src);
    s->part_out = calloc(n, sizeof *s->part_out);
    s->part_len = calloc(n, sizeof *s->part_len);
    s->poll_peers = calloc(n, sizeof *s->poll_peers);
    s->poll_events = calloc(n, sizeof *s->poll_events);
    s->poll_revents = calloc(n, sizeof *s->poll_revents);
  }
  comm->coll_scratch = s;
  if (!s || !s->srcs || !s->descs || !s->pieces || !s->reads || !s->part_src || !s->part_out || !s->part_len ||
      !s->poll_peers || !s->poll_events || !s->poll_revents) {
    tcc__coll_release(comm);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", comm->name, comm->rank);
  }
  return TCC_OK;
}

void tcc__coll_release(tcc_comm_t *comm) {
  tcc__coll_scratch_t *s = coll_scratch_of(comm);
  if (!s) return;
  free(s->srcs);
  free(s->descs);
  free(s->pieces);
  free(s->reads);
  free(s->part_src);
  free(s->part_out);
  free(s->part_len);
  free(s->poll_peers);
  free(s->poll_events);
  free(s->poll_revents);
  free(s);
  comm->coll_scratch = NULL;
}

tcc_result_t tcc__coll_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                           tcc_err_t *err) {
  if (comm->ops->spans) return tcc__coll_staged_run(comm, c, seq, deadline_ns, err);
  if (comm->ops->streams) return tcc__coll_stream_run(comm, c, seq, deadline_ns, err);
  return tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm %s on '%s' (rank %d): the %s transport offers no collectives",
                     tcc__coll_name(c->kind), comm->name, comm->rank, comm->ops->name);
}
