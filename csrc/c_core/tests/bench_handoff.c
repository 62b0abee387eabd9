/*
 * bench_handoff.c - the floor of a loop of small broadcasts over shared
 * memory, for two protocols, with nothing of the core in the way: what a
 * rooted small op could cost at best, before designing one.
 *
 *   exchange: every op, every rank stores its arrival on its own line (the
 *     root after writing the payload) and waits for the others' (the root
 *     for every rank, so that it may reuse the payload's place two ops
 *     later): the core's stage barrier.
 *   ring K:   the root writes op i into slot i mod K with its sequence
 *     number and goes on; it waits only when the slot still holds an op a
 *     receiver has not consumed (K ops behind). Each receiver waits for the
 *     slot's number, reads, and stores how far it has consumed on its own
 *     line. Open MPI's shared-memory FIFOs work this way.
 *
 * Waiting spins, yielding the CPU every 256 polls (ranks may share CPUs).
 * Every payload is checked: a wrong one, or a rank that dies, ends every
 * rank with an error.
 *
 * Usage: bench_handoff [ranks] [depth] [ops per batch]
 *        depth 0 (default): exchange; else a ring of that many slots.
 * Prints "handoff <protocol>, <n> ranks: median <us> us per op (batches
 * <lo> .. <hi>)", the slowest rank's time of each of 5 batches.
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_median.h"

#define LINE 64
#define MAX_RANKS 16
#define MAX_DEPTH 1024
#define BATCHES 5
#define WARMUP 1000

typedef struct {
  _Alignas(LINE) atomic_ullong v;
} line_t;

typedef struct {
  _Alignas(LINE) atomic_ullong seq;
  uint64_t payload;
} slot_t;

typedef struct {
  line_t arrival[MAX_RANKS][2]; /* exchange: last op arrived at, per parity */
  uint64_t exchange_payload[2];  /* exchange: the root's payload, per parity */
  line_t consumed[MAX_RANKS];    /* ring: ops this receiver has read */
  line_t batch[MAX_RANKS];       /* batches started, for the barrier between them */
  double seconds[MAX_RANKS];     /* each rank's time of the last batch */
  double slowest[BATCHES];       /* rank 0's verdict: the slowest rank's us per op */
  atomic_int failed;             /* a rank read a wrong payload, or died */
  slot_t ring[MAX_DEPTH];
} shared_t;

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static shared_t *shared;

static void wait_at_least(atomic_ullong *word, uint64_t value) {
  unsigned polls = 0;
  while (atomic_load_explicit(word, memory_order_acquire) < value) {
    if (++polls % 256 != 0) continue;
    if (atomic_load(&shared->failed)) _exit(1);
    sched_yield();
  }
}

static void check(uint64_t got, uint64_t want, int rank) {
  if (got == want) return;
  fprintf(stderr, "bench_handoff: rank %d read payload %llu for op %llu\n", rank, (unsigned long long)got,
          (unsigned long long)want);
  atomic_store(&shared->failed, 1);
  _exit(1);
}

static void exchange_op(shared_t *m, int n, int me, uint64_t op) {
  const int parity = (int)(op & 1);
  if (me == 0) m->exchange_payload[parity] = op;
  atomic_store_explicit(&m->arrival[me][parity].v, op, memory_order_release);
  for (int j = 0; j < n; j++) wait_at_least(&m->arrival[j][parity].v, op);
  if (me != 0) check(m->exchange_payload[parity], op, me);
}

static void ring_op(shared_t *m, int n, int me, int depth, uint64_t op) {
  slot_t *slot = &m->ring[(op - 1) % (uint64_t)depth];
  if (me == 0) {
    if (op > (uint64_t)depth)
      for (int j = 1; j < n; j++) wait_at_least(&m->consumed[j].v, op - (uint64_t)depth);
    slot->payload = op;
    atomic_store_explicit(&slot->seq, op, memory_order_release);
    return;
  }
  wait_at_least(&slot->seq, op);
  check(slot->payload, op, me);
  atomic_store_explicit(&m->consumed[me].v, op, memory_order_release);
}

/* Every rank has started batch b: the batches' times do not overlap. */
static void batch_barrier(shared_t *m, int n, int me, uint64_t b) {
  atomic_store_explicit(&m->batch[me].v, b, memory_order_release);
  for (int j = 0; j < n; j++) wait_at_least(&m->batch[j].v, b);
}

static void run_rank(shared_t *m, int n, int me, int depth, long ops, double *slowest) {
  uint64_t op = 0;
  for (int b = 0; b < BATCHES; b++) {
    batch_barrier(m, n, me, (uint64_t)(2 * b + 1));
    const long calls = (b == 0 ? WARMUP : 0) + ops;
    double t0 = now_s();
    for (long i = 0; i < calls; i++) {
      if (b == 0 && i == WARMUP) t0 = now_s();
      ++op;
      if (depth == 0)
        exchange_op(m, n, me, op);
      else
        ring_op(m, n, me, depth, op);
    }
    m->seconds[me] = now_s() - t0;
    batch_barrier(m, n, me, (uint64_t)(2 * b + 2));
    if (me == 0) {
      double worst = 0;
      for (int j = 0; j < n; j++) worst = m->seconds[j] > worst ? m->seconds[j] : worst;
      slowest[b] = worst / (double)ops * 1e6;
    }
  }
}

int main(int argc, char **argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 2;
  const int depth = argc > 2 ? atoi(argv[2]) : 0;
  const long ops = argc > 3 ? atol(argv[3]) : 200000;
  if (n < 2 || n > MAX_RANKS || depth < 0 || depth > MAX_DEPTH || ops < 1) {
    fprintf(stderr, "usage: bench_handoff [ranks 2-%d] [depth 0-%d, 0: exchange] [ops per batch >= 1]\n",
            MAX_RANKS, MAX_DEPTH);
    return 2;
  }
  shared_t *m = mmap(NULL, sizeof(shared_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    perror("bench_handoff: mmap");
    return 1;
  }
  shared = m;
  fflush(stdout);
  for (int r = 1; r < n; r++) {
    const pid_t pid = fork();
    if (pid < 0) {
      perror("bench_handoff: fork");
      return 1;
    }
    if (pid == 0) {
      run_rank(m, n, r, depth, ops, NULL);
      _exit(0);
    }
  }
  /* Rank 0 runs in a child too, so that the parent can watch every rank:
   * one that dies fails the others' waits instead of leaving them spinning. */
  const pid_t first = fork();
  if (first < 0) {
    perror("bench_handoff: fork");
    return 1;
  }
  if (first == 0) {
    run_rank(m, n, 0, depth, ops, m->slowest);
    _exit(0);
  }
  int failed = 0, status;
  while (wait(&status) > 0) {
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    failed = 1;
    atomic_store(&m->failed, 1);
  }
  if (failed) {
    fprintf(stderr, "bench_handoff: a rank failed\n");
    return 1;
  }
  double *slowest = m->slowest;
  double lo = slowest[0], hi = slowest[0];
  for (int b = 1; b < BATCHES; b++) {
    lo = slowest[b] < lo ? slowest[b] : lo;
    hi = slowest[b] > hi ? slowest[b] : hi;
  }
  char protocol[32];
  if (depth == 0)
    snprintf(protocol, sizeof protocol, "exchange");
  else
    snprintf(protocol, sizeof protocol, "ring %d", depth);
  printf("handoff %s, %d ranks: median %.3f us per op (batches %.3f .. %.3f)\n", protocol, n,
         median(slowest, BATCHES), lo, hi);
  return 0;
}
