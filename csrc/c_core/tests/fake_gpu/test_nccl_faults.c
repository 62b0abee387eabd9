/*
 * test_nccl_faults.c - the core's CUDA path when NCCL or a peer misbehaves,
 * with faults injected into the fake NCCL (fake_gpu.h): nothing may hang,
 * every failure must name the op, the group and the rank, abort must
 * release a thread stuck inside NCCL, and NCCL's own environment must not
 * change what the core does.
 *
 * Each case is one forked group; a case whose rank would hang under a
 * broken design is bounded by the rank's alarm, so a regression fails the
 * case instead of hanging the suite.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../check.h"
#include "../group.h"
#include "gpu_rank.h"

#define TIMEOUT_MS 3000

/* Shared by the ranks of one case (mapped before the fork). */
static struct shared {
  atomic_int done;      /* ranks that finished their part */
  atomic_int torn_down; /* ranks the error policy ended (SIGABRT) */
  atomic_int survived;  /* ranks that got past an op the policy should have ended them in */
} *shared;

/* The default error policy ends the process with abort(): recorded here,
 * and the rank leaves cleanly so the case can tell it from a crash. */
static void on_teardown(int sig) {
  (void)sig;
  atomic_fetch_add(&shared->torn_down, 1);
  _exit(0);
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* An allreduce of 64 floats from the rank's inputs, waited on from the host. */
static tcc_result_t allreduce_once(gpu_rank_t *g, float *d, int64_t timeout_ms, char *why, size_t len) {
  float in[64];
  for (int i = 0; i < 64; i++) in[i] = (float)input_value(g->rank, (size_t)i);
  upload(g, d, in, sizeof in);
  tcc_op_opts_t opts = {.timeout_ms = timeout_ms, .premul_factor = 0};
  tcc_op_t *o = NULL;
  tcc_result_t r = tcc_allreduce(g->comm, dbuf(g, d, 64, TCC_FLOAT32), dbuf(g, d, 64, TCC_FLOAT32), TCC_SUM, &opts, &o);
  if (r != TCC_OK) {
    snprintf(why, len, "%s", tcc_last_error());
    return r;
  }
  r = tcc_op_wait(o, -1);
  snprintf(why, len, "%s", tcc_op_error(o));
  tcc_op_release(o);
  if (r == TCC_OK) {
    float out[64];
    download(g, out, d, sizeof out);
    for (int i = 0; i < 64; i++)
      CHECK(out[i] == (float)reduced_value(g->size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0), "allreduce [%d] on rank %d",
            i, g->rank);
  }
  return r;
}

static int mentions_op_group_rank(const char *msg, const char *op, int rank) {
  char r[32];
  snprintf(r, sizeof r, "rank %d", rank);
  return strstr(msg, op) && strstr(msg, "fake-gpu-faults") && strstr(msg, r);
}

/* ---- NCCL_COMM_BLOCKING=0 must not change the core's behaviour ------------- */

static void rank_nonblocking_env(tcc_comm_t *comm) {
  setenv("NCCL_COMM_BLOCKING", "0", 1);
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256);
  char why[512];
  for (int k = 0; k < 3; k++) {
    tcc_result_t r = allreduce_once(&g, d, TIMEOUT_MS, why, sizeof why);
    CHECK(r == TCC_OK, "allreduce %d with NCCL_COMM_BLOCKING=0 on rank %d: %s", k, g.rank, why);
  }
  cudaFree(d);
  gpu_rank_close(&g);
}

/* ---- the first CUDA op is a send/recv between two ranks of three ----------- */

static void rank_p2p_first(tcc_comm_t *comm) {
  gpu_rank_t g = gpu_rank_open(comm);
  if (g.rank < 2) {
    const size_t count = 300;
    double *d = dev_alloc(count * 8), host[300];
    for (size_t i = 0; i < count; i++) host[i] = input_value(g.rank, i);
    upload(&g, d, host, sizeof host);
    tcc_op_t *o = NULL;
    tcc_op_opts_t opts = {.timeout_ms = TIMEOUT_MS, .premul_factor = 0};
    const int64_t t0 = now_ms();
    tcc_result_t r = g.rank == 0 ? tcc_send(comm, dbuf(&g, d, count, TCC_FLOAT64), 1, 0, &opts, &o)
                                 : tcc_recv(comm, dbuf(&g, d, count, TCC_FLOAT64), 0, 0, &opts, &o);
    CHECK(r == TCC_OK, "p2p issue on rank %d: %s", g.rank, tcc_last_error());
    if (r == TCC_OK) {
      r = tcc_op_wait(o, -1);
      CHECK(r == TCC_OK, "first CUDA op a send/recv between ranks 0 and 1 of 3, rank %d (%lld ms): %s", g.rank,
            (long long)(now_ms() - t0), tcc_op_error(o));
      tcc_op_release(o);
    }
    if (g.rank == 1 && r == TCC_OK) {
      download(&g, host, d, sizeof host);
      for (size_t i = 0; i < count; i++) CHECK(host[i] == input_value(0, i), "received [%zu]", i);
    }
    cudaFree(d);
  }
  /* Rank 2 takes no part in CUDA at all; everyone meets on the host path. */
  tcc_op_t *b = NULL;
  CHECK(tcc_barrier(comm, NULL, &b) == TCC_OK && tcc_op_wait(b, -1) == TCC_OK, "barrier on rank %d", g.rank);
  if (b) tcc_op_release(b);
  gpu_rank_close(&g);
}

/* ---- an irecv waiting for its peer must not hold up a later collective ---- */

static void rank_p2p_then_collective(tcc_comm_t *comm) {
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256), *p = dev_alloc(256);
  char why[512];
  /* Set up both NCCL communicators first (the group's and the pair's: the
   * first send/recv of two ranks is a setup both must reach), so only the
   * ordering is under test. */
  CHECK(allreduce_once(&g, d, TIMEOUT_MS, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  tcc_op_opts_t opts = {.timeout_ms = TIMEOUT_MS, .premul_factor = 0};
  tcc_op_t *o = NULL;
  tcc_result_t w = g.rank == 0 ? tcc_send(comm, dbuf(&g, p, 64, TCC_FLOAT32), 1, 0, &opts, &o)
                               : tcc_recv(comm, dbuf(&g, p, 64, TCC_FLOAT32), 0, 0, &opts, &o);
  CHECK(w == TCC_OK && tcc_op_wait(o, -1) == TCC_OK, "warm-up p2p on rank %d: %s", g.rank,
        w == TCC_OK ? tcc_op_error(o) : tcc_last_error());
  if (o) tcc_op_release(o);
  o = NULL;
  if (g.rank == 0) {
    /* rank 0: irecv from 1, then allreduce; rank 1: allreduce, then send to 0 */
    CHECK(tcc_recv(comm, dbuf(&g, p, 64, TCC_FLOAT32), 1, 0, &opts, &o) == TCC_OK, "irecv: %s", tcc_last_error());
    tcc_result_t r = allreduce_once(&g, d, TIMEOUT_MS, why, sizeof why);
    CHECK(r == TCC_OK, "allreduce behind a pending irecv on rank 0: %s", why);
    if (o) {
      CHECK(tcc_op_wait(o, -1) == TCC_OK, "irecv: %s", tcc_op_error(o));
      tcc_op_release(o);
    }
  } else {
    tcc_result_t r = allreduce_once(&g, d, TIMEOUT_MS, why, sizeof why);
    CHECK(r == TCC_OK, "allreduce on rank 1: %s", why);
    CHECK(tcc_send(comm, dbuf(&g, p, 64, TCC_FLOAT32), 0, 0, &opts, &o) == TCC_OK, "send: %s", tcc_last_error());
    if (o) {
      CHECK(tcc_op_wait(o, -1) == TCC_OK, "send: %s", tcc_op_error(o));
      tcc_op_release(o);
    }
  }
  cudaFree(d);
  cudaFree(p);
  gpu_rank_close(&g);
}

/* ---- abort releases a thread stuck inside an NCCL call -------------------- */

struct aborter {
  tcc_comm_t *comm;
  int delay_ms;
};

static void *abort_later(void *arg) {
  struct aborter *a = arg;
  usleep((useconds_t)a->delay_ms * 1000);
  tcc_comm_abort(a->comm);
  return NULL;
}

static void rank_abort_blocked_call(tcc_comm_t *comm) {
  alarm(60);
  setenv("TCCOMM_ASYNC_ERROR_HANDLING", "2", 1); /* raise: the errors are what is checked */
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256);
  char why[512];
  CHECK(allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  pthread_t t;
  struct aborter a = {comm, 300};
  if (g.rank == 0) {
    /* The next NCCL collective call of rank 0 blocks on the host until its
     * communicator is aborted, as a real one may (a peer that stopped, a
     * full queue behind a stuck kernel). */
    fake_nccl_inject("ncclAllReduce", 1, FAKE_NCCL_BLOCK);
    pthread_create(&t, NULL, abort_later, &a);
  }
  const int64_t t0 = now_ms();
  tcc_result_t r = allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why);
  const int64_t took = now_ms() - t0;
  CHECK(r != TCC_OK, "allreduce on rank %d succeeded although rank 0 was aborted", g.rank);
  /* Rank 0 is released by its abort; rank 1 hears of it or times out. */
  CHECK(took < (g.rank == 0 ? 3000 : TIMEOUT_MS * 10 + 3000), "rank %d took %lld ms to fail: %s", g.rank,
        (long long)took, why);
  CHECK(mentions_op_group_rank(why, "allreduce", g.rank), "rank %d message: %s", g.rank, why);
  if (g.rank == 0) pthread_join(t, NULL);
  cudaFree(d);
  gpu_rank_close(&g);
}

/* ---- a peer that never joins NCCL's setup: a timeout, not a hang ---------- */

static void *blocked_first_op(void *arg) {
  gpu_rank_t *g = arg;
  float *d = dev_alloc(256);
  char why[512];
  allreduce_once(g, d, TIMEOUT_MS, why, sizeof why);
  return NULL;
}

static void rank_init_never_joins(tcc_comm_t *comm) {
  alarm(60);
  gpu_rank_t g = gpu_rank_open(comm);
  if (g.rank == 1) {
    /* Rank 1 gets the unique id, then never completes ncclCommInitRank. */
    fake_nccl_inject("ncclCommInitRank", 1, FAKE_NCCL_BLOCK);
    fake_nccl_inject("ncclCommInitRankConfig", 1, FAKE_NCCL_BLOCK);
    pthread_t t;
    pthread_create(&t, NULL, blocked_first_op, &g);
    pthread_detach(t);
    while (atomic_load(&shared->done) < 1) usleep(10000);
    /* Its thread is stuck inside NCCL for good: leave without destroying. */
    group_comm_destroyed = 1;
    return;
  }
  float *d = dev_alloc(256);
  char why[512];
  const int64_t t0 = now_ms();
  tcc_result_t r = allreduce_once(&g, d, TIMEOUT_MS, why, sizeof why);
  const int64_t took = now_ms() - t0;
  CHECK(r == TCC_ERR_TIMEOUT, "first allreduce while rank 1 never joins NCCL: %d %s", r, why);
  CHECK(took < TIMEOUT_MS + 3000, "it took %lld ms", (long long)took);
  CHECK(mentions_op_group_rank(why, "allreduce", 0), "message: %s", why);
  atomic_fetch_add(&shared->done, 1);
  cudaFree(d);
  gpu_rank_close(&g);
}

/* ---- a peer that dies while the other waits in a collective ---------------- */

static void rank_peer_dies(tcc_comm_t *comm) {
  alarm(60);
  setenv("TCCOMM_ASYNC_ERROR_HANDLING", "2", 1); /* raise and mark unusable */
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256);
  char why[512];
  CHECK(allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  if (g.rank == 1) {
    usleep(100000);
    _exit(0); /* as if killed: no destroy, nothing said */
  }
  const int64_t t0 = now_ms();
  tcc_result_t r = allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why);
  const int64_t took = now_ms() - t0;
  CHECK(r != TCC_OK, "allreduce with a dead peer succeeded");
  CHECK(took < 5000, "the dead peer was noticed after %lld ms (timeout %d ms): %s", (long long)took, TIMEOUT_MS * 10,
        why);
  CHECK(mentions_op_group_rank(why, "allreduce", 0), "message: %s", why);
  /* The communicator is no longer usable, and says so at once. */
  tcc_op_t *o = NULL;
  r = tcc_allreduce(comm, dbuf(&g, d, 64, TCC_FLOAT32), dbuf(&g, d, 64, TCC_FLOAT32), TCC_SUM, NULL, &o);
  if (r == TCC_OK) {
    r = tcc_op_wait(o, 5000);
    tcc_op_release(o);
  }
  CHECK(r != TCC_OK, "an op after the failure was accepted and succeeded");
  const int64_t t1 = now_ms();
  tcc_comm_destroy(comm);
  group_comm_destroyed = 1;
  CHECK(now_ms() - t1 < 3000, "destroy after the failure took %lld ms", (long long)(now_ms() - t1));
  cudaFree(d);
  gpu_rank_close(&g);
}

/* ---- an op that times out fails the ops queued behind it ------------------------
 * Aborting NCCL ends the kernels of the timed-out op and of every op
 * queued after it, and their events complete with them: that is no
 * result. Each op must fail, whether the watchdog or a caller polling the
 * op (tcc_op_test, as Work.is_completed does) looks first. */

static tcc_op_t *issue_allreduce(gpu_rank_t *g, float *d, int64_t timeout_ms) {
  tcc_op_opts_t opts = {.timeout_ms = timeout_ms, .premul_factor = 0};
  tcc_op_t *o = NULL;
  tcc_result_t r = tcc_allreduce(g->comm, dbuf(g, d, 64, TCC_FLOAT32), dbuf(g, d, 64, TCC_FLOAT32), TCC_SUM, &opts, &o);
  CHECK(r == TCC_OK, "rank %d: allreduce refused: %s", g->rank, tcc_last_error());
  return r == TCC_OK ? o : NULL;
}

static void rank_timeout_fails_queued_ops(tcc_comm_t *comm) {
  alarm(60);
  setenv("TCCOMM_ASYNC_ERROR_HANDLING", "2", 1); /* raise and mark unusable */
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256), *e = dev_alloc(256);
  char why[512];
  CHECK(allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  /* Rank 1's next allreduce never finishes on the device: every rank's times out. */
  if (g.rank == 1) fake_nccl_inject("ncclAllReduce", 1, FAKE_NCCL_HANG_KERNEL);
  tcc_op_t *first = issue_allreduce(&g, d, 1000);
  tcc_op_t *queued = issue_allreduce(&g, e, TIMEOUT_MS * 10);
  const char *names[2] = {"the timed-out op", "the op queued behind it"};
  tcc_op_t *ops[2] = {first, queued};
  for (int k = 0; k < 2; k++) {
    if (!ops[k]) continue;
    const int64_t until = now_ms() + 20000;
    while (!tcc_op_test(ops[k]) && now_ms() < until) usleep(1000);
    tcc_result_t r = tcc_op_wait(ops[k], 0);
    CHECK(r != TCC_OK && r != TCC_ERR_INPROGRESS, "rank %d: %s ended with %s", g.rank, names[k],
          tcc_result_string(r));
    tcc_op_release(ops[k]);
  }
  tcc_comm_destroy(comm);
  group_comm_destroyed = 1;
  cudaFree(d);
  cudaFree(e);
  gpu_rank_close(&g);
}

/* ---- the default error policy: a CUDA op that times out ends the process ---- */

static void rank_timeout_tears_down(tcc_comm_t *comm) {
  alarm(60);
  unsetenv("TCCOMM_ASYNC_ERROR_HANDLING");
  signal(SIGABRT, on_teardown);
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256);
  char why[512];
  CHECK(allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  /* Rank 1's next allreduce never finishes on the device: both time out. */
  if (g.rank == 1) fake_nccl_inject("ncclAllReduce", 1, FAKE_NCCL_HANG_KERNEL);
  allreduce_once(&g, d, 1000, why, sizeof why);
  /* Kernels queued after the failed op would now run on its partial
   * output: the process must have ended before the wait returned. */
  atomic_fetch_add(&shared->survived, 1);
  CHECK(0, "rank %d survived a timed-out CUDA op under the default policy: %s", g.rank, why);
  group_comm_destroyed = 1;
}

/* ---- synchronize is bounded; destroy lets ops in flight go, within bounds ---- */

static void rank_destroy_in_flight(tcc_comm_t *comm) {
  alarm(60);
  unsetenv("TCCOMM_ASYNC_ERROR_HANDLING"); /* the default policy: destroy must still not tear down */
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(256);
  char why[512];
  CHECK(allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  /* Everything issued so far is done once synchronize returns. */
  CHECK(tcc_comm_cuda_synchronize(comm, 5000) == TCC_OK, "synchronize when idle: %s", tcc_last_error());
  if (g.rank == 1) fake_nccl_inject("ncclAllReduce", 1, FAKE_NCCL_HANG_KERNEL);
  tcc_op_opts_t opts = {.timeout_ms = 60000};
  tcc_op_t *o = NULL;
  tcc_buf_t b = dbuf(&g, d, 64, TCC_FLOAT32);
  CHECK(tcc_allreduce(comm, b, b, TCC_SUM, &opts, &o) == TCC_OK, "allreduce: %s", tcc_last_error());
  int64_t t0 = now_ms();
  tcc_result_t r = tcc_comm_cuda_synchronize(comm, 300);
  CHECK(r == TCC_ERR_TIMEOUT && now_ms() - t0 < 2000, "synchronize with a stuck op: %s after %lld ms",
        tcc_result_string(r), (long long)(now_ms() - t0));
  t0 = now_ms();
  tcc_comm_destroy(comm);
  group_comm_destroyed = 1;
  const int64_t took = now_ms() - t0;
  CHECK(took < 15000, "destroy with an op stuck in flight took %lld ms", (long long)took);
  if (o) {
    CHECK(tcc_op_wait(o, 1000) == TCC_ERR_ABORTED, "the stuck op after destroy: %s", tcc_op_error(o));
    tcc_op_release(o);
  }
  cudaFree(d);
  gpu_rank_close(&g);
}

/* An op whose result the caller only awaits on its stream is still running
 * when destroy comes: it finishes, with its data, rather than be aborted. */
static void rank_destroy_lets_op_finish(tcc_comm_t *comm) {
  alarm(60);
  gpu_rank_t g = gpu_rank_open(comm);
  float *d = dev_alloc(64 * 4), in[64], out[64];
  char why[512];
  CHECK(allreduce_once(&g, d, TIMEOUT_MS * 10, why, sizeof why) == TCC_OK, "warm-up: %s", why);
  for (int i = 0; i < 64; i++) in[i] = (float)input_value(g.rank, (size_t)i);
  upload(&g, d, in, sizeof in);
  /* Long device delays: the op is surely in flight at destroy. */
  fake_cuda_set_delay_us(20000);
  tcc_op_t *o = NULL;
  tcc_buf_t b = dbuf(&g, d, 64, TCC_FLOAT32);
  CHECK(tcc_allreduce(comm, b, b, TCC_SUM, NULL, &o) == TCC_OK, "allreduce: %s", tcc_last_error());
  CHECK(o && tcc_op_stream_wait(o, g.stream) == TCC_OK, "stream wait");
  tcc_comm_destroy(comm);
  group_comm_destroyed = 1;
  if (o) {
    CHECK(tcc_op_wait(o, 1000) == TCC_OK, "an op in flight at destroy on rank %d: %s", g.rank, tcc_op_error(o));
    tcc_op_release(o);
  }
  download(&g, out, d, sizeof out);
  for (int i = 0; i < 64; i++)
    CHECK(out[i] == (float)reduced_value(g.size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0), "result [%d] on rank %d", i,
          g.rank);
  fake_cuda_set_delay_us(200);
  cudaFree(d);
  gpu_rank_close(&g);
}

static void check_teardown(void) {
  CHECK(atomic_load(&shared->torn_down) == 2 && atomic_load(&shared->survived) == 0,
        "%d rank(s) torn down, %d survived (want 2 and 0)", atomic_load(&shared->torn_down),
        atomic_load(&shared->survived));
}

typedef struct {
  const char *name;
  int ranks;
  rank_fn fn;
  int expect_failed; /* a rank exits on purpose with nonzero status */
  void (*check)(void); /* after the ranks ended, or NULL */
} fault_case_t;

int main(int argc, char **argv) {
  alarm(600);
  shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  const fault_case_t cases[] = {
      {"nonblocking_env", 2, rank_nonblocking_env, 0, NULL},
      {"p2p_first", 3, rank_p2p_first, 0, NULL},
      {"p2p_then_collective", 2, rank_p2p_then_collective, 0, NULL},
      {"abort_blocked_call", 2, rank_abort_blocked_call, 0, NULL},
      {"init_never_joins", 2, rank_init_never_joins, 0, NULL},
      {"peer_dies", 2, rank_peer_dies, 0, NULL},
      {"timeout_fails_queued_ops", 2, rank_timeout_fails_queued_ops, 0, NULL},
      {"timeout_tears_down", 2, rank_timeout_tears_down, 0, check_teardown},
      {"destroy_in_flight", 2, rank_destroy_in_flight, 0, NULL},
      {"destroy_lets_op_finish", 2, rank_destroy_lets_op_finish, 0, NULL},
  };
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    if (argc > 1 && strcmp(argv[1], cases[k].name) != 0) continue;
    atomic_store(&shared->done, 0);
    atomic_store(&shared->torn_down, 0);
    atomic_store(&shared->survived, 0);
    printf("-- %s\n", cases[k].name);
    fflush(stdout);
    int failed = run_group(cases[k].ranks, "shm", TIMEOUT_MS, "fake-gpu-faults", cases[k].fn);
    CHECK(failed == cases[k].expect_failed, "case %s: ranks failed", cases[k].name);
    if (cases[k].check) cases[k].check();
  }
  CHECK_DONE();
}
