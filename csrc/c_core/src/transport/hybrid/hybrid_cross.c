/*
 * hybrid_cross.c - the cross-host view's transport: the view's rank r is
 * the group's rank members[r], and its streams are the group's TCP
 * collective connections to those ranks. Only the thread running the
 * group's collective queue uses them, one phase at a time, so the group's
 * streams stay in step.
 */
#include <stdlib.h>

#include "transport/hybrid/hybrid.h"

typedef struct cross_state {
  tcc_comm_t *group;
  int *peers; /* [view size] poll scratch: the group's ranks */
} cross_state_t;

static ssize_t cross_send(tcc_comm_t *view, int peer, const void *buf, size_t len) {
  cross_state_t *st = view->transport_state;
  return tcc__tcp_streams.send(st->group, view->members[peer], buf, len);
}

static ssize_t cross_recv(tcc_comm_t *view, int peer, void *buf, size_t len) {
  cross_state_t *st = view->transport_state;
  return tcc__tcp_streams.recv(st->group, view->members[peer], buf, len);
}

static int cross_poll(tcc_comm_t *view, int n, const int *peers, const short *events, short *revents,
                      int timeout_ms) {
  cross_state_t *st = view->transport_state;
  for (int i = 0; i < n; i++) st->peers[i] = view->members[peers[i]];
  return tcc__tcp_streams.poll(st->group, n, st->peers, events, revents, timeout_ms);
}

static const tcc__stream_ops_t cross_streams = {.send = cross_send, .recv = cross_recv, .poll = cross_poll};

static void cross_destroy(tcc_comm_t *view) {
  cross_state_t *st = view->transport_state;
  if (st) free(st->peers);
  free(st);
  view->transport_state = NULL;
}

/* A view runs collectives only: no point-to-point functions. */
static const tcc_transport_ops_t cross_ops = {
    .name = "tcp",
    .streams = &cross_streams,
    .destroy = cross_destroy,
};

tcc_result_t tcc__hybrid_cross_attach(tcc_comm_t *view, tcc_comm_t *group, tcc_err_t *err) {
  cross_state_t *st = calloc(1, sizeof *st);
  int *peers = calloc((size_t)view->size, sizeof *peers);
  if (!st || !peers) {
    free(st);
    free(peers);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", group->name, group->rank);
  }
  st->group = group;
  st->peers = peers;
  view->transport_state = st;
  view->ops = &cross_ops;
  return TCC_OK;
}
