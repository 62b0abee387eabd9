/*
 * fake_gpu.h - the seams of the test doubles of the CUDA runtime
 * (fake_cudart.c, built as libcudart.so.13) and of NCCL (fake_nccl.c,
 * built as libnccl.so.2). They let the core's CUDA path run in CI on a
 * machine without a GPU; they never ship.
 *
 * Device memory is host memory. A stream is a queue run by its own worker
 * thread, which sleeps a random delay before each entry, so events
 * complete late and ordering bugs show. Stream capture is a state machine
 * that refuses what real capture refuses. NCCL ranks are processes that
 * meet through shared memory named after the unique id; NCCL's device work
 * is a task the fake NCCL enqueues on the fake runtime's stream.
 *
 * Both libraries are compiled against the real cuda_runtime_api.h and
 * nccl.h, so the ABI the core sees is the real one.
 */
#ifndef TCC_FAKE_GPU_H
#define TCC_FAKE_GPU_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- between the fake NCCL and the fake runtime ---------------------------- */

/* A unit of device work (what a kernel is to real CUDA). The stream's
 * worker calls reset (if not NULL) before each execution, then step until
 * it returns 1; 0 means "not finished, call again" (the worker naps a few
 * microseconds in between, other streams go on meanwhile). A graph replays
 * the same task once per launch, hence reset. release (if not NULL) runs
 * once when nothing refers to the task any more: after its eager run, or
 * when the last graph (or graph exec) holding it is destroyed. */
typedef struct fake_task {
  int (*step)(void *arg);
  void (*reset)(void *arg);
  void (*release)(void *arg);
  void *arg;
  const char *name; /* for diagnostics */
} fake_task_t;

/* Enqueues a copy of *task on `stream` (NULL: the current device's legacy
 * default stream); recorded into the capture instead when the stream is
 * capturing. cudaSuccess, or the error a kernel launch would get there
 * (capture invalidated, destroyed stream). On error, release is not
 * called: the caller still owns arg. */
cudaError_t fake_cuda_enqueue(cudaStream_t stream, const fake_task_t *task);

/* ---- the fake runtime's controls, for tests -------------------------------- */

/* Devices reported by cudaGetDeviceCount (default: $FAKE_CUDA_DEVICES or 8;
 * 0 makes it answer cudaErrorNoDevice). */
void fake_cuda_set_device_count(int n);
/* Largest random delay before each stream entry, in microseconds
 * (default: $FAKE_CUDA_DELAY_US or 200; the sequence is seeded from
 * $FAKE_CUDA_SEED, default 1, mixed with the pid). */
void fake_cuda_set_delay_us(int max_us);
/* Device memory allocated and not yet freed, in bytes. */
size_t fake_cuda_bytes_in_use(void);
/* Allocations that would take the bytes in use past `bytes` fail with
 * cudaErrorMemoryAllocation (0: no limit, the default). */
void fake_cuda_set_memory_limit(size_t bytes);
/* User objects (cudaUserObjectCreate) whose destructor has not run. */
int fake_cuda_user_objects_alive(void);
/* Entries queued or running on `stream`, 0 when it is idle. */
int fake_cuda_stream_pending(cudaStream_t stream);

/* ---- the fake NCCL's controls, for tests ----------------------------------- */

typedef enum fake_nccl_fault {
  FAKE_NCCL_NONE = 0,
  FAKE_NCCL_FAIL,        /* the call returns ncclSystemError and does nothing */
  FAKE_NCCL_BLOCK,       /* the host call blocks until the communicator is aborted,
                            then returns ncclSystemError (ncclCommInitRank*: blocks
                            forever, as a peer that never joins makes it) */
  FAKE_NCCL_INPROGRESS,  /* on a nonblocking communicator the call returns
                            ncclInProgress and completes in the background after
                            $FAKE_NCCL_INPROGRESS_MS (default 50) ms: its device
                            work is enqueued only then; on a blocking one the
                            call takes that long */
  FAKE_NCCL_HANG_KERNEL, /* the call succeeds, its device work never finishes
                            (until the communicator is aborted) */
  FAKE_NCCL_ASYNC_ERROR, /* the call succeeds, its device work ends at once and
                            ncclCommGetAsyncError reports ncclRemoteError from
                            then on */
} fake_nccl_fault_t;

/* Makes this process's nth call (1-based, counted per name from now on) of
 * the NCCL function `call` (e.g. "ncclAllReduce", "ncclCommInitRankConfig",
 * "ncclGroupEnd") fault as `fault`. Several rules may be active. */
void fake_nccl_inject(const char *call, int nth, fake_nccl_fault_t fault);
void fake_nccl_clear_faults(void);
/* Calls of `call` made by this process so far. */
int fake_nccl_calls(const char *call);
/* Communicators created by this process and neither destroyed nor aborted. */
int fake_nccl_comms_alive(void);

#ifdef __cplusplus
}
#endif

#endif /* TCC_FAKE_GPU_H */
