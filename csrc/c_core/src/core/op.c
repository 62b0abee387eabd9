/*
 * op.c - the op handle: completion, waiting, callbacks, references.
 *
 * What an op does is its executor's business (core/executor.h); this file
 * holds what every op has in common, whichever executor runs it.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/executor.h"
#include "core/idle_wait.h"

/* A released op's memory is kept for the next op its thread issues: most
 * programs issue an op, wait for it, release it and issue the next, and
 * allocating and freeing about 700 bytes cost a tenth of a small op. Kept
 * in a thread-local variable, it is taken and given back without an atomic
 * instruction or a library call (pthread_getspecific/setspecific cost 4% of
 * a small op); a pthread key, set once per thread, frees it when the thread
 * exits. Not under AddressSanitizer, which must see every op freed to catch
 * a use after release. */
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

/* One thread-local block: one lookup of it in a shared library. */
static _Thread_local struct spare {
  tcc_op_t *op;
  bool freed_at_exit; /* the key below holds this thread's block */
} spare;
static pthread_key_t spare_key;
static bool spare_key_made;
static pthread_once_t spare_key_once = PTHREAD_ONCE_INIT;

/* At thread exit, with the thread's own block (its thread-local storage
 * outlives the key's destructors). */
static void free_spare_at_exit(void *block) {
  struct spare *mine = block;
  free(mine->op);
  mine->op = NULL;
}

static void make_spare_key(void) { spare_key_made = pthread_key_create(&spare_key, free_spare_at_exit) == 0; }

/* Whether this thread may keep a spare op: the key that frees it at exit
 * holds this thread's block. */
static bool spare_usable(void) {
  if (!KEEP_SPARE_OP) return false;
  if (spare.freed_at_exit) return true;
  pthread_once(&spare_key_once, make_spare_key);
  spare.freed_at_exit = spare_key_made && pthread_setspecific(spare_key, &spare) == 0;
  return spare.freed_at_exit;
}

tcc_op_t *tcc__op_memory(void) {
  tcc_op_t *op = spare.op;
  if (!op) return calloc(1, sizeof *op);
  spare.op = NULL;
  /* All but the message buffer, which is read only up to its terminator. */
  memset(op, 0, offsetof(tcc_op_t, error));
  op->error[0] = 0;
  return op;
}

/* Keeps op's memory as this thread's spare, or frees it when there is one. */
static void op_free_memory(tcc_op_t *op) {
  if (!spare.op && spare_usable()) {
    spare.op = op;
    return;
  }
  free(op);
}

const char *tcc__op_name(const tcc_op_t *op) {
  if (op->kind == TCC_OP_SEND) return "send";
  if (op->kind == TCC_OP_RECV) return "recv";
  return tcc__coll_name(op->coll.kind);
}

/* The callback's state, op->cb_state. The finisher sets CB_RAN once; a
 * registration claims the slot, fills it, then marks it set. Whoever
 * moves the state second runs the callback: the finisher when it was
 * set, the registration when the op finished first (even while it was
 * filling the slot). Two atomic instructions each side, no lock. */
enum { CB_NONE, CB_CLAIMED, CB_SET, CB_RAN };

void tcc__op_finish(tcc_op_t *op, tcc_result_t result, const char *msg) {
  op->result = result;
  if (result != TCC_OK && msg) snprintf(op->error, sizeof op->error, "%s", msg);
  /* Finished before the callback state moves: a registration that finds
   * CB_RAN runs its callback on an op that reads as finished. */
  atomic_store(&op->finished, 1);
  /* The callback runs before sleeping waiters are woken (a spinning one
   * may return first: wait() does not promise it ran). */
  if (atomic_exchange(&op->cb_state, CB_RAN) == CB_SET) op->cb(op, op->cb_arg);
  /* A waiter counts itself before its last look at `finished`, and this
   * reads the count after setting it (both sequentially consistent): it
   * either sees the op finished or is counted here, and then the word
   * changes after it was read (idle_wait.c). */
  if (atomic_load(&op->finished_sleepers) > 0) {
    atomic_fetch_add(&op->finished_futex, 1);
    tcc__futex_wake_all(&op->finished_futex);
  }
}

static bool op_finished(void *op) { return atomic_load(&((tcc_op_t *)op)->finished); }

tcc_result_t tcc__op_await(tcc_op_t *op, int64_t timeout_ms) {
  const int64_t deadline_ns = timeout_ms < 0 ? INT64_MAX : tcc__deadline_after_ms(timeout_ms);
  const tcc__idle_wait_t w = {.ready = op_finished, .arg = op, .spins = op->comm->cpu_share.spins,
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

tcc_result_t tcc_op_on_complete(tcc_op_t *op, tcc_op_callback_t fn, void *arg) {
  int state = CB_NONE;
  if (!atomic_compare_exchange_strong(&op->cb_state, &state, CB_CLAIMED)) {
    if (state != CB_RAN)
      return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': the op has a completion callback already", tcc__op_name(op),
                       op->comm->name);
    fn(op, arg); /* finished before: at once */
    return TCC_OK;
  }
  op->cb = fn;
  op->cb_arg = arg;
  state = CB_CLAIMED;
  if (!atomic_compare_exchange_strong(&op->cb_state, &state, CB_SET)) fn(op, arg); /* it finished meanwhile */
  return TCC_OK;
}

void tcc_op_retain(tcc_op_t *op) { atomic_fetch_add(&op->refs, 1); }

void tcc_op_release(tcc_op_t *op) {
  if (!op) return;
  if (atomic_fetch_sub(&op->refs, 1) != 1) return;
  op->exec->op_free(op);
  if (op->owned_arrays) free(op->owned_arrays); /* groups of more than TCC_OP_INLINE_RANKS only */
  tcc_comm_t *comm = op->comm;
  op_free_memory(op);
  tcc__comm_release(comm);
}
