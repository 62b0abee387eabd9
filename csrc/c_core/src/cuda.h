/*
 * cuda.h - what the rest of the core sees of the CUDA path (cuda_comm.c).
 *
 * A buffer with device >= 0 is CUDA memory. Ops on such buffers do not go
 * through the engine's queues: the issuing thread enqueues them on the
 * communicator's NCCL stream (enqueueing is cheap and must happen in the
 * caller's stream order), completion is a CUDA event, and a watchdog thread
 * per communicator reaps completed ops and enforces deadlines. In a build
 * without TCC_WITH_CUDA these functions exist and report that CUDA is
 * missing, so callers need no #ifdef.
 */
#ifndef TCC_CUDA_H
#define TCC_CUDA_H

#include "internal.h"

/* Enqueues `op` (a collective with op->coll filled in, or a send / recv)
 * for buffers on `device`, ordered after the caller's `stream`. On success
 * the op is running or done; on failure *err says why and the caller's op
 * reference has been released. */
tcc_result_t tcc_cuda_submit(tcc_comm_t *comm, tcc_op_t *op, int device, void *stream, tcc_err_t *err);

/* tcc_op_test for a CUDA op: queries its event (safe during a capture). */
int tcc_cuda_op_test(tcc_op_t *op);
/* Releases the CUDA resources of an op being freed. */
void tcc_cuda_op_free(tcc_op_t *op);
/* Wakes the watchdog after the communicator failed (it aborts NCCL). */
void tcc_cuda_wake(tcc_comm_t *comm);
/* Waits for the CUDA ops already issued (each bounded by its deadline),
 * then releases the NCCL communicator, stream and watchdog. */
void tcc_cuda_destroy(tcc_comm_t *comm);

#endif /* TCC_CUDA_H */
