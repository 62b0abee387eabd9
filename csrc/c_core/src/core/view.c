/*
 * view.c - views: a subset of a communicator's ranks that one phase of a
 * hierarchical algorithm runs on (the ranks of one host over shared
 * memory, or one rank per host over the group's connections).
 *
 * A view is a tcc_comm_t as far as transports and algorithms are
 * concerned (rank, size, name, failure state, scratch), so every
 * algorithm runs on it unchanged. It has no executors and no threads: the
 * thread running its parent's collective queue runs its phases, and its
 * failure state follows the parent's (tcc__comm_view_fail).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/transport.h"

tcc_comm_t *tcc__comm_view_new(tcc_comm_t *parent, int rank, int size, const int *members, tcc_err_t *err) {
  tcc_comm_t *v = calloc(1, sizeof *v);
  int *m = calloc((size_t)size, sizeof *m);
  if (!v || !m) {
    free(v);
    free(m);
    tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): out of memory", parent->name, parent->rank);
    return NULL;
  }
  memcpy(m, members, (size_t)size * sizeof *m);
  atomic_store(&v->refs, 1);
  v->owner_pid = parent->owner_pid;
  v->rank = rank;
  v->size = size;
  v->members = m;
  v->parent = parent;
  snprintf(v->name, sizeof v->name, "%s", parent->name);
  atomic_store(&v->timeout_ms, atomic_load(&parent->timeout_ms));
  pthread_mutex_init(&v->fail_lock, NULL);
  pthread_mutex_init(&v->group_lock, NULL);
  /* Its waits run on the parent's ranks, so they share CPUs as the
   * parent's do; a view with a transport of its own (shared memory)
   * decides again when that is set up. */
  v->cpu_share = parent->cpu_share;
  return v;
}

void tcc__comm_view_fail(tcc_comm_t *view) {
  char cause[TCC_ERRLEN];
  tcc_result_t code = tcc__comm_failure(view->parent, cause, sizeof cause);
  if (code == TCC_OK) return;
  pthread_mutex_lock(&view->fail_lock);
  if (!atomic_load(&view->aborted)) {
    view->fail_code = code;
    snprintf(view->fail_msg, sizeof view->fail_msg, "%s", cause);
    atomic_store(&view->aborted, 1);
  }
  pthread_mutex_unlock(&view->fail_lock);
}

void tcc__comm_view_free(tcc_comm_t *view) {
  if (!view) return;
  if (view->ops) view->ops->destroy(view);
  tcc__coll_release(view);
  pthread_mutex_destroy(&view->fail_lock);
  pthread_mutex_destroy(&view->group_lock);
  free(view->members);
  free(view);
}
