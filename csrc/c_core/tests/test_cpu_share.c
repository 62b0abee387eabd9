/*
 * test_cpu_share.c - waiting when CPUs are shared (core/cpu_share.h,
 * core/idle_wait.h): which waits spin on and which may move, that a move
 * leaves the CPU and restores the affinity exactly, that spinning on
 * still ends at a deadline or a failure, and when the spin gate of waits
 * that cannot see their peer's CPU (TCP) lets them spin.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/cpu_share.h"
#include "core/idle_wait.h"
#include "core/internal.h"
#include "group.h"

static int allowed_cpus(cpu_set_t *set) {
  CHECK(sched_getaffinity(0, sizeof *set, set) == 0, "sched_getaffinity");
  return CPU_COUNT(set);
}

static void test_decisions(void) {
  cpu_set_t set;
  const int cpus = allowed_cpus(&set);
  tcc__cpu_share_t s;
  char why[160];

  tcc__cpu_share_init(&s, cpus + 1, tcc__cpus_allowed(), why, sizeof why);
  CHECK(!s.spin_while_away && !s.may_move, "more ranks than CPUs: spin %d move %d", s.spin_while_away, s.may_move);
  CHECK(s.spins == TCC_SPINS_SHARED, "more ranks than CPUs: %d polls before a yield", s.spins);
  CHECK(strstr(why, "yield at once") != NULL, "why: %s", why);

  tcc__cpu_share_init(&s, cpus, tcc__cpus_allowed(), why, sizeof why);
  CHECK(s.spin_while_away, "as many ranks as CPUs spin while away: %s", why);
  CHECK(s.spins == TCC_SPINS_OWN_CPU, "as many ranks as CPUs: %d polls before a yield", s.spins);
  CHECK(s.may_move == (cpus >= 2), "may move with %d CPUs: %d (%s)", cpus, s.may_move, why);

  setenv("TCCOMM_CPU_MOVE", "0", 1);
  tcc__cpu_share_init(&s, 1, tcc__cpus_allowed(), why, sizeof why);
  CHECK(s.spin_while_away && !s.may_move, "TCCOMM_CPU_MOVE=0: spin %d move %d", s.spin_while_away, s.may_move);
  CHECK(strstr(why, "TCCOMM_CPU_MOVE=0") != NULL || cpus < 2, "why: %s", why);
  unsetenv("TCCOMM_CPU_MOVE");

  /* A thread pinned to one CPU never moves (nowhere to go). */
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(tcc__cpu_now() >= 0 ? tcc__cpu_now() : 0, &one);
  if (sched_setaffinity(0, sizeof one, &one) == 0) {
    tcc__cpu_share_init(&s, 1, tcc__cpus_allowed(), why, sizeof why);
    CHECK(s.spin_while_away && !s.may_move, "one CPU allowed: spin %d move %d (%s)", s.spin_while_away, s.may_move,
          why);
    /* Two ranks pinned to one CPU: the awaited one is queued behind the waiter. */
    tcc__cpu_share_init(&s, 2, tcc__cpus_allowed(), why, sizeof why);
    CHECK(!s.spin_while_away && s.spins == TCC_SPINS_SHARED, "2 ranks on one allowed CPU: spin %d, %d polls (%s)",
          s.spin_while_away, s.spins, why);
    for (int i = 0; i < 64; i++) tcc__cpu_share_after_wait(&s, true);
    CHECK(tcc__cpu_moves(NULL, NULL) == 0, "moved %d times with one CPU", tcc__cpu_moves(NULL, NULL));
    CHECK(sched_setaffinity(0, sizeof set, &set) == 0, "affinity restored by the test");
  }
}

static void test_moves(void) {
  cpu_set_t before;
  if (allowed_cpus(&before) < 2) {
    fprintf(stderr, "test_cpu_share: moves not tested: this thread may use only one CPU\n");
    return;
  }
  if (sched_setaffinity(0, sizeof before, &before) != 0) {
    fprintf(stderr, "test_cpu_share: moves not tested: this thread may not set its CPU affinity\n");
    return;
  }
  tcc__cpu_share_t s;
  char why[160];
  tcc__cpu_share_init(&s, 2, tcc__cpus_allowed(), why, sizeof why);
  CHECK(s.may_move, "two ranks, two CPUs or more: %s", why);

  /* Waits that did not share a CPU never count. */
  for (int i = 0; i < 100; i++) tcc__cpu_share_after_wait(&s, false);
  CHECK(tcc__cpu_moves(NULL, NULL) == 0, "moved after unshared waits");
  /* Groups whose ranks outnumber the CPUs never move. */
  tcc__cpu_share_t crowded;
  tcc__cpu_share_init(&crowded, CPU_COUNT(&before) + 1, tcc__cpus_allowed(), why, sizeof why);
  for (int i = 0; i < 100; i++) tcc__cpu_share_after_wait(&crowded, true);
  CHECK(tcc__cpu_moves(NULL, NULL) == 0, "moved in a group with more ranks than CPUs");
  /* One pattern of shared waits moves once; a second, right after, waits
   * for the interval. The pattern is TCC_SHARED_WAITS_TO_MOVE waits
   * within 10 ms and the interval 5 ms: a thread preempted in between
   * only needs more waits, which is what the loops allow, never fewer. */
  for (int i = 0; i < TCC_SHARED_WAITS_TO_MOVE - 1; i++) tcc__cpu_share_after_wait(&s, true);
  CHECK(tcc__cpu_moves(NULL, NULL) == 0, "moved before %d shared waits", TCC_SHARED_WAITS_TO_MOVE);
  int waits = TCC_SHARED_WAITS_TO_MOVE - 1;
  while (tcc__cpu_moves(NULL, NULL) == 0 && waits < 1000) {
    tcc__cpu_share_after_wait(&s, true);
    waits++;
  }
  const int64_t moved_at = tcc__now_ns();
  int from = -1, to = -1;
  CHECK(tcc__cpu_moves(&from, &to) == 1, "shared waits: %d moves after %d", tcc__cpu_moves(NULL, NULL), waits);
  CHECK(from != to && to >= 0, "moved from CPU %d to %d", from, to);
  CHECK(CPU_ISSET(to, &before), "moved to CPU %d, which was allowed", to);
  cpu_set_t after;
  allowed_cpus(&after);
  CHECK(CPU_EQUAL(&before, &after), "affinity restored exactly (%d CPUs before, %d after)", CPU_COUNT(&before),
        CPU_COUNT(&after));
  for (int i = 0; i < TCC_SHARED_WAITS_TO_MOVE; i++) tcc__cpu_share_after_wait(&s, true);
  const int64_t since = tcc__now_ns() - moved_at;
  CHECK(tcc__cpu_moves(NULL, NULL) == 1 || since >= 5 * 1000000LL, "a second move %lld us after the first",
        (long long)(since / 1000));
  struct timespec nap = {0, 6 * 1000 * 1000};
  nanosleep(&nap, NULL);
  for (waits = 0; tcc__cpu_moves(NULL, NULL) < 2 && waits < 1000; waits++) tcc__cpu_share_after_wait(&s, true);
  CHECK(tcc__cpu_moves(NULL, NULL) == 2, "after the interval: %d moves after %d waits",
        tcc__cpu_moves(NULL, NULL), waits);
}

/* The idle wait's spin-on phase: a party "elsewhere" never yields, and a
 * deadline or a failed check still ends it long before away_spin_ns. */
typedef struct spin_probe {
  atomic_int ready;
  int checks, fail_after, here_calls;
} spin_probe_t;

static bool probe_ready(void *arg) { return atomic_load(&((spin_probe_t *)arg)->ready); }
static bool probe_elsewhere(void *arg) {
  ((spin_probe_t *)arg)->here_calls++;
  return false;
}
static tcc_result_t probe_check(void *arg, int64_t now_ns) {
  (void)now_ns;
  spin_probe_t *p = arg;
  return ++p->checks >= p->fail_after ? TCC_ERR_ABORTED : TCC_OK;
}

static void test_spin_on_ends(void) {
  static atomic_uint word;
  static atomic_int sleepers;
  spin_probe_t p = {.fail_after = 1 << 30};
  tcc__idle_wait_t w = {.ready = probe_ready, .check = probe_check, .arg = &p, .spins = 10,
                        .peer_here = probe_elsewhere, .away_spin_ns = 10LL * 1000 * 1000 * 1000, .yields = 64,
                        .max_nap_ns = 1000000, .word = &word, .sleepers = &sleepers};
  int64_t start = tcc__now_ns();
  w.deadline_ns = start + 20 * 1000 * 1000;
  CHECK(tcc__idle_wait(&w) == TCC_ERR_TIMEOUT, "deadline while spinning on");
  int64_t took = tcc__now_ns() - start;
  CHECK(took < 2000LL * 1000 * 1000, "the 20 ms deadline ended a 10 s spin after %lld ms", (long long)(took / 1000000));
  CHECK(p.here_calls > 1 && p.checks > 1, "asked where the party runs (%d) and checked (%d) while spinning",
        p.here_calls, p.checks);

  spin_probe_t q = {.fail_after = 5};
  w.arg = &q;
  w.deadline_ns = INT64_MAX;
  start = tcc__now_ns();
  CHECK(tcc__idle_wait(&w) == TCC_ERR_ABORTED, "a failed check ends the spin");
  CHECK(tcc__now_ns() - start < 2000LL * 1000 * 1000, "ended after %lld ms",
        (long long)((tcc__now_ns() - start) / 1000000));

  spin_probe_t r = {.fail_after = 1 << 30};
  atomic_store(&r.ready, 1);
  w.arg = &r;
  CHECK(tcc__idle_wait(&w) == TCC_OK, "ready at once");
}

/* The spin gate: shut where ranks outnumber CPUs; after a spin that saw
 * nothing, shut for exactly TCC_SPIN_BACKOFF_WAITS waits; and, where the
 * caller asks, shut after the waiting thread lost a time slice to another
 * thread on its CPU, which is what a busy process does to a spinning rank. */
static atomic_int hog_stop;

static void *hog(void *arg) {
  (void)arg;
  while (!atomic_load(&hog_stop)) tcc_cpu_relax();
  return NULL;
}

static void spin_for_ns(int64_t ns) {
  const int64_t until = tcc__now_ns() + ns;
  while (tcc__now_ns() < until) tcc_cpu_relax();
}

static void test_spin_gate(void) {
  cpu_set_t set;
  const int cpus = allowed_cpus(&set);
  char why[160];
  tcc__cpu_share_t crowded, roomy;
  tcc__cpu_share_init(&crowded, cpus + 1, tcc__cpus_allowed(), why, sizeof why);
  tcc__cpu_share_init(&roomy, 1, tcc__cpus_allowed(), why, sizeof why);

  tcc__spin_gate_t g = {0};
  for (int i = 0; i < 3; i++) CHECK(!tcc__spin_gate_open(&g, &crowded, true), "gate open with more ranks than CPUs");
  CHECK(g.backoff == 0, "a crowded group's waits left a backoff of %d", g.backoff);

  tcc__spin_gate_missed(&g);
  for (int i = 0; i < TCC_SPIN_BACKOFF_WAITS; i++)
    CHECK(!tcc__spin_gate_open(&g, &roomy, true), "gate open at wait %d of the backoff after a missed spin", i + 1);
  /* Next it opens, unless this thread was preempted for long meanwhile
   * (a loaded machine), which starts a new backoff. */
  const bool open = tcc__spin_gate_open(&g, &roomy, true);
  CHECK(open || g.backoff == TCC_SPIN_BACKOFF_WAITS, "after the backoff: open %d, backoff %d", open, g.backoff);

  /* A thread that spins on a CPU another thread also wants loses time
   * slices to it. */
  cpu_set_t one;
  CPU_ZERO(&one);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &set)) cpu++;
  CPU_SET(cpu, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) {
    fprintf(stderr, "test_cpu_share: preempted gate not tested: this thread may not set its CPU affinity\n");
    return;
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setaffinity_np(&attr, sizeof one, &one);
  pthread_t h;
  atomic_store(&hog_stop, 0);
  CHECK(pthread_create(&h, &attr, hog, NULL) == 0, "hog thread");
  pthread_attr_destroy(&attr);
  g.backoff = 0;
  (void)tcc__spin_gate_open(&g, &roomy, true); /* the thread's times as they are now */
  g.backoff = 0;
  spin_for_ns(100 * 1000000LL); /* 100 ms of wall time on a CPU shared with the hog */
  const bool open_after_sharing = tcc__spin_gate_open(&g, &roomy, true);
  spin_for_ns(20 * 1000000LL);
  tcc__spin_gate_t heedless = {0}; /* point-to-point waits: only a missed spin shuts it */
  const bool heedless_open = tcc__spin_gate_open(&heedless, &roomy, false);
  atomic_store(&hog_stop, 1);
  pthread_join(h, NULL);
  CHECK(sched_setaffinity(0, sizeof set, &set) == 0, "affinity restored");
  CHECK(!open_after_sharing && g.backoff == TCC_SPIN_BACKOFF_WAITS,
        "gate after 100 ms on a CPU shared with a spinning thread: open %d, backoff %d", open_after_sharing,
        g.backoff);
  CHECK(heedless_open, "a gate that preemption does not shut was shut (backoff %d)", heedless.backoff);
}

/* A view (one phase of a hierarchical op) waits on its parent's ranks: the
 * cross-host view of a hybrid group, whose transport sets nothing, must
 * spin where its parent's waits would, not sleep at once. */
static void test_view_inherits(void) {
  tcc_comm_t *parent = calloc(1, sizeof *parent);
  CHECK(parent != NULL, "calloc");
  snprintf(parent->name, sizeof parent->name, "cpu-share-parent");
  parent->rank = 1;
  parent->size = 4;
  char why[200];
  tcc__cpu_share_init(&parent->cpu_share, 1, tcc__cpus_allowed(), why, sizeof why);
  CHECK(parent->cpu_share.spin_while_away, "a lone rank spins while away: %s", why);
  const int members[2] = {1, 3};
  tcc_err_t err = {0};
  tcc_comm_t *view = tcc__comm_view_new(parent, 0, 2, members, &err);
  CHECK(view != NULL, "view: %s", err.msg);
  CHECK(view->cpu_share.spin_while_away == parent->cpu_share.spin_while_away &&
            view->cpu_share.may_move == parent->cpu_share.may_move && view->cpu_share.spins == parent->cpu_share.spins,
        "view spins %d moves %d, parent spins %d moves %d", view->cpu_share.spin_while_away,
        view->cpu_share.may_move, parent->cpu_share.spin_while_away, parent->cpu_share.may_move);
  tcc__spin_gate_t g = {0};
  CHECK(tcc__spin_gate_open(&g, &view->cpu_share, false), "the view's spin gate stays shut");
  tcc__comm_view_free(view);
  free(parent);
}

/* The CPUs ranks may use between them: the union of their sets, however
 * they overlap; the fewest of any when a set reaches past the masks. */
static void test_cpus_between(void) {
  enum { BITS = 128 };
  uint64_t a[BITS / 64] = {0x1}, b[BITS / 64] = {0x2}, ab[BITS / 64] = {0x3}, high[BITS / 64] = {0, 0x1};
  const uint64_t *apart[] = {a, b}, *same[] = {a, a}, *nested[] = {ab, b}, *spread[] = {a, high};
  const uint16_t ones[] = {1, 1}, two_one[] = {2, 1}, past[] = {1, 3}, unknown[] = {1, 0};
  CHECK(tcc__cpus_between(apart, ones, 2, BITS) == 2, "bound to CPUs 0 and 1: %d",
        tcc__cpus_between(apart, ones, 2, BITS));
  CHECK(tcc__cpus_between(same, ones, 2, BITS) == 1, "both on CPU 0: %d", tcc__cpus_between(same, ones, 2, BITS));
  CHECK(tcc__cpus_between(nested, two_one, 2, BITS) == 2, "{0,1} and {1}: %d",
        tcc__cpus_between(nested, two_one, 2, BITS));
  CHECK(tcc__cpus_between(spread, ones, 2, BITS) == 2, "CPUs 0 and 64: %d", tcc__cpus_between(spread, ones, 2, BITS));
  /* The second rank may use 3 CPUs but its mask shows one: some lie past it. */
  CHECK(tcc__cpus_between(spread, past, 2, BITS) == 1, "a set past the masks: %d",
        tcc__cpus_between(spread, past, 2, BITS));
  CHECK(tcc__cpus_between(apart, unknown, 2, BITS) == 0, "an unknown count: %d",
        tcc__cpus_between(apart, unknown, 2, BITS));
  CHECK(tcc__cpus_between(apart, ones, 0, BITS) == 0, "no ranks");

  uint64_t mine[TCC_BLOB_CPU_BITS / 64];
  const int own = tcc__cpu_mask(mine, TCC_BLOB_CPU_BITS);
  const uint64_t *just_me[] = {mine};
  const uint16_t own_count[] = {(uint16_t)own};
  CHECK(own == tcc__cpus_allowed() && (own > TCC_BLOB_CPU_BITS || tcc__cpus_between(just_me, own_count, 1,
                                                                                      TCC_BLOB_CPU_BITS) == own),
        "this thread's mask: %d CPUs, %d allowed", own, tcc__cpus_allowed());
}

/* Ranks bound to a CPU each (a launcher's binding) may each use one CPU
 * but have one each: their waits spin on. Bound to the same CPU, they
 * yield. Over shared memory and over TCP, which count the same way. */
static cpu_set_t bound_set;
static int bound_cpu[2];
static bool bound_expect_spin;

static void bind_rank(int rank) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(bound_cpu[rank], &one);
  CHECK(sched_setaffinity(0, sizeof one, &one) == 0, "rank %d: bind to CPU %d", rank, bound_cpu[rank]);
}

static void check_bound(tcc_comm_t *comm) {
  const tcc__cpu_share_t *s = &comm->cpu_share;
  CHECK(s->spin_while_away == bound_expect_spin && !s->may_move &&
            s->spins == (bound_expect_spin ? TCC_SPINS_OWN_CPU : TCC_SPINS_SHARED),
        "rank %d on CPU %d (%s): spin %d move %d polls %d, want spin %d", tcc_comm_rank(comm),
        bound_cpu[tcc_comm_rank(comm)], tcc_comm_transport_name(comm), s->spin_while_away, s->may_move, s->spins,
        bound_expect_spin);
}

static void test_bound_ranks(void) {
  if (allowed_cpus(&bound_set) < 2) {
    fprintf(stderr, "test_cpu_share: bound ranks not tested: this process may use only one CPU\n");
    return;
  }
  int first = -1, second = -1;
  for (int c = 0; c < CPU_SETSIZE && second < 0; c++)
    if (CPU_ISSET(c, &bound_set)) *(first < 0 ? &first : &second) = c;
  group_rank_setup = bind_rank;
  const char *specs[] = {"shm", "tcp"};
  for (int i = 0; i < 2; i++) {
    bound_cpu[0] = first, bound_cpu[1] = second, bound_expect_spin = true;
    CHECK(run_group(2, specs[i], 10000, "bound-apart", check_bound) == 0, "%s: ranks on CPUs %d and %d", specs[i],
          first, second);
    bound_cpu[1] = first, bound_expect_spin = false;
    CHECK(run_group(2, specs[i], 10000, "bound-together", check_bound) == 0, "%s: both ranks on CPU %d", specs[i],
          first);
  }
  group_rank_setup = NULL;
}

/* Two ranks put on one CPU (as a wake-up from one CPU places them):
 * only the higher one moves off it. When both did, their moves crossed
 * and they met again on the other CPU. Rounds of crowding, each followed
 * by barriers over shared memory; the lower rank must never move, and a
 * round ends once the ranks run apart or after 2000 barriers. */
static cpu_set_t crowd_all;
static int crowd_cpu;

static void crowd_once(tcc_comm_t *comm) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(crowd_cpu, &one);
  CHECK(sched_setaffinity(0, sizeof one, &one) == 0, "onto CPU %d", crowd_cpu);
  tcc_op_t *op;
  CHECK(tcc_barrier(comm, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "barrier on one CPU");
  tcc_op_release(op);
  CHECK(sched_setaffinity(0, sizeof crowd_all, &crowd_all) == 0, "affinity restored");
  for (int i = 0; i < 2000; i++) {
    CHECK(tcc_barrier(comm, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "barrier %d", i);
    tcc_op_release(op);
  }
}

static void crowded_ranks(tcc_comm_t *comm) {
  CHECK(comm->cpu_share.may_move, "two ranks on two CPUs or more may move");
  const int moves_before = tcc__cpu_moves(NULL, NULL);
  for (int round = 0; round < 8; round++) {
    crowd_once(comm);
    struct timespec nap = {0, 6 * 1000 * 1000}; /* past the interval between moves */
    nanosleep(&nap, NULL);
  }
  if (tcc_comm_rank(comm) == 0)
    CHECK(tcc__cpu_moves(NULL, NULL) == moves_before, "the lower rank moved %d times",
          tcc__cpu_moves(NULL, NULL) - moves_before);
}

static void test_crowded_ranks(void) {
  if (allowed_cpus(&crowd_all) < 2 || getenv("TCCOMM_CPU_MOVE")) {
    fprintf(stderr, "test_cpu_share: crowded ranks not tested: one CPU, or moving set by TCCOMM_CPU_MOVE\n");
    return;
  }
  while (!CPU_ISSET(crowd_cpu, &crowd_all)) crowd_cpu++;
  CHECK(run_group(2, "shm", 30000, "crowded", crowded_ranks) == 0, "two ranks crowded onto CPU %d", crowd_cpu);
}

int main(void) {
  test_view_inherits();
  test_decisions();
  test_cpus_between();
  test_bound_ranks();
  test_moves();
  test_crowded_ranks();
  test_spin_on_ends();
  test_spin_gate();
  CHECK_DONE();
}
