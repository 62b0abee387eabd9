/*
 * coll_select.c - the collective algorithms' entry: per-communicator
 * scratch, and the choice of algorithm family for each op from what the
 * transport offers (shared staging spans where every rank shares memory,
 * else byte streams). Every rank of a group chooses alike: the offer is a
 * property of the group's transport, agreed at creation.
 */
#include <stdio.h>
#include <stdlib.h>

#include "coll/coll_scratch.h"
#include "coll/stream_frames.h"
#include "core/log.h"

/* INFO: the sizes at which the algorithms change, as this communicator
 * will use them (the shm ones are rank 0's, carried to every rank). */
static void log_thresholds(tcc_comm_t *comm) {
  const tcc__spans_ops_t *sp = comm->ops->spans;
  if (sp) {
    char slots[240] = "";
    if (tcc__coll_slots_part_max(comm))
      snprintf(slots, sizeof slots,
               "; broadcast, scatter, gather and reduce whose part fits %zu bytes over %u-slot rings, senders not "
               "waiting (TCCOMM_SHM_SLOT_BYTES), and parts up to %zu bytes over several slots "
               "(TCCOMM_SHM_SLOT_SPAN_BYTES)",
               tcc__coll_slots_part_max(comm), sp->slot_count(comm), tcc__coll_slots_span_max(comm));
    TCC_LOG_INFO(comm->rank,
                 "communicator '%s' algorithms over %s staging spans: reductions up to %zu bytes one-shot "
                 "(TCCOMM_SHM_SMALL_BYTES), larger ones pipelined reduce-scatter + all-gather in %zu-byte "
                 "windows (TCCOMM_SHM_WINDOW_BYTES); data movement in the same windows%s",
                 comm->name, comm->ops->name, sp->one_shot_bytes(comm), sp->window_bytes(comm), slots);
  }
  else if (comm->ops->streams)
    TCC_LOG_INFO(comm->rank,
                 "communicator '%s' algorithms over %s streams: small ops (and an all-to-all's small blocks) in "
                 "one exchange, the data with the descriptors; all-reduces up to %u bytes per rank's chunk with "
                 "their reduce-scatter in the descriptors' exchange; larger ones direct exchange between every "
                 "pair, reductions reduce-scatter + all-gather pipelined in %zu-byte segments",
                 comm->name, comm->ops->name, TCC_STREAM_PAYLOAD_MAX, tcc__stream_segment_bytes(comm->size));
}

tcc_result_t tcc__coll_attach(tcc_comm_t *comm, tcc_err_t *err) {
  const size_t n = (size_t)comm->size;
  tcc__coll_scratch_t *s = calloc(1, sizeof *s);
  bool held_ok = true;
  if (s) {
    s->srcs = calloc(n, sizeof *s->srcs);
    s->descs = calloc(n, sizeof *s->descs);
    s->pieces = calloc(n, sizeof *s->pieces);
    s->reads = calloc(n, sizeof *s->reads);
    s->writes = calloc(n, sizeof *s->writes);
    s->part_src = calloc(n, sizeof *s->part_src);
    s->part_out = calloc(n, sizeof *s->part_out);
    s->part_len = calloc(n, sizeof *s->part_len);
    s->poll_peers = calloc(n, sizeof *s->poll_peers);
    s->poll_events = calloc(n, sizeof *s->poll_events);
    s->poll_revents = calloc(n, sizeof *s->poll_revents);
    s->slot_part_max = tcc__coll_slots_part_max(comm);
    s->slot_span_max = tcc__coll_slots_span_max(comm);
    s->stream_one_sided = tcc__stream_one_sided_wanted(comm);
    if (s->stream_one_sided) {
      s->one_sided_descs = calloc(TCC_STREAM_UNREAD_MAX, sizeof *s->one_sided_descs);
      s->unread = calloc(n, sizeof *s->unread);
      held_ok = tcc__stream_held_alloc(s, (int)n);
    }
  }
  comm->coll_scratch = s;
  if (!s || !s->srcs || !s->descs || !s->pieces || !s->reads || !s->writes || !s->part_src || !s->part_out || !s->part_len ||
      !s->poll_peers || !s->poll_events || !s->poll_revents ||
      (s->stream_one_sided && (!s->one_sided_descs || !s->unread || !held_ok))) {
    tcc__coll_release(comm);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", comm->name, tcc__self_label(comm));
  }
  if (TCC__LOG_ON(TCC__LOG_INFO)) log_thresholds(comm);
  return TCC_OK;
}

void tcc__coll_release(tcc_comm_t *comm) {
  tcc__coll_scratch_t *s = coll_scratch_of(comm);
  if (!s) return;
  free(s->srcs);
  free(s->descs);
  free(s->pieces);
  free(s->reads);
  free(s->writes);
  free(s->part_src);
  free(s->part_out);
  free(s->part_len);
  free(s->poll_peers);
  free(s->poll_events);
  free(s->poll_revents);
  free(s->one_sided_descs);
  free(s->unread);
  free(s->held);
  free(s->held_bytes);
  free(s->partials);
  free(s->widened);
  tcc__hier_pipe_free(s->pipe);
  free(s);
  comm->coll_scratch = NULL;
}

bool tcc__coll_holds_output(tcc_comm_t *comm) {
  const tcc__coll_scratch_t *s = coll_scratch_of(comm);
  return s && atomic_load_explicit(&((tcc__coll_scratch_t *)s)->held_any, memory_order_relaxed);
}

void tcc__coll_idle(tcc_comm_t *comm) {
  if (comm->ops && comm->ops->streams && comm->coll_scratch && !atomic_load(&comm->aborted))
    tcc__stream_frames_send_held(comm, 0);
}

void tcc__coll_settle(tcc_comm_t *comm, int64_t grace_ms) {
  if (comm->ops && comm->ops->streams && comm->coll_scratch)
    tcc__stream_frames_settle(comm, tcc__deadline_after_ms(grace_ms));
}

/* Mirrors the choices of tcc__coll_run and of the algorithms below it; the
 * one size-dependent choice is made by the same function in both. */
const char *tcc__coll_algorithm(tcc_comm_t *comm, const tcc_coll_t *c) {
  if (tcc__coll_hier_chosen(comm, c)) return tcc__coll_hier_algorithm(comm, c);
  const int reduction = c->kind == TCC_COLL_ALLREDUCE || c->kind == TCC_COLL_REDUCE || c->kind == TCC_COLL_REDUCE_SCATTER;
  if (comm->ops->spans) {
    if (c->kind == TCC_COLL_BARRIER) return "spans stage barrier";
    if (tcc__coll_slots_fit(comm, c)) return "spans slot rings";
    if (!reduction) return tcc__direct_expected(comm, c) ? "spans single-copy reads" : "spans windowed copy";
    if (tcc__coll_staged_one_shot(c->kind, c->count * tcc__dtype_size(c->dtype), comm->ops->spans->one_shot_bytes(comm)))
      return "spans one-shot reduction";
    return c->kind == TCC_COLL_REDUCE_SCATTER ? "spans pipelined reduce-scatter" : "spans pipelined reduce-scatter + all-gather";
  }
  if (comm->ops->streams) {
    if (c->kind == TCC_COLL_BARRIER) return "streams descriptor exchange";
    if (c->kind == TCC_COLL_ALLTOALL) {
      switch (tcc__stream_alltoall_frames(c, comm->size, comm->rank)) {
        case ALLTOALL_FRAMES_ALL: return "streams one exchange (data with the descriptors)";
        case ALLTOALL_FRAMES_SOME: return "streams direct exchange (small blocks with the descriptors)";
        default: return "streams direct exchange";
      }
    }
    if (tcc__stream_eager_fits(c, comm->size))
      return tcc__stream_one_sided(comm, c)
                 ? "streams one-sided (data with the descriptors; its senders do not wait)"
                 : "streams one exchange (data with the descriptors)";
    if (tcc__stream_reduce_frames_fits(c, comm->size))
      return "streams reduce-scatter with the descriptors + all-gather";
    if (!reduction) return "streams direct exchange";
    return c->kind == TCC_COLL_ALLREDUCE ? "streams reduce-scatter + all-gather"
           : c->kind == TCC_COLL_REDUCE  ? "streams reduce-scatter + gather"
                                         : "streams reduce-scatter";
  }
  return "none";
}

tcc_result_t tcc__coll_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                           tcc_err_t *err) {
  if (tcc__coll_hier_chosen(comm, c)) return tcc__coll_hier_run(comm, c, seq, deadline_ns, err);
  if (comm->ops->spans) return tcc__coll_staged_run(comm, c, seq, deadline_ns, err);
  if (comm->ops->streams) return tcc__coll_stream_run(comm, c, seq, deadline_ns, err);
  return tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm %s on '%s' (rank %d): the %s transport offers no collectives",
                     tcc__coll_name(c->kind), comm->name, tcc__self_label(comm), comm->ops->name);
}
