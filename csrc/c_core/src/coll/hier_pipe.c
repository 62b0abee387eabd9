/*
 * hier_pipe.c - a thread that runs one job at a time of a hierarchical
 * allreduce (the cross-host phases of a segment, scheduled by
 * tcc__hier_in_segments) while the thread that posted it runs other phases, so
 * the link and shared memory work at the same time. Posts and waits
 * alternate: one job in flight at most. The job's phases run on the
 * cross-host view, whose scratch is its own; `parts` spares it the
 * communicator's, which the posting thread keeps using.
 */
#include <pthread.h>
#include <stdlib.h>

#include "coll/coll_scratch.h"

struct tcc__hier_pipe {
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cv;
  tcc_comm_t *comm;
  void **parts;
  bool posted, done, stop;
  tcc__hier_job_t job;
  tcc_result_t result;
  tcc_err_t err;
};

static void *pipe_main(void *arg) {
  tcc__hier_pipe_t *p = arg;
  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (!p->posted && !p->stop) pthread_cond_wait(&p->cv, &p->lock);
    if (p->stop) break;
    p->posted = false;
    const tcc__hier_job_t job = p->job;
    tcc_err_t err = {TCC_OK, {0}};
    pthread_mutex_unlock(&p->lock);
    tcc_result_t r = job.run(p->comm, &job, p->parts, &err);
    pthread_mutex_lock(&p->lock);
    p->result = r;
    p->err = err;
    p->done = true;
    pthread_cond_broadcast(&p->cv);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

atomic_bool tcc__hier_pipe_refused;

tcc__hier_pipe_t *tcc__hier_pipe_of(tcc_comm_t *comm) {
  tcc__coll_scratch_t *s = coll_scratch_of(comm);
  if (atomic_load_explicit(&tcc__hier_pipe_refused, memory_order_relaxed)) return NULL;
  if (s->pipe) return s->pipe;
  tcc__hier_pipe_t *p = calloc(1, sizeof *p);
  void **parts = calloc((size_t)comm->size, sizeof *parts);
  if (!p || !parts) goto fail;
  p->comm = comm;
  p->parts = parts;
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->cv, NULL);
  if (pthread_create(&p->thread, NULL, pipe_main, p) != 0) {
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->cv);
    goto fail;
  }
  s->pipe = p;
  return p;
fail:
  free(parts);
  free(p);
  return NULL;
}

void tcc__hier_pipe_free(tcc__hier_pipe_t *p) {
  if (!p) return;
  pthread_mutex_lock(&p->lock);
  p->stop = true;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->lock);
  pthread_join(p->thread, NULL);
  pthread_mutex_destroy(&p->lock);
  pthread_cond_destroy(&p->cv);
  free(p->parts);
  free(p);
}

void tcc__hier_pipe_post(tcc__hier_pipe_t *p, const tcc__hier_job_t *job) {
  pthread_mutex_lock(&p->lock);
  p->job = *job;
  p->done = false;
  p->posted = true;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->lock);
}

tcc_result_t tcc__hier_pipe_wait(tcc__hier_pipe_t *p, tcc_err_t *err) {
  pthread_mutex_lock(&p->lock);
  while (!p->done) pthread_cond_wait(&p->cv, &p->lock);
  const tcc_result_t r = p->result;
  if (r != TCC_OK) tcc__err_set(err, r, "%s", p->err.msg);
  pthread_mutex_unlock(&p->lock);
  return r;
}
