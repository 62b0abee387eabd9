/*
 * nccl_state.h - the device executor's state, shared by its files:
 *
 * comm.c      the per-communicator state, NCCL setup, the public CUDA calls
 * executor.c  the executor table: submit, groups, test, wait, stream order
 * issue.c     one op as NCCL calls on the communicator's stream
 * watch.c     the watchdog: completion and deadlines
 * lib.c       NCCL found at run time
 *
 * Only built with CUDA; nccl/no_nccl.c stands in for all of them otherwise.
 */
#ifndef TCC_NCCL_STATE_H
#define TCC_NCCL_STATE_H

#include <cuda_runtime_api.h>

#include "core/executor.h"
#include "nccl/nccl_lib.h"

/* What a CUDA op carries besides the generic op (op->exec_state). */
typedef struct nccl_op {
  _Atomic(cudaEvent_t) event; /* completion, published once recorded (other threads test it) */
  void *tmp;                  /* staging memory freed after the NCCL call */
  int captured;               /* enqueued into a CUDA graph capture: never queried */
  atomic_int reaped;          /* whoever sets it first finishes the op */
} nccl_op_t;

static inline nccl_op_t *nccl_op_of(const tcc_op_t *op) { return (nccl_op_t *)op->exec_state; }

/* The NCCL side of one communicator, created at its first CUDA op or by
 * tcc_comm_cuda_init (every rank must issue it). */
struct tcc_cuda {
  const tcc_nccl_lib_t *nccl;
  int device;
  ncclComm_t nc;
  cudaStream_t stream;     /* the communicator's stream: every NCCL call goes here */
  cudaEvent_t order_event; /* orders the NCCL stream after a caller's stream; under the lock */
  /* An open group (tcc_comm_group_start): ops issued, events not recorded yet. */
  int nccl_group_open;
  int group_captured;
  tcc_op_t *group_head, *group_tail;
  /* The watchdog (watch.c). */
  pthread_mutex_t lock;
  pthread_cond_t cv;
  tcc_op_t *head, *tail; /* ops in flight, in issue order (linked by op->next) */
  int stopping;
  int deep_sleep;
  int64_t last_submit_ns;
  pthread_t thread;
  int thread_started;
  int nccl_aborted;      /* ncclCommAbort was called (under the communicator's lock) */
};

/* comm->device_state: exists from the communicator's creation. */
typedef struct nccl_comm {
  pthread_mutex_t lock;          /* creating `state`, issuing CUDA ops, groups, abort */
  _Atomic(struct tcc_cuda *) state; /* NULL until NCCL is set up */
} nccl_comm_t;

static inline nccl_comm_t *nccl_comm_of(tcc_comm_t *comm) { return (nccl_comm_t *)comm->device_state; }
static inline struct tcc_cuda *nccl_state_of(tcc_comm_t *comm) {
  return atomic_load(&nccl_comm_of(comm)->state);
}

/* ---- comm.c ---- */
/* Makes `device` current for the calling thread; *prev gets the old one. */
cudaError_t tcc_cuda_enter_device(int device, int *prev);
void tcc_cuda_leave_device(int device, int prev);
/* The communicator's CUDA state for `device`, set up on first use (a
 * collective over the host path). Caller holds the lock. NULL with *err. */
struct tcc_cuda *tcc_cuda_state_for(tcc_comm_t *comm, int device, const char *what, tcc_err_t *err);
/* Releases NCCL, the stream and the events of a stopped state. */
void tcc_cuda_state_free(tcc_comm_t *comm, struct tcc_cuda *c);

/* ---- issue.c ---- */
/* Issues the NCCL calls of `op` on c->stream. Calls that must follow the
 * NCCL kernel (copying out of staging memory) are left to tcc_cuda_post. */
tcc_result_t tcc_cuda_issue(tcc_comm_t *comm, struct tcc_cuda *c, tcc_op_t *op, tcc_err_t *err);
/* Runs after the NCCL kernel of `op` is enqueued (after ncclGroupEnd). */
tcc_result_t tcc_cuda_post(tcc_comm_t *comm, struct tcc_cuda *c, tcc_op_t *op, tcc_err_t *err);

/* ---- watch.c ---- */
tcc_result_t tcc_cuda_watch_start(tcc_comm_t *comm, struct tcc_cuda *c, tcc_err_t *err);
/* Takes a reference on op and watches it until its event completes or its deadline passes. */
void tcc_cuda_watch(struct tcc_cuda *c, tcc_op_t *op);
/* Wakes the watchdog (the communicator failed: it aborts NCCL). */
void tcc_cuda_watch_wake(struct tcc_cuda *c);
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

#endif /* TCC_NCCL_STATE_H */
