/*
 * idle_wait.c - see idle_wait.h.
 */
#include <sched.h>

#include "core/idle_wait.h"

/* Polls between two looks at the clock in the timed spin, and between
 * two calls of `check` there (about 1 us and 10 us). */
#define POLLS_PER_CLOCK 64
#define CLOCKS_PER_CHECK 16

/* The timed part of the spin: TCC_OK once ready, TCC_ERR_INPROGRESS when
 * spin_ns (or the deadline) passed, else what check returned. */
static tcc_result_t spin_for(const tcc__idle_wait_t *w) {
  const int64_t start = tcc__now_ns();
  int64_t until = start + w->spin_ns;
  if (until > w->deadline_ns) until = w->deadline_ns;
  for (int clocks = 1;; clocks++) {
    for (int i = 0; i < POLLS_PER_CLOCK; i++) {
      if (w->ready(w->arg)) return TCC_OK;
      tcc_cpu_relax();
    }
    const int64_t now = tcc__now_ns();
    if (now >= until) return TCC_ERR_INPROGRESS;
    if (w->check && clocks % CLOCKS_PER_CHECK == 0) {
      tcc_result_t r = w->check(w->arg, now);
      if (r != TCC_OK) return r;
    }
  }
}

tcc_result_t tcc__idle_wait(const tcc__idle_wait_t *w) {
  if (w->napped) *w->napped = false;
  for (int i = 0; i < w->spins; i++) {
    if (w->ready(w->arg)) return TCC_OK;
    tcc_cpu_relax();
  }
  if (w->spin_ns > 0) {
    tcc_result_t r = spin_for(w);
    if (r != TCC_ERR_INPROGRESS) return r;
  }
  for (int round = 0;; round++) {
    if (w->ready(w->arg)) return TCC_OK;
    int64_t now = tcc__now_ns();
    if (w->check) {
      tcc_result_t r = w->check(w->arg, now);
      if (r != TCC_OK) return r;
    }
    if (now >= w->deadline_ns) return TCC_ERR_TIMEOUT;
    if (round < w->yields) {
      sched_yield();
      continue;
    }
    if (w->napped) *w->napped = true;
    if (w->sleepers) atomic_fetch_add(w->sleepers, 1);
    /* Read the word before the last look at the condition: a wake after
     * that look changes the word, and the futex then returns at once. */
    unsigned seen = atomic_load(w->word);
    if (!w->ready(w->arg)) {
      int64_t nap = w->deadline_ns - now;
      if (nap > w->max_nap_ns) nap = w->max_nap_ns;
      tcc__futex_wait(w->word, seen, nap);
    }
    if (w->sleepers) atomic_fetch_sub(w->sleepers, 1);
  }
}
