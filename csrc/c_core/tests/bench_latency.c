/*
 * bench_latency.c - time per small all_reduce when a program drives the
 * core directly: tcc_allreduce of 2 float32 (8 bytes) + tcc_op_wait +
 * tcc_op_release, no torch. The floor under every layer above it
 * (bench/bench_layers.py prints it next to them).
 *
 * Usage: bench_latency [ranks] [shm|tcp] [allreduce|p2p]   (default: 2 shm allreduce)
 * Prints one line per batch on rank 0, then
 *   "core 8 B allreduce, <n> ranks, <transport>: median <us> us per call"
 * Every result is checked (the sum of the ranks' values).
 *
 * p2p (2 ranks): round trips of 8 bytes, rank 0 sends and receives the
 * reply, rank 1 receives and sends it back plus one; each reply checked.
 *   "core 8 B send/recv round trip, 2 ranks, <transport>: median <us> us"
 * Transport "hybrid" (p2p only): 4 ranks on 2 simulated hosts (ranks 2h
 * and 2h+1 on host h); ranks 0 and 1, of one host, take the round trips
 * while the others leave.
 */
#include <stdlib.h>

#include "bench_median.h"
#include "check.h"
#include "group.h"

#define WARMUP 2000
#define BATCHES 5
#define CALLS 20000

static int allreduce_once(tcc_comm_t *comm, float *x) {
  const tcc_buf_t b = {x, 2, TCC_FLOAT32, -1, NULL};
  tcc_op_t *op;
  if (tcc_allreduce(comm, b, b, TCC_SUM, NULL, &op) != TCC_OK) return 0;
  const tcc_result_t r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  return r == TCC_OK;
}

static int p2p_once(tcc_comm_t *comm, float *x, int send) {
  const tcc_buf_t b = {x, 2, TCC_FLOAT32, -1, NULL};
  tcc_op_t *op;
  const int peer = 1 - tcc_comm_rank(comm);
  if ((send ? tcc_send(comm, b, peer, 7, NULL, &op) : tcc_recv(comm, b, peer, 7, NULL, &op)) != TCC_OK) return 0;
  const tcc_result_t r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  return r == TCC_OK;
}

/* One round trip; rank 0 checks the reply is its value plus one. */
static int round_trip(tcc_comm_t *comm, int i) {
  float x[2] = {(float)i, (float)i};
  if (tcc_comm_rank(comm) == 0)
    return p2p_once(comm, x, 1) && p2p_once(comm, x, 0) && x[0] == (float)(i + 1) && x[1] == (float)(i + 1);
  if (!p2p_once(comm, x, 0)) return 0;
  x[0] += 1, x[1] += 1;
  return p2p_once(comm, x, 1);
}

static void bench_p2p(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  double per_trip[BATCHES];
  for (int i = 0; i < WARMUP; i++) CHECK(round_trip(comm, i % 1000), "warm-up round trip %d", i);
  for (int b = 0; b < BATCHES; b++) {
    const int64_t start = tcc__now_ns();
    for (int i = 0; i < CALLS; i++)
      if (!round_trip(comm, i % 1000)) {
        CHECK(0, "round trip %d of batch %d failed or gave a wrong reply", i, b);
        return;
      }
    per_trip[b] = (double)(tcc__now_ns() - start) / CALLS / 1000.0;
    if (me == 0) printf("batch %d: %.2f us per round trip\n", b, per_trip[b]);
  }
  if (me == 0)
    printf("core 8 B send/recv round trip, ranks 0-1 of %d, %s: median %.2f us\n", tcc_comm_size(comm),
           tcc_comm_transport_name(comm),
           median(per_trip, BATCHES));
  fflush(stdout);
}

static void bench(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const float want = (float)(n * (n + 1) / 2);
  double per_call[BATCHES];
  for (int i = 0; i < WARMUP; i++) {
    float x[2] = {(float)(me + 1), (float)(me + 1)};
    CHECK(allreduce_once(comm, x) && x[0] == want && x[1] == want, "warm-up allreduce gave %f", x[0]);
  }
  for (int b = 0; b < BATCHES; b++) {
    float token[2] = {0, 0}; /* lines the ranks up before each batch */
    CHECK(allreduce_once(comm, token), "barrier");
    const int64_t start = tcc__now_ns();
    for (int i = 0; i < CALLS; i++) {
      float x[2] = {(float)(me + 1), (float)(me + 1)};
      if (!allreduce_once(comm, x) || x[0] != want) {
        CHECK(0, "allreduce %d of batch %d gave %f, want %f", i, b, x[0], want);
        return;
      }
    }
    per_call[b] = (double)(tcc__now_ns() - start) / CALLS / 1000.0;
    if (me == 0) printf("batch %d: %.2f us per call\n", b, per_call[b]);
  }
  if (me == 0)
    printf("core 8 B allreduce, %d ranks, %s: median %.2f us per call\n", n, tcc_comm_transport_name(comm),
           median(per_call, BATCHES));
  fflush(stdout);
}

int main(int argc, char **argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 2;
  const char *transport = argc > 2 ? argv[2] : "shm";
  const char *what = argc > 3 ? argv[3] : "allreduce";
  const int p2p = strcmp(what, "p2p") == 0, hybrid = strcmp(transport, "hybrid") == 0;
  if (n < 1 || n > 8 || (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0 && !hybrid) ||
      (!p2p && strcmp(what, "allreduce") != 0) || (p2p && n != (hybrid ? 4 : 2)) || (hybrid && !p2p)) {
    fprintf(stderr, "usage: bench_latency [ranks 1..8] [shm|tcp] [allreduce|p2p (2 ranks)]\n"
                    "       bench_latency 4 hybrid p2p\n");
    return 2;
  }
  return run_group(n, hybrid ? "auto-pairs" : transport, 60000, "bench-latency", p2p ? bench_p2p : bench);
}
