/*
 * cpu_share.c - see cpu_share.h.
 */
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "core/cpu_share.h"
#include "core/log.h"

#define SHARED_WINDOW_NS (10 * 1000000LL)
/* At most one move per interval: the scheduler gets time to settle. */
#define MOVE_INTERVAL_NS (5 * 1000000LL)

int tcc__cpu_now(void) { return sched_getcpu(); }

/* Per thread: the moves concern the thread that waits. */
static _Thread_local struct {
  int shared_waits;        /* waits that found the awaited rank on this CPU */
  int64_t first_shared_ns; /* when the first of them was */
  int64_t last_move_ns;
  int moves, moved_from, moved_to;
} mover;

int tcc__cpu_moves(int *from, int *to) {
  if (from) *from = mover.moved_from;
  if (to) *to = mover.moved_to;
  return mover.moves;
}

int tcc__cpus_allowed(void) {
  cpu_set_t allowed;
  return sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : 0;
}

int tcc__cpu_mask(uint64_t *mask, int bits) {
  memset(mask, 0, (size_t)(bits / 64) * sizeof *mask);
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 0;
  for (int c = 0; c < bits && c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &allowed)) mask[c / 64] |= 1ull << (c % 64);
  return CPU_COUNT(&allowed);
}

int tcc__cpus_between(const uint64_t *const *masks, const uint16_t *counts, int n, int bits) {
  if (n <= 0) return 0;
  int fewest = INT_MAX;
  bool whole = true;
  for (int r = 0; r < n; r++) {
    if (counts[r] == 0) return 0;
    if (counts[r] < fewest) fewest = counts[r];
    int in_mask = 0;
    for (int w = 0; w < bits / 64; w++) in_mask += __builtin_popcountll(masks[r][w]);
    whole = whole && in_mask == counts[r];
  }
  if (!whole) return fewest;
  int between = 0;
  for (int w = 0; w < bits / 64; w++) {
    uint64_t any = 0;
    for (int r = 0; r < n; r++) any |= masks[r][w];
    between += __builtin_popcountll(any);
  }
  return between;
}

void tcc__cpu_share_init(tcc__cpu_share_t *s, int local_ranks, int cpus, char *why, size_t why_len) {
  memset(s, 0, sizeof *s);
  s->spins = TCC_SPINS_SHARED;
  if (cpus <= 0) {
    snprintf(why, why_len, "the CPUs the ranks may use are not known: waiters yield at once");
    return;
  }
  if (local_ranks > cpus) {
    snprintf(why, why_len, "%d ranks on this host, %d CPU(s) between them: waiters yield at once", local_ranks,
             cpus);
    return;
  }
  s->spin_while_away = true;
  s->spins = TCC_SPINS_OWN_CPU;
  const int own = tcc__cpus_allowed();
  const char *env = getenv("TCCOMM_CPU_MOVE");
  s->may_move = own >= 2 && !(env && strcmp(env, "0") == 0);
  snprintf(why, why_len,
           "%d ranks on this host, %d CPU(s) between them: waiters spin while the awaited rank runs elsewhere, %s",
           local_ranks, cpus,
           s->may_move ? "and leave a CPU it shares with them"
           : own < 2   ? "this rank may use one CPU: never move"
                       : "moving off (TCCOMM_CPU_MOVE=0)");
}

/* Leaves the CPU this thread runs on for another one it may use: the
 * affinity without this CPU forces the migration, the original affinity,
 * restored at once, leaves the scheduler free again. */
static void move_off_this_cpu(void) {
  cpu_set_t allowed, elsewhere;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  const int here = sched_getcpu();
  if (here < 0 || !CPU_ISSET(here, &allowed) || CPU_COUNT(&allowed) < 2) return;
  elsewhere = allowed;
  CPU_CLR(here, &elsewhere);
  /* Returns once this thread runs on one of `elsewhere`'s CPUs. */
  if (sched_setaffinity(0, sizeof elsewhere, &elsewhere) != 0) return;
  const int there = sched_getcpu();
  sched_setaffinity(0, sizeof allowed, &allowed);
  mover.moves++;
  mover.moved_from = here;
  mover.moved_to = there;
  TCC_LOG_TRACE(-1, "moved off CPU %d, shared with the rank waited for, to CPU %d", here, there);
}

void tcc__cpu_share_after_wait(const tcc__cpu_share_t *s, bool shared) {
  if (!s->may_move || !shared) return;
  const int64_t now = tcc__now_ns();
  if (mover.shared_waits == 0 || now - mover.first_shared_ns > SHARED_WINDOW_NS) {
    mover.shared_waits = 0;
    mover.first_shared_ns = now;
  }
  if (++mover.shared_waits < TCC_SHARED_WAITS_TO_MOVE || now - mover.last_move_ns < MOVE_INTERVAL_NS) return;
  mover.shared_waits = 0;
  mover.last_move_ns = now;
  move_off_this_cpu();
}

/* Whether this thread was preempted since it last looked: another thread
 * ran on its CPU while it could have. (Weighing the time it lost as well
 * measured no better: 8 B allreduces over TCP with a core busy took 100 us
 * backing off only after 50 us or more lost, 66 us after any preemption.)
 * It looks at most once per PREEMPTION_LOOK_NS: the count it reads
 * (getrusage, about 0.2 us here) keeps every preemption until the next
 * look, and a small op over TCP takes 6 us, of which the look was one
 * system call in seven. A look deferred that long comes well inside the
 * scheduler's tick (a busy process takes the CPU back every few ms). */
#define PREEMPTION_LOOK_NS (50 * 1000LL)

static bool thread_preempted(void) {
  static _Thread_local long seen;
  static _Thread_local int64_t looked_ns;
  const int64_t now = tcc__now_ns();
  if (now - looked_ns < PREEMPTION_LOOK_NS) return false;
  looked_ns = now;
  struct rusage ru;
  if (getrusage(RUSAGE_THREAD, &ru) != 0) return false;
  const bool more = ru.ru_nivcsw > seen;
  seen = ru.ru_nivcsw;
  return more;
}

bool tcc__spin_gate_open(tcc__spin_gate_t *g, const tcc__cpu_share_t *s, bool preemption_shuts) {
  if (!s->spin_while_away) return false;
  if (g->backoff > 0) {
    g->backoff--;
    return false;
  }
  if (preemption_shuts && thread_preempted()) {
    g->backoff = TCC_SPIN_BACKOFF_WAITS;
    return false;
  }
  return true;
}

void tcc__spin_gate_missed(tcc__spin_gate_t *g) { g->backoff = TCC_SPIN_BACKOFF_WAITS; }
