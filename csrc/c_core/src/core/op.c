/*
 * op.c - the op handle: completion, waiting, callbacks, references.
 *
 * What an op does is its executor's business (core/executor.h); this file
 * holds what every op has in common, whichever executor runs it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/executor.h"
#include "core/idle_wait.h"

/* A released op's memory is kept for the communicator's next op: most
 * programs issue an op, wait for it, release it and issue the next, and
 * allocating and freeing about 700 bytes cost a tenth of a small op. Not
 * under AddressSanitizer, which must see every op freed to catch a use
 * after release. */
#if defined(__SANITIZE_ADDRESS__)
#define KEEP_SPARE_OP 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KEEP_SPARE_OP 0
#endif
#endif
#ifndef KEEP_SPARE_OP
#define KEEP_SPARE_OP 1
#endif

tcc_op_t *tcc__op_memory(tcc_comm_t *comm) {
  tcc_op_t *op = KEEP_SPARE_OP ? atomic_exchange(&comm->spare_op, NULL) : NULL;
  if (!op) return calloc(1, sizeof *op);
  memset(op, 0, sizeof *op);
  return op;
}

/* Keeps op's memory as the communicator's spare, or frees it when there is one. */
static void op_free_memory(tcc_comm_t *comm, tcc_op_t *op) {
  tcc_op_t *none = NULL;
  if (!KEEP_SPARE_OP || !atomic_compare_exchange_strong(&comm->spare_op, &none, op)) free(op);
}

const char *tcc__op_name(const tcc_op_t *op) {
  if (op->kind == TCC_OP_SEND) return "send";
  if (op->kind == TCC_OP_RECV) return "recv";
  return tcc__coll_name(op->coll.kind);
}

void tcc__op_finish(tcc_op_t *op, tcc_result_t result, const char *msg) {
  op->result = result;
  if (result != TCC_OK && msg) snprintf(op->error, sizeof op->error, "%s", msg);
  pthread_mutex_lock(&op->cb_lock);
  tcc_op_callback_t cb = op->cb;
  void *arg = op->cb_arg;
  op->cb = NULL;
  atomic_store(&op->finished, 1);
  pthread_mutex_unlock(&op->cb_lock);
  /* The callback runs before waiters wake, so when wait() returns any
   * future completed by the callback is already complete. */
  if (cb) cb(op, arg);
  /* A waiter counts itself before its last look at `finished`, and this
   * reads the count after setting it (both sequentially consistent): it
   * either sees the op finished or is counted here. */
  atomic_fetch_add(&op->finished_futex, 1);
  if (atomic_load(&op->finished_sleepers) > 0) tcc__futex_wake_all(&op->finished_futex);
}

static bool op_finished(void *op) { return atomic_load(&((tcc_op_t *)op)->finished); }

tcc_result_t tcc__op_await(tcc_op_t *op, int64_t timeout_ms) {
  const int64_t deadline_ns = timeout_ms < 0 ? INT64_MAX : tcc__deadline_after_ms(timeout_ms);
  const tcc__idle_wait_t w = {.ready = op_finished, .arg = op, .spins = op->comm->spin_iters,
                              .max_nap_ns = 100 * 1000000LL, .deadline_ns = deadline_ns,
                              .word = &op->finished_futex, .sleepers = &op->finished_sleepers};
  return tcc__idle_wait(&w) == TCC_OK ? op->result : TCC_ERR_INPROGRESS;
}

int tcc_op_test(tcc_op_t *op) {
  if (atomic_load(&op->finished)) return 1;
  return op->exec->test(op);
}

tcc_result_t tcc_op_result(const tcc_op_t *op) {
  return atomic_load(&((tcc_op_t *)op)->finished) ? op->result : TCC_ERR_INPROGRESS;
}

const char *tcc_op_error(const tcc_op_t *op) {
  return atomic_load(&((tcc_op_t *)op)->finished) ? op->error : "";
}

tcc_result_t tcc_op_wait(tcc_op_t *op, int64_t timeout_ms) {
  if (atomic_load(&op->finished)) return op->result;
  return op->exec->wait(op, timeout_ms);
}

int tcc_op_started(const tcc_op_t *op) {
  tcc_op_t *o = (tcc_op_t *)op;
  return atomic_load_explicit(&o->started, memory_order_acquire) || atomic_load(&o->finished);
}

int tcc_op_peer(const tcc_op_t *op) {
  if (op->kind == TCC_OP_COLL) return -1;
  if (op->peer != TCC_ANY_SOURCE) return op->peer;
  /* The executor sets `source` before it finishes the op. */
  return atomic_load(&((tcc_op_t *)op)->finished) ? op->source : TCC_ANY_SOURCE;
}

void tcc_op_start(tcc_op_t *op) {
  if (!atomic_load(&op->finished)) op->exec->start(op);
}

int tcc_op_is_cuda(const tcc_op_t *op) { return op->device >= 0; }

tcc_result_t tcc_op_stream_wait(tcc_op_t *op, void *stream) { return op->exec->stream_wait(op, stream); }

void *tcc_op_cuda_stream(const tcc_op_t *op) { return op->exec->work_stream ? op->exec->work_stream(op) : NULL; }

void tcc_op_on_complete(tcc_op_t *op, tcc_op_callback_t fn, void *arg) {
  pthread_mutex_lock(&op->cb_lock);
  if (!atomic_load(&op->finished)) {
    op->cb = fn;
    op->cb_arg = arg;
    pthread_mutex_unlock(&op->cb_lock);
    return;
  }
  pthread_mutex_unlock(&op->cb_lock);
  fn(op, arg);
}

void tcc_op_retain(tcc_op_t *op) { atomic_fetch_add(&op->refs, 1); }

void tcc_op_release(tcc_op_t *op) {
  if (!op) return;
  if (atomic_fetch_sub(&op->refs, 1) != 1) return;
  pthread_mutex_destroy(&op->cb_lock);
  op->exec->op_free(op);
  free(op->owned_arrays);
  tcc_comm_t *comm = op->comm;
  op_free_memory(comm, op); /* before the op's reference to comm goes */
  tcc__comm_release(comm);
}
