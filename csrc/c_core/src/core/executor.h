/*
 * executor.h - what runs an op: the one interface between the generic core
 * (communicators, op handles, the public entry points) and the code that
 * moves data.
 *
 * Two executors exist. The host executor (host/) runs ops on host memory
 * through the communicator's transport and the algorithms of coll/. The
 * device executor runs ops on CUDA memory through NCCL (nccl/); a build
 * without CUDA links nccl/no_nccl.c in its place, which rejects device
 * buffers. The core picks the executor from the op's buffers (device -1:
 * host) and from then on talks to the op only through op->exec, so no
 * generic file knows CUDA.
 *
 * Every communicator has both: attach runs at creation, stop at destroy
 * (device first: its completion may still reach the host side), release
 * when the last reference goes.
 */
#ifndef TCC_CORE_EXECUTOR_H
#define TCC_CORE_EXECUTOR_H

#include "core/internal.h"

struct tcc__executor {
  const char *name;
  /* How messages name the memory it serves: "host memory", or a device
   * kind that the device number follows ("CUDA device" 0). */
  const char *memory_name;
  /* TCC_OK when this build can run ops on buffers of `device`; else the
   * reason, recorded as the calling thread's last error (tcc__fail),
   * naming the op `what` and the buffer's `role`. NULL: every device. */
  tcc_result_t (*accepts)(tcc_comm_t *comm, const char *what, const char *role, int device);
  /* Sets up the executor's per-communicator state (may start threads). */
  tcc_result_t (*attach)(tcc_comm_t *comm, tcc_err_t *err);
  /* Takes over a fully built op (the caller keeps its own reference) and
   * starts it; `stream` is the caller's stream for device ops. On failure
   * *err says why and the op was never started (the caller releases it). */
  tcc_result_t (*submit)(tcc_comm_t *comm, tcc_op_t *op, void *stream, tcc_err_t *err);
  /* A collective whose caller waits for it at once (no op handle): runs
   * it in the calling thread, with no op, when it can go before anything
   * else; *result is its result and *err says why it failed. False, with
   * nothing done, when it must be submitted as an op. NULL: always false. */
  bool (*run_now)(tcc_comm_t *comm, tcc_coll_t *c, int64_t timeout_ms, tcc_result_t *result, tcc_err_t *err);
  /* A send or receive whose caller waits for it at once (no op handle),
   * built but not submitted: runs it in the calling thread when nothing
   * issued before it waits to be taken; true then, and the op finished
   * unless destroy began meanwhile (the caller waits for it as for any
   * op, and keeps its own reference). False, with nothing done, when it
   * must be submitted. NULL: always false. */
  bool (*p2p_now)(tcc_comm_t *comm, tcc_op_t *op);
  /* Before p2p_now: moves the send or receive with no op at all when it
   * can; true then, with *result its result and *err why it failed.
   * False, with nothing done, otherwise. NULL: always false. */
  bool (*p2p_move_now)(tcc_comm_t *comm, tcc_op_kind_t kind, void *buf, size_t bytes, int peer, uint64_t tag,
                       tcc_result_t *result, tcc_err_t *err);
  /* Why a blocking call (no op handle) on this executor's memory would
   * never return if made now, or NULL when it may be made. NULL entry:
   * always. */
  const char *(*cannot_block)(tcc_comm_t *comm);
  /* 1 once the op finished; may poll the device, never blocks. */
  int (*test)(tcc_op_t *op);
  /* Blocks until the op finished or timeout_ms (< 0: no limit) passed;
   * the op's result, or TCC_ERR_INPROGRESS on timeout. */
  tcc_result_t (*wait)(tcc_op_t *op, int64_t timeout_ms);
  /* Makes sure the op progresses without a waiter (futures, polling). */
  void (*start)(tcc_op_t *op);
  /* Makes `stream` wait for the op's completion (device ops; host: no-op). */
  tcc_result_t (*stream_wait)(tcc_op_t *op, void *stream);
  /* The stream the op's device work runs on; NULL: none (host ops, or not
   * issued). NULL entry: never one. */
  void *(*work_stream)(const tcc_op_t *op);
  /* Frees the executor's per-op state of an op being freed. */
  void (*op_free)(tcc_op_t *op);
  /* The communicator failed (comm->aborted is set): wake every thread
   * that waits on it, abort what cannot end otherwise. Any thread. */
  void (*wake)(tcc_comm_t *comm);
  /* The outermost tcc_comm_group_end: issue what the group collected. */
  tcc_result_t (*group_end)(tcc_comm_t *comm, tcc_err_t *err);
  /* Destroy, before anything is failed: lets work already handed to a
   * device finish (the caller may rightly have only made a stream wait for
   * it), for at most grace_ms. NULL: nothing runs on its own. */
  void (*drain)(tcc_comm_t *comm, int64_t grace_ms);
  /* Destroy: pending ops fail or finish, threads stop. */
  void (*stop)(tcc_comm_t *comm);
  /* The communicator's last reference went: free the per-communicator state. */
  void (*release)(tcc_comm_t *comm);
};

extern const tcc__executor_t tcc__host_executor;   /* host/executor.c */
extern const tcc__executor_t tcc__device_executor; /* nccl/executor.c or nccl/no_nccl.c */

/* Whether tcc_comm_group_start is open on this communicator. */
static inline int tcc__comm_in_group(tcc_comm_t *comm) { return atomic_load(&comm->group_depth) > 0; }

/* Sleeps until op finished or timeout_ms (< 0: no limit) passed
 * (core/idle_wait.h, spinning comm->cpu_share.spins first). The op's result, or
 * TCC_ERR_INPROGRESS at the deadline. What every executor's wait ends in. */
tcc_result_t tcc__op_await(tcc_op_t *op, int64_t timeout_ms);

#endif /* TCC_CORE_EXECUTOR_H */
