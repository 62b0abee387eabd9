/*
 * test_blocking.c - blocking calls (an op entry point given no op handle,
 * include/tccomm.h) in real groups of forked ranks.
 *
 *  - Every collective and send/recv, blocking, at sizes that take the
 *    slot rings, the one-shot paths and the windowed or single-copy paths,
 *    over shared memory, TCP and the hybrid: each result checked element
 *    for element against values computed here, and each blocking
 *    collective counted once (tcc_comm_collective_count).
 *  - Blocking calls behind ops still queued (issued with a handle, not
 *    waited for yet), and ranks mixing both kinds of call for the same
 *    ops: everything runs in issue order, with the same results.
 *  - Two threads of every rank issuing on one communicator at once, one
 *    blocking, one with handles.
 *  - With TRACE logging, where every op goes through the queue.
 *  - Failures: a bad argument, a communicator aborted before the call, a
 *    peer that never joins (the op's timeout), an abort or a destroy from
 *    another thread during the call: the call returns the code, and
 *    tcc_last_error() names the op, the group and the cause.
 *  - Output the TCP transport's one-sided ops hold back after blocking
 *    calls only (no op was ever queued: the collective thread sleeps until
 *    told) is still sent once the rank goes quiet.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "group.h"

#include "coll/coll.h"
#include "coll/coll_scratch.h"

#define MAX_N 4

static tcc_buf_t buf_of(void *p, size_t count) { return (tcc_buf_t){p, count, TCC_INT32, -1, NULL}; }

/* What rank `from` contributes at element i of an op (to rank `to` where
 * it differs per receiver). */
static int32_t value(int from, int to, size_t i, int round) {
  return (int32_t)(from * 1000003 + to * 7919 + (int)(i % 4099) * 31 + round * 3);
}

static void wait_released(tcc_op_t *op, const char *what) {
  const tcc_result_t r = tcc_op_wait(op, -1);
  CHECK(r == TCC_OK, "%s: %s", what, tcc_op_error(op));
  tcc_op_release(op);
}

/* Runs an entry point blocking (handle NULL) or with a handle waited for
 * at once; returns its result. */
#define CALL(blocking, call_with)                                                  \
  ({                                                                               \
    tcc_op_t *op_ = NULL, **handle = (blocking) ? NULL : &op_;                     \
    tcc_result_t r_ = (call_with);                                                 \
    if (r_ == TCC_OK && op_) {                                                     \
      r_ = tcc_op_wait(op_, -1);                                                   \
      tcc_op_release(op_);                                                         \
    }                                                                              \
    r_;                                                                            \
  })

/* One round of every collective and a message between ranks 0 and 1, `count` int32 per
 * block, blocking or not; every output checked. */
static void every_op(tcc_comm_t *comm, size_t count, int round, bool blocking) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm), root = round % n;
  int32_t *in = malloc(count * MAX_N * sizeof *in), *out = malloc(count * MAX_N * sizeof *out);
  CHECK(in && out, "out of memory");
  tcc_buf_t ins[MAX_N], outs[MAX_N];
  for (int j = 0; j < n; j++) ins[j] = buf_of(in + j * count, count), outs[j] = buf_of(out + j * count, count);
  const tcc_buf_t all_in = buf_of(in, count), all_out = buf_of(out, count);
  const uint64_t issued_before = tcc_comm_collective_count(comm);
  int colls = 0;
#define FILL(to_of_j)                                                                  \
  for (int j = 0; j < n; j++)                                                          \
    for (size_t i = 0; i < count; i++) in[j * count + i] = value(me, (to_of_j), i, round), out[j * count + i] = -1
#define EXPECT(cond, ...)                                                              \
  do {                                                                                 \
    size_t bad_ = 0;                                                                   \
    for (int j = 0; j < n; j++)                                                        \
      for (size_t i = 0; i < count; i++) bad_ += !(cond);                              \
    CHECK(bad_ == 0, __VA_ARGS__);                                                     \
  } while (0)
  const char *how = blocking ? "blocking" : "with a handle";

  FILL(j);
  colls++;
  CHECK(CALL(blocking, tcc_broadcast(comm, all_in, root, NULL, handle)) == TCC_OK, "broadcast %s: %s", how, tcc_last_error());
  EXPECT(j > 0 || in[i] == value(root, 0, i, round), "broadcast %s, %zu elements from %d", how, count, root);

  FILL(0);
  colls++;
  CHECK(CALL(blocking, tcc_allreduce(comm, all_in, all_out, TCC_SUM, NULL, handle)) == TCC_OK, "allreduce %s: %s", how, tcc_last_error());
  EXPECT(j > 0 || out[i] == ({ int32_t s_ = 0; for (int k = 0; k < n; k++) s_ += value(k, 0, i, round); s_; }),
         "allreduce %s, %zu elements", how, count);

  FILL(0);
  colls++;
  CHECK(CALL(blocking, tcc_reduce(comm, all_in, all_out, TCC_MAX, root, NULL, handle)) == TCC_OK, "reduce %s: %s", how, tcc_last_error());
  if (me == root)
    EXPECT(j > 0 || out[i] == value(n - 1, 0, i, round), "reduce %s (max), %zu elements to %d", how, count, root);

  FILL(0);
  colls++;
  CHECK(CALL(blocking, tcc_allgather(comm, ins[0], outs, NULL, handle)) == TCC_OK, "allgather %s: %s", how, tcc_last_error());
  EXPECT(out[j * count + i] == value(j, 0, i, round), "allgather %s, %zu elements", how, count);

  FILL(0);
  colls++;
  CHECK(CALL(blocking, tcc_gather(comm, ins[0], me == root ? outs : NULL, root, NULL, handle)) == TCC_OK, "gather %s: %s", how, tcc_last_error());
  if (me == root) EXPECT(out[j * count + i] == value(j, 0, i, round), "gather %s, %zu elements to %d", how, count, root);

  FILL(j);
  colls++;
  CHECK(CALL(blocking, tcc_scatter(comm, me == root ? ins : NULL, outs[0], root, NULL, handle)) == TCC_OK, "scatter %s: %s", how, tcc_last_error());
  EXPECT(j > 0 || out[i] == value(root, me, i, round), "scatter %s, %zu elements from %d", how, count, root);

  FILL(j);
  colls++;
  CHECK(CALL(blocking, tcc_reduce_scatter(comm, ins, outs[0], TCC_SUM, NULL, handle)) == TCC_OK, "reduce_scatter %s: %s", how, tcc_last_error());
  EXPECT(j > 0 || out[i] == ({ int32_t s_ = 0; for (int k = 0; k < n; k++) s_ += value(k, me, i, round); s_; }),
         "reduce_scatter %s, %zu elements", how, count);

  FILL(j);
  colls++;
  CHECK(CALL(blocking, tcc_alltoall(comm, ins, outs, NULL, handle)) == TCC_OK, "alltoall %s: %s", how, tcc_last_error());
  EXPECT(out[j * count + i] == value(j, me, i, round), "alltoall %s, %zu elements", how, count);

  colls++;
  CHECK(CALL(blocking, tcc_barrier(comm, NULL, handle)) == TCC_OK, "barrier %s: %s", how, tcc_last_error());

  /* Ranks 0 and 1: a message there and back, the receiver first each way. */
  FILL(0);
  if (me < 2) {
    const int peer = 1 - me;
    for (int leg = 0; leg < 2; leg++) {
      if ((leg == 0) == (me == 0))
        CHECK(CALL(blocking, tcc_send(comm, leg == 0 ? ins[0] : outs[0], peer, 9, NULL, handle)) == TCC_OK, "send %s: %s",
              how, tcc_last_error());
      else
        CHECK(CALL(blocking, tcc_recv(comm, outs[0], peer, 9, NULL, handle)) == TCC_OK, "recv %s: %s", how,
              tcc_last_error());
    }
    EXPECT(j > 0 || out[i] == value(0, 0, i, round), "send/recv %s, %zu elements there and back", how, count);
  }
  CHECK(tcc_comm_collective_count(comm) == issued_before + (uint64_t)colls, "%d collectives %s counted as %llu", colls,
        how, (unsigned long long)(tcc_comm_collective_count(comm) - issued_before));
#undef FILL
#undef EXPECT
  free(in);
  free(out);
}

/* Sizes per block: the slot rings (8 B), the one-shot and staged paths,
 * several windows and the single-copy threshold. */
static const size_t counts[] = {2, 1024, 20000, 70000};

static void every_op_both_ways(tcc_comm_t *comm) {
  int round = 0;
  for (size_t k = 0; k < sizeof counts / sizeof *counts; k++)
    for (int rep = 0; rep < 3; rep++) {
      every_op(comm, counts[k], round++, true);
      every_op(comm, counts[k], round++, false);
    }
}

/* Ops issued with a handle and left queued, then blocking calls behind
 * them: the blocking call must go through the queue, after them. Rank 0
 * issues everything blocking where the others use handles, and the other
 * way round: the same ops, in the same order, whoever waits how. */
static void behind_queued(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  enum { QUEUED = 5, COUNT = 64 };
  int32_t a[QUEUED][COUNT], b[COUNT];
  for (int round = 0; round < 20; round++) {
    tcc_op_t *ops[QUEUED];
    for (int q = 0; q < QUEUED; q++) {
      for (int i = 0; i < COUNT; i++) a[q][i] = value(me, 0, (size_t)i, round * QUEUED + q);
      CHECK(tcc_allreduce(comm, buf_of(a[q], COUNT), buf_of(a[q], COUNT), TCC_SUM, NULL, &ops[q]) == TCC_OK, "issue: %s",
            tcc_last_error());
    }
    for (int i = 0; i < COUNT; i++) b[i] = me == round % n ? value(me, 1, (size_t)i, round) : -1;
    const bool blocking = (me == 0) == (round % 2 == 0);
    CHECK(CALL(blocking, tcc_broadcast(comm, buf_of(b, COUNT), round % n, NULL, handle)) == TCC_OK, "broadcast behind queued ops: %s",
          tcc_last_error());
    for (int q = 0; q < QUEUED; q++) {
      CHECK(tcc_op_test(ops[q]) == 1, "queued op %d not finished when a blocking call behind it returned", q);
      wait_released(ops[q], "queued allreduce");
      size_t bad = 0;
      for (int i = 0; i < COUNT; i++) {
        int32_t want = 0;
        for (int k = 0; k < n; k++) want += value(k, 0, (size_t)i, round * QUEUED + q);
        bad += a[q][i] != want;
      }
      CHECK(bad == 0, "queued allreduce %d of round %d: %zu wrong", q, round, bad);
    }
    size_t bad = 0;
    for (int i = 0; i < COUNT; i++) bad += b[i] != value(round % n, 1, (size_t)i, round);
    CHECK(bad == 0, "broadcast behind queued ops, round %d: %zu wrong", round, bad);
  }
}

/* Two threads of every rank issue on the same communicator at once: one
 * blocking calls, the other ops with handles. The ranks may pair their
 * ops differently, which is harmless here: every op is the same
 * all-reduce of ones, so each must give the group's size whichever ops
 * meet. What is checked is that numbering without the lock (a blocking
 * call) and under it (submit) never gives two ops one number, nor runs
 * one out of turn: either would leave ranks waiting or mismatched. */
enum { THREAD_OPS = 2000 };

typedef struct issuer {
  tcc_comm_t *comm;
  bool blocking;
  int wrong;
} issuer_t;

static void *issue_ones(void *arg) {
  issuer_t *t = arg;
  const int n = tcc_comm_size(t->comm);
  for (int i = 0; i < THREAD_OPS; i++) {
    int32_t x[2] = {1, 1};
    tcc_op_t *op = NULL;
    tcc_result_t r = tcc_allreduce(t->comm, buf_of(x, 2), buf_of(x, 2), TCC_SUM, NULL, t->blocking ? NULL : &op);
    if (r == TCC_OK && op) {
      r = tcc_op_wait(op, -1);
      tcc_op_release(op);
    }
    t->wrong += r != TCC_OK || x[0] != n || x[1] != n;
  }
  return NULL;
}

static void two_threads(tcc_comm_t *comm) {
  const uint64_t before = tcc_comm_collective_count(comm);
  issuer_t a = {comm, true, 0}, b = {comm, false, 0};
  pthread_t other;
  CHECK(pthread_create(&other, NULL, issue_ones, &b) == 0, "pthread_create");
  issue_ones(&a);
  pthread_join(other, NULL);
  CHECK(a.wrong == 0 && b.wrong == 0, "%d blocking and %d issued all-reduces failed or gave a wrong sum", a.wrong,
        b.wrong);
  CHECK(tcc_comm_collective_count(comm) == before + 2 * THREAD_OPS, "%llu collectives counted, %d issued",
        (unsigned long long)(tcc_comm_collective_count(comm) - before), 2 * THREAD_OPS);
}

/* Shared by the forked ranks of one group (made before the fork). */
static atomic_int *shared_flag;

/* Bad input, then an aborted communicator: errors of blocking calls. */
static void bad_calls(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  int32_t x[2] = {1, 2};
  tcc_result_t r = tcc_broadcast(comm, buf_of(x, 2), n, NULL, NULL);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "broadcast") && strstr(tcc_last_error(), "root"),
        "broadcast from root %d: %s: %s", n, tcc_result_string(r), tcc_last_error());
  r = tcc_send(comm, buf_of(x, 2), me, 1, NULL, NULL);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "send") && strstr(tcc_last_error(), "it is this rank"),
        "send to itself: %s: %s", tcc_result_string(r), tcc_last_error());
  /* Still usable: a good call after the bad ones. */
  CHECK(tcc_allreduce(comm, buf_of(x, 2), buf_of(x, 2), TCC_SUM, NULL, NULL) == TCC_OK && x[0] == n && x[1] == 2 * n,
        "allreduce after bad calls: %s (%d %d)", tcc_last_error(), x[0], x[1]);
  tcc_comm_abort(comm);
  r = tcc_allreduce(comm, buf_of(x, 2), buf_of(x, 2), TCC_SUM, NULL, NULL);
  CHECK(r == TCC_ERR_ABORTED && strstr(tcc_last_error(), "allreduce") && strstr(tcc_last_error(), "no longer usable"),
        "allreduce after abort: %s: %s", tcc_result_string(r), tcc_last_error());
  r = tcc_recv(comm, buf_of(x, 2), (me + 1) % n, 1, NULL, NULL);
  CHECK(r == TCC_ERR_ABORTED && strstr(tcc_last_error(), "recv"), "recv after abort: %s: %s", tcc_result_string(r),
        tcc_last_error());
}

/* Rank 0 calls a blocking allreduce that rank 1 never joins: it times out
 * with the op's own timeout, naming the op and the rank it waited for.
 * Rank 1 leaves once rank 0 has its answer. */
static void peer_missing(tcc_comm_t *comm) {
  int32_t x[2] = {1, 2};
  if (tcc_comm_rank(comm) == 1) {
    for (int i = 0; i < 20000 && !atomic_load(shared_flag); i++) usleep(1000);
    CHECK(atomic_load(shared_flag), "rank 0 never returned");
    return;
  }
  const tcc_op_opts_t opts = {.timeout_ms = 300};
  const int64_t t0 = tcc__now_ns();
  const tcc_result_t r = tcc_allreduce(comm, buf_of(x, 2), buf_of(x, 2), TCC_SUM, &opts, NULL);
  const double seconds = (double)(tcc__now_ns() - t0) / 1e9;
  atomic_store(shared_flag, 1);
  CHECK(r == TCC_ERR_TIMEOUT && strstr(tcc_last_error(), "allreduce") && strstr(tcc_last_error(), "rank(s) 1") &&
            strstr(tcc_last_error(), "[op timeout 300 ms]"),
        "allreduce nobody joined: %s: %s", tcc_result_string(r), tcc_last_error());
  CHECK(seconds < 10, "the timeout of 300 ms took %.1f s", seconds);
  CHECK(tcc_comm_status(comm) == TCC_ERR_TIMEOUT, "the communicator after the timeout: %s",
        tcc_result_string(tcc_comm_status(comm)));
}

/* A thread of rank 0 makes a blocking all-reduce of blocked_count int32
 * that rank 1 never joins; the main thread aborts or destroys the
 * communicator: the call returns TCC_ERR_ABORTED soon, its reason naming
 * what ended it, and nothing is touched after it is freed (ASan). */
static size_t blocked_count; /* set before the ranks fork */

typedef struct blocked {
  tcc_comm_t *comm;
  tcc_result_t result;
  char error[TCC_ERRLEN];
  int64_t returned_ns;
} blocked_t;

static void *block_on_missing_peer(void *arg) {
  blocked_t *b = arg;
  int32_t *x = calloc(blocked_count, sizeof *x);
  b->result = tcc_allreduce(b->comm, buf_of(x, blocked_count), buf_of(x, blocked_count), TCC_SUM, NULL, NULL);
  snprintf(b->error, sizeof b->error, "%s", tcc_last_error());
  b->returned_ns = tcc__now_ns();
  free(x);
  return NULL;
}

static void end_during_call(tcc_comm_t *comm, bool destroy) {
  if (tcc_comm_rank(comm) == 1) {
    for (int i = 0; i < 20000 && !atomic_load(shared_flag); i++) usleep(1000);
    return;
  }
  blocked_t b = {comm, TCC_OK, "", 0};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, block_on_missing_peer, &b) == 0, "pthread_create");
  usleep(200 * 1000);
  const int64_t t0 = tcc__now_ns();
  if (destroy) {
    tcc_comm_destroy(comm);
    group_comm_destroyed = 1;
  } else {
    tcc_comm_abort(comm);
  }
  pthread_join(t, NULL);
  atomic_store(shared_flag, 1);
  const double seconds = (double)(b.returned_ns - t0) / 1e9;
  CHECK(b.result == TCC_ERR_ABORTED && strstr(b.error, "allreduce") && strstr(b.error, destroy ? "destroyed" : "abort"),
        "blocking allreduce of %zu ended by %s: %s: %s", blocked_count, destroy ? "destroy" : "abort",
        tcc_result_string(b.result), b.error);
  CHECK(seconds < 2, "the blocking call returned %.2f s after %s", seconds, destroy ? "destroy" : "abort");
}

static void abort_during_call(tcc_comm_t *comm) { end_during_call(comm, false); }
static void destroy_during_call(tcc_comm_t *comm) { end_during_call(comm, true); }

/* Over TCP, small rooted ops are one-sided: a receiver holds back what it
 * owes the root until its next op, or until it is quiet. Only blocking
 * calls here, so no op was ever queued and the collective thread sleeps
 * until told: told by the call that left output held. */
static void held_output_sent(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  int32_t x[2];
  for (int round = 0; round < 50; round++) {
    x[0] = x[1] = me == 0 ? round : -1;
    CHECK(tcc_broadcast(comm, buf_of(x, 2), 0, NULL, NULL) == TCC_OK, "broadcast %d: %s", round, tcc_last_error());
    CHECK(x[0] == round && x[1] == round, "broadcast %d gave %d %d", round, x[0], x[1]);
  }
  if (me == 1) {
    CHECK(coll_scratch_of(comm)->held_frames > 0, "the receiver of one-sided broadcasts held nothing back");
    for (int i = 0; i < 2000 && tcc__coll_holds_output(comm); i++) usleep(1000);
    CHECK(!tcc__coll_holds_output(comm), "output held back still not sent 2 s after the last op");
  }
  CHECK(tcc_barrier(comm, NULL, NULL) == TCC_OK, "barrier: %s", tcc_last_error());
}

static void setenv_trace(int rank) {
  (void)rank;
  setenv("TCCOMM_DEBUG", "TRACE", 1);
  setenv("TCCOMM_DEBUG_FILE", "/dev/null", 1);
}

int main(void) {
  shared_flag = group_shared_flag();
  const struct {
    int n;
    const char *spec;
  } groups[] = {{2, "shm"}, {3, "shm"}, {4, "shm"}, {2, "tcp"}, {3, "tcp"}, {4, "auto-pairs"}};
  for (size_t g = 0; g < sizeof groups / sizeof *groups; g++) {
    CHECK(run_group(groups[g].n, groups[g].spec, 60000, "blocking", every_op_both_ways) == 0, "every op, %d ranks %s",
          groups[g].n, groups[g].spec);
    CHECK(run_group(groups[g].n, groups[g].spec, 10000, "behind", behind_queued) == 0, "behind queued ops, %d ranks %s",
          groups[g].n, groups[g].spec);
  }
  CHECK(run_group(2, "shm", 20000, "threads", two_threads) == 0, "two threads, shm");
  CHECK(run_group(3, "shm", 20000, "threads", two_threads) == 0, "two threads, 3 ranks shm");
  CHECK(run_group(2, "tcp", 20000, "threads", two_threads) == 0, "two threads, tcp");
  CHECK(run_group(2, "shm", 60000, "bad", bad_calls) == 0, "bad calls, shm");
  CHECK(run_group(3, "tcp", 60000, "bad", bad_calls) == 0, "bad calls, tcp");
  atomic_store(shared_flag, 0);
  CHECK(run_group(2, "shm", 60000, "missing", peer_missing) == 0, "a peer missing, shm");
  atomic_store(shared_flag, 0);
  CHECK(run_group(2, "tcp", 60000, "missing", peer_missing) == 0, "a peer missing, tcp");
  const char *const specs[] = {"shm", "tcp"};
  const size_t blocked_counts[] = {2, 1 << 16};
  for (int k = 0; k < 2; k++)
    for (int m = 0; m < 2; m++) {
      blocked_count = blocked_counts[m];
      atomic_store(shared_flag, 0);
      CHECK(run_group(2, specs[k], 30000, "ended", abort_during_call) == 0, "abort during a blocking call, %s, %zu",
            specs[k], blocked_count);
      atomic_store(shared_flag, 0);
      CHECK(run_group(2, specs[k], 30000, "ended", destroy_during_call) == 0,
            "destroy during a blocking call, %s, %zu", specs[k], blocked_count);
    }
  CHECK(run_group(2, "tcp", 60000, "held", held_output_sent) == 0, "held output, tcp");
  group_rank_setup = setenv_trace;
  CHECK(run_group(3, "shm", 60000, "traced", behind_queued) == 0, "behind queued ops, traced");
  CHECK(run_group(2, "tcp", 60000, "traced", held_output_sent) == 0, "held output, traced");
  group_rank_setup = NULL;
  CHECK_DONE();
}
