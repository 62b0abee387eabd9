/*
 * base.h - what every file of the C core uses: error records, clocks and
 * waiting, descriptors across fork, the reduction kernels. Depends on
 * nothing but the public header.
 */
#ifndef TCC_CORE_BASE_H
#define TCC_CORE_BASE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "tccomm.h"

#define TCC_ERRLEN 512
#define TCC_CACHELINE 64 /* bytes; what hot shared counters are aligned to */
#define TCC_MAX_RANKS 1024

/* tcc_dtype_size, inline: every op's path asks it several times. 0 for an
 * invalid dtype. */
static inline size_t tcc__dtype_size(tcc_dtype_t dt) {
  _Static_assert(TCC_DTYPE_COUNT == 10, "a new dtype needs its size here");
  static const unsigned char sizes[TCC_DTYPE_COUNT] = {
      [TCC_FLOAT32] = 4, [TCC_FLOAT64] = 8, [TCC_FLOAT16] = 2, [TCC_BFLOAT16] = 2, [TCC_INT8] = 1,
      [TCC_INT16] = 2,   [TCC_INT32] = 4,   [TCC_INT64] = 8,   [TCC_UINT8] = 1,    [TCC_BOOL] = 1};
  return (unsigned)dt < TCC_DTYPE_COUNT ? sizes[dt] : 0;
}

/* ---- errors ---------------------------------------------------------- */

typedef struct tcc_err {
  tcc_result_t code;
  char msg[TCC_ERRLEN];
} tcc_err_t;

/* Makes *err empty (no code, no message) without clearing the whole
 * message buffer: an initializer would zero half a KiB, on every op's path. */
static inline void tcc__err_reset(tcc_err_t *err) {
  err->code = TCC_OK;
  err->msg[0] = 0;
}

/* Records a failing call's message as this thread's last error
 * (tcc_last_error) and returns code. */
tcc_result_t tcc__fail(tcc_result_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same for a cause collected in a tcc_err_t (err->code, err->msg);
 * falls back to the result's name when no message was set. */
tcc_result_t tcc__fail_with(const tcc_err_t *err, tcc_result_t code);

/* Records code + printf-style message in err (if not NULL and not already
 * set) and returns code. */
tcc_result_t tcc__err_set(tcc_err_t *err, tcc_result_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Puts a printf-style prefix in front of err's message (set to `code`
 * first when it has none), for a caller that knows more about what failed
 * than the callee that wrote it; the message's end is cut when it must.
 * Returns code. */
tcc_result_t tcc__err_prefix(tcc_err_t *err, tcc_result_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- time and waiting ------------------------------------------------ */

int64_t tcc__now_ns(void); /* CLOCK_MONOTONIC */
/* The same clock at the resolution of the kernel's tick (a few ms) and a
 * fraction of the cost: never ahead of tcc__now_ns(). For time stamps that
 * only decide between polling and sleeping. */
int64_t tcc__coarse_now_ns(void);
/* tcc__now_ns() + timeout_ms, saturated at INT64_MAX: a huge timeout means
 * "practically never" instead of wrapping into the past. A negative timeout
 * counts as 0 (the deadline is now). */
int64_t tcc__deadline_after_ms(int64_t timeout_ms);
/* The same deadline from the coarse clock, at a quarter of the cost:
 * never earlier than tcc__deadline_after_ms would give, and later by at
 * most two ticks of that clock (a few ms). For an op's deadline, set on
 * every op. */
int64_t tcc__coarse_deadline_after_ms(int64_t timeout_ms);

/* A condition variable whose timed waits take tcc__now_ns() deadlines. */
void tcc__cond_init_monotonic(pthread_cond_t *cv);

/* Futex on a 32-bit word that may live in process-shared memory. */
void tcc__futex_wait(atomic_uint *word, unsigned expected, int64_t max_ns);
void tcc__futex_wake_all(atomic_uint *word);

static inline void tcc_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* ---- descriptors and fork (forksafe.c) -------------------------------- */

/* Registers fd to be closed in a child made by fork(): its copy would keep
 * a dead parent's connections and liveness lock alive. */
void tcc__fd_close_on_fork(int fd);
/* Closes a registered (or unregistered) fd and forgets it. */
void tcc__fd_close(int fd);

/* ---- reductions (reduce.c) ------------------------------------------- */

/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], applied in
 * that order (so every rank that runs it gets the same bits).
 * AVG divides the sum by nsrc; PREMUL_SUM multiplies each source by
 * premul before summing. float16/bfloat16 accumulate in float32 and round
 * once. dst may be the very same pointer as one of srcs (never a partial
 * overlap). The caller has checked tcc_redop_supported(). */
void tcc__reduce_n(void *dst, const void *const *srcs, int nsrc, size_t count,
                  tcc_dtype_t dtype, tcc_redop_t op, double premul);
/* AVG's last step on a sum reduced elsewhere (a hierarchical allreduce sums
 * in phases): each element divided by n as tcc__reduce_n's AVG divides its
 * sum, so the bits are those of an AVG over the same order. float16,
 * bfloat16 and bool are left alone (their AVG is never split). */
void tcc__reduce_average(void *buf, size_t count, tcc_dtype_t dtype, int n);
/* float16/bfloat16 <-> float32, as the reduction kernels convert: widening
 * is exact, narrowing rounds to nearest even (NaNs stay NaNs). For a
 * reduction of half values carried out in float32 phases, rounded once at
 * the end. `half` is TCC_FLOAT16 or TCC_BFLOAT16; others do nothing. */
void tcc__half_widen(float *dst, const void *half_src, size_t count, tcc_dtype_t half);
void tcc__half_narrow(void *half_dst, const float *src, size_t count, tcc_dtype_t half);

#endif /* TCC_CORE_BASE_H */
