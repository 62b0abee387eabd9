/*
 * idle_wait.h - the one way a thread of the core waits for something
 * another thread or process signals through shared memory: an op that
 * finishes, every rank at a stage barrier, a window signal.
 *
 * It spins first (cheap when the other side runs on another core), then
 * yields (lets a peer that shares this core run), then sleeps on a futex
 * word in bounded naps (a wake-up lost to a race costs at most one nap).
 * A caller that knows where the other side runs (peer_here) spins on,
 * instead of yielding, while it runs on another CPU: see cpu_share.h.
 * How long each phase lasts is the caller's: a single place to tune how
 * waiting behaves when cores are shared.
 */
#ifndef TCC_CORE_IDLE_WAIT_H
#define TCC_CORE_IDLE_WAIT_H

#include "core/base.h"

typedef struct tcc__idle_wait {
  /* true once the awaited condition holds; called often, keep it cheap */
  bool (*ready)(void *arg);
  /* Called once per yield or nap with the current time (NULL: nothing to
   * check): anything but TCC_OK ends the wait with that result (abort, a
   * dead peer). */
  tcc_result_t (*check)(void *arg, int64_t now_ns);
  void *arg;
  int spins;          /* busy polls before the first yield */
  /* NULL, or whether a party waited for last ran on this thread's CPU:
   * while it says no, the wait spins on, for up to away_spin_ns, before
   * it yields. */
  bool (*peer_here)(void *arg);
  int64_t away_spin_ns;
  int yields;         /* sched_yield rounds before the first nap */
  int64_t max_nap_ns; /* longest single sleep */
  int64_t deadline_ns;
  atomic_uint *word;     /* the futex the waker bumps and wakes */
  atomic_int *sleepers;  /* counted while asleep, so wakers wake only when needed; may be NULL */
} tcc__idle_wait_t;

/* TCC_OK once ready; TCC_ERR_TIMEOUT once deadline_ns passed; else what
 * check returned. */
tcc_result_t tcc__idle_wait(const tcc__idle_wait_t *w);

#endif /* TCC_CORE_IDLE_WAIT_H */
