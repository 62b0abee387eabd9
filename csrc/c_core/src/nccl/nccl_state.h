/*
 * nccl_state.h - the device executor's state, shared by its files:
 *
 * nccl_comm.c      the per-communicator state, NCCL setup, the public CUDA calls
 * nccl_ncomm.c     one NCCL communicator: nonblocking, deadline-bound, abortable
 * nccl_executor.c  the executor table: submit, groups, test, wait, stream order
 * nccl_issue.c     one op as NCCL calls on the communicator's stream
 * nccl_watch.c     the watchdog: completion and deadlines
 * nccl_lib.c       NCCL found at run time
 *
 * Only built with CUDA; nccl/no_nccl.c stands in for all of them otherwise.
 */
#ifndef TCC_NCCL_STATE_H
#define TCC_NCCL_STATE_H

#include <cuda_runtime_api.h>

#include "core/executor.h"
#include "nccl/nccl_lib.h"

/* One NCCL communicator (nccl_ncomm.c). Every call on it is made between
 * tcc__ncomm_enter and tcc__ncomm_leave; none is made under a lock that the
 * watchdog or an abort needs. */
typedef struct tcc__ncomm {
  const tcc__nccl_lib_t *nccl;
  tcc_comm_t *comm;       /* for messages */
  _Atomic(ncclComm_t) nc; /* NULL once aborted or freed */
  cudaStream_t stream;    /* every NCCL call on this communicator goes here */
  int nonblocking;        /* config.blocking = 0 (NCCL >= 2.14) */
  atomic_int aborted;     /* no new call may start */
  atomic_int users;       /* threads inside a call on nc */
  char label[64];         /* what it is, for messages */
} tcc__ncomm_t;

/* What a CUDA op carries besides the generic op (op->exec_state). */
typedef struct nccl_op {
  tcc__ncomm_t *ncomm;         /* the communicator (and stream) it was issued on */
  int nccl_peer;              /* send/recv: the peer's rank in ncomm */
  _Atomic(cudaEvent_t) event; /* completion, published once recorded (other threads test it) */
  void *tmp;                  /* staging memory freed after the NCCL call */
  int captured;               /* enqueued into a CUDA graph capture: never queried */
  atomic_int reaped;          /* whoever sets it first finishes the op */
} nccl_op_t;

static inline nccl_op_t *nccl_op_of(const tcc_op_t *op) { return (nccl_op_t *)op->exec_state; }

/* The NCCL side of one communicator, created at its first CUDA op or by
 * tcc_comm_cuda_init (every rank must issue it). */
struct tcc__cuda {
  const tcc__nccl_lib_t *nccl;
  int device;
  int size; /* the communicator's, for the pairs */
  /* One reference for the communicator, one per CUDA graph holding work
   * captured on it (a user object of the graph: executor.c). A graph can be
   * replayed after the communicator is destroyed, so the NCCL side stays
   * until the last of them goes (comm.c). */
  atomic_int refs;
  int graceful; /* how NCCL goes at the end: destroyed, or aborted if the communicator failed */
  tcc__ncomm_t coll;        /* the whole group's NCCL communicator, made at the first collective */
  atomic_int coll_ready;
  /* [size]: the two-rank communicator with each peer, made at the first
   * send/recv with it outside a group: point-to-point needs neither the
   * other ranks nor the collectives' stream, so an irecv that waits for its
   * peer holds up no collective (as ProcessGroupNCCL's per-pair comms). */
  tcc__ncomm_t *pairs;
  atomic_int *pair_ready;
  cudaEvent_t order_event; /* orders an NCCL stream after a caller's stream; under the lock */
  /* tcc_comm_group_start opened an NCCL group on the issuing thread (its
   * ops wait in that thread's list: executor.c). */
  int nccl_group_open;
  /* The watchdog (watch.c). */
  pthread_mutex_t lock;
  pthread_cond_t cv;
  tcc_op_t *head, *tail; /* ops in flight, in issue order (linked by op->next) */
  int stopping;
  int deep_sleep;
  /* The error policy, TCCOMM_ASYNC_ERROR_HANDLING as torch's
   * TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 or 3 (the default) tear the process
   * down when CUDA ops fail in flight (a timeout, a device or NCCL error, a
   * dead peer), since work queued after them on the device would run on
   * half-written buffers; 2 (or 0) abort NCCL, fail the ops and mark the
   * communicator unusable, and the caller handles the error. An abort the
   * user asked for never tears down. */
  int tear_down;
  int64_t last_submit_ns;
  int64_t poll_ns; /* the watchdog's current poll period (watch.c) */
  pthread_t thread;
  int thread_started;
  atomic_int nccl_aborted; /* its NCCL communicators were aborted */
  atomic_int device_failed; /* the watchdog saw the failure itself (watch.c) */
  atomic_int destroying;    /* destroy drained it: its failure aborts nothing idle */
  int64_t failure_seen_ns;  /* when the watchdog first saw another failure */
};

/* comm->device_state: exists from the communicator's creation. */
typedef struct nccl_comm {
  /* Creating `state`, issuing CUDA ops, groups. Never taken by the
   * watchdog or by an abort: they must get through while a thread that
   * holds it waits inside NCCL. */
  pthread_mutex_t lock;
  _Atomic(struct tcc__cuda *) state; /* NULL until NCCL is set up */
} nccl_comm_t;

static inline nccl_comm_t *nccl_comm_of(tcc_comm_t *comm) { return (nccl_comm_t *)comm->device_state; }
static inline struct tcc__cuda *nccl_state_of(tcc_comm_t *comm) {
  return atomic_load(&nccl_comm_of(comm)->state);
}

/* ---- comm.c ---- */
/* Makes `device` current for the calling thread; *prev gets the old one. */
cudaError_t tcc__cuda_enter_device(int device, int *prev);
void tcc__cuda_leave_device(int device, int prev);
/* The communicator's CUDA state for `device`, made on first use (local:
 * no NCCL communicator yet). Caller holds the issue lock. NULL with *err. */
struct tcc__cuda *tcc__cuda_state_for(tcc_comm_t *comm, int device, const char *what, tcc_err_t *err);
/* The group's NCCL communicator, set up at its first use (a collective
 * over the host path to share the id, then NCCL's own setup, bounded by
 * deadline_ns). Caller holds the issue lock. NULL with *err. */
tcc__ncomm_t *tcc__cuda_group_ncomm(tcc_comm_t *comm, struct tcc__cuda *c, const char *what, int64_t deadline_ns,
                                  tcc_err_t *err);
/* The two-rank NCCL communicator with `peer`, set up at its first use by
 * the two of them only (the id goes over the host path's send/recv). */
tcc__ncomm_t *tcc__cuda_pair_ncomm(tcc_comm_t *comm, struct tcc__cuda *c, int peer, const char *what, int64_t deadline_ns,
                                 tcc_err_t *err);
/* Calls fn on every NCCL communicator that exists (group first). */
void tcc__cuda_each_ncomm(tcc_comm_t *comm, struct tcc__cuda *c, void (*fn)(tcc__ncomm_t *nc, void *arg), void *arg);
/* Waits up to grace_ms for the NCCL streams to go idle (destroy). */
void tcc__cuda_drain(tcc_comm_t *comm, int64_t grace_ms);
/* The communicator lets go of its stopped state: NCCL, the streams and the
 * events go now, or with the last graph that holds captured work. */
void tcc__cuda_state_free(tcc_comm_t *comm, struct tcc__cuda *c);
/* Takes a reference for the graph `stream` is capturing into, dropped when
 * CUDA destroys that graph (and its execs). */
tcc_result_t tcc__cuda_keep_for_graph(struct tcc__cuda *c, cudaStream_t stream);

/* ---- ncomm.c ---- */
/* Creates the NCCL communicator (nonblocking where NCCL has it) and its
 * stream; returns once NCCL is ready, or fails at deadline_ns, when the
 * communicator fails meanwhile, or when NCCL does. `what` names the op. */
tcc_result_t tcc__ncomm_create(tcc__ncomm_t *nc, tcc_comm_t *comm, const tcc__nccl_lib_t *lib, const char *label,
                              int nranks, const ncclUniqueId *id, int rank, const char *what, int64_t deadline_ns,
                              tcc_err_t *err);
/* Makes nc (NULL: this rank takes part in no child) by splitting `parent`
 * (ncclCommSplit, collective over parent's ranks); `comm` is the child's
 * communicator, for messages. Bounded by deadline_ns like create. */
tcc_result_t tcc__ncomm_split(tcc__ncomm_t *parent, tcc__ncomm_t *nc, tcc_comm_t *comm, const char *label, int color,
                             int key, const char *what, int64_t deadline_ns, tcc_err_t *err);
/* 1 when a call may be made on nc (then tcc__ncomm_leave after it); 0 once aborted. */
int tcc__ncomm_enter(tcc__ncomm_t *nc);
void tcc__ncomm_leave(tcc__ncomm_t *nc);
/* Waits until NCCL finished what the last calls started in the background
 * (ncclInProgress), bounded by deadline_ns and by the communicator failing. */
tcc_result_t tcc__ncomm_settle(tcc__ncomm_t *nc, const char *what, const char *call, int64_t deadline_ns,
                              tcc_err_t *err);
/* The message for NCCL call `call` of op `what` that returned r. */
tcc_result_t tcc__ncomm_failed(tcc__ncomm_t *nc, const char *what, const char *call, ncclResult_t r, tcc_err_t *err);
/* Aborts NCCL once; any thread, no lock, releases calls stuck inside NCCL. */
void tcc__ncomm_abort(tcc__ncomm_t *nc);
/* Destroys (graceful: nothing in flight) or aborts NCCL, then the stream. */
void tcc__ncomm_free(tcc__ncomm_t *nc, int graceful);

/* ---- issue.c ---- */
/* Issues the NCCL calls of `op` on n (inside tcc__ncomm_enter). Calls that
 * must follow the NCCL kernel (copying out of staging memory) are left to
 * tcc__cuda_post. */
tcc_result_t tcc__cuda_issue(tcc_comm_t *comm, tcc__ncomm_t *n, tcc_op_t *op, tcc_err_t *err);
/* Gives the op's staging memory back, in order on ncomm's stream. */
cudaError_t tcc__cuda_stage_free(tcc_op_t *op, tcc__ncomm_t *ncomm);
/* Runs after the NCCL kernel of `op` is enqueued (after ncclGroupEnd). */
tcc_result_t tcc__cuda_post(tcc_comm_t *comm, tcc__ncomm_t *n, tcc_op_t *op, tcc_err_t *err);

/* ---- watch.c ---- */
tcc_result_t tcc__cuda_watch_start(tcc_comm_t *comm, struct tcc__cuda *c, tcc_err_t *err);
/* Takes a reference on op and watches it until its event completes or its deadline passes. */
void tcc__cuda_watch(struct tcc__cuda *c, tcc_op_t *op);
/* Wakes the watchdog (the communicator failed: it aborts NCCL). */
void tcc__cuda_watch_wake(struct tcc__cuda *c);
/* Lets the watchdog drain what it watches and stop. */
void tcc__cuda_watch_stop(struct tcc__cuda *c);
/* Whether an op's event query `q` means its work is done: it completed
 * while NCCL was not being aborted. An abort ends the kernels of every op
 * in flight and their events complete with them, over half-written
 * buffers. nccl_aborted is set before the abort begins, so an event seen
 * complete (queried first) while it is still clear ended by itself. */
int tcc__cuda_ended_by_itself(struct tcc__cuda *c, cudaError_t q);
/* Finishes op once (whoever claims it first). */
void tcc__cuda_finish(tcc_op_t *op, tcc_result_t r, const char *msg);
/* Aborts the NCCL communicators once (after the communicator failed); no lock. */
void tcc__cuda_abort_nccl(tcc_comm_t *comm, struct tcc__cuda *c);

/* A completion event for `device` (the caller made it current), from a
 * process-wide pool; tcc__cuda_event_put gives it back. */
cudaEvent_t tcc__cuda_event_get(int device, cudaError_t *e);
void tcc__cuda_event_put(int device, cudaEvent_t ev);

#endif /* TCC_NCCL_STATE_H */
