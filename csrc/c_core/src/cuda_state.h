/*
 * cuda_state.h - the per-communicator CUDA state shared by cuda_comm.c
 * (setup, submit, groups), cuda_issue.c (op -> NCCL calls) and
 * cuda_watch.c (completion and deadlines). TCC_WITH_CUDA only.
 */
#ifndef TCC_CUDA_STATE_H
#define TCC_CUDA_STATE_H

#ifdef TCC_WITH_CUDA

#include <cuda_runtime_api.h>

#include "cuda.h"
#include "nccl_lib.h"

struct tcc_cuda {
  const tcc_nccl_lib_t *nccl;
  int device;
  ncclComm_t nc;
  cudaStream_t stream;     /* the communicator's stream: every NCCL call goes here */
  cudaEvent_t order_event; /* orders the NCCL stream after a caller's stream; under cuda_lock */
  /* An open group (tcc_comm_group_start): ops issued, events not recorded yet. */
  int nccl_group_open;
  int group_captured;
  tcc_op_t *group_head, *group_tail;
  /* The watchdog (cuda_watch.c). */
  pthread_mutex_t lock;
  pthread_cond_t cv;
  tcc_op_t *head, *tail; /* ops in flight, in issue order */
  int stopping;
  int deep_sleep;
  int64_t last_submit_ns;
  pthread_t thread;
  int thread_started;
  int nccl_aborted;      /* ncclCommAbort was called (under comm->cuda_lock) */
};

/* ---- cuda_issue.c ---- */
/* Issues the NCCL calls of `op` on c->stream. Calls that must follow the
 * NCCL kernel (copying out of staging memory) are left to tcc_cuda_post. */
tcc_result_t tcc_cuda_issue(tcc_comm_t *comm, struct tcc_cuda *c, tcc_op_t *op, tcc_err_t *err);
/* Runs after the NCCL kernel of `op` is enqueued (after ncclGroupEnd). */
tcc_result_t tcc_cuda_post(tcc_comm_t *comm, struct tcc_cuda *c, tcc_op_t *op, tcc_err_t *err);
/* "allreduce", "send", ... */
const char *tcc_cuda_op_name(const tcc_op_t *op);

/* ---- cuda_watch.c ---- */
tcc_result_t tcc_cuda_watch_start(tcc_comm_t *comm, struct tcc_cuda *c, tcc_err_t *err);
/* Takes a reference on op and watches it until its event completes or its deadline passes. */
void tcc_cuda_watch(struct tcc_cuda *c, tcc_op_t *op);
/* Lets the watchdog drain what it watches and stop. */
void tcc_cuda_watch_stop(struct tcc_cuda *c);
/* Finishes op once (whoever claims it first). */
void tcc_cuda_finish(tcc_op_t *op, tcc_result_t r, const char *msg);
/* Aborts the NCCL communicator once (after the communicator failed). */
void tcc_cuda_abort_nccl(tcc_comm_t *comm, struct tcc_cuda *c);

/* A completion event for `device` (the caller made it current), from a
 * process-wide pool; tcc_cuda_event_put gives it back. */
cudaEvent_t tcc_cuda_event_get(int device, cudaError_t *e);
void tcc_cuda_event_put(int device, cudaEvent_t ev);

#endif /* TCC_WITH_CUDA */
#endif /* TCC_CUDA_STATE_H */
