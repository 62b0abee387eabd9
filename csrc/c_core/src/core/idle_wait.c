/*
 * idle_wait.c - see idle_wait.h.
 */
#include <sched.h>

#include "core/idle_wait.h"

/* Polls between two looks at the clock (and checks) while spinning on. */
#define AWAY_SPIN_POLLS 256

tcc_result_t tcc__idle_wait(const tcc__idle_wait_t *w) {
  for (int i = 0; i < w->spins; i++) {
    if (w->ready(w->arg)) return TCC_OK;
    tcc_cpu_relax();
  }
  int64_t spin_until = 0;
  for (int round = 0;; round++) {
    if (w->ready(w->arg)) return TCC_OK;
    int64_t now = tcc__now_ns();
    if (w->check) {
      tcc_result_t r = w->check(w->arg, now);
      if (r != TCC_OK) return r;
    }
    if (now >= w->deadline_ns) return TCC_ERR_TIMEOUT;
    if (w->peer_here && !w->peer_here(w->arg)) {
      if (spin_until == 0) spin_until = now + w->away_spin_ns;
      if (now < spin_until) {
        for (int i = 0; i < AWAY_SPIN_POLLS && !w->ready(w->arg); i++) tcc_cpu_relax();
        round--; /* not a yield */
        continue;
      }
    }
    if (round < w->yields) {
      sched_yield();
      continue;
    }
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
