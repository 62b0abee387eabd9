/*
 * bench_latency.c - time per small all_reduce when a program drives the
 * core directly: tcc_allreduce of 2 float32 (8 bytes) + tcc_op_wait +
 * tcc_op_release, no torch. The floor under every layer above it
 * (bench/bench_layers.py prints it next to them).
 *
 * Usage: bench_latency [ranks] [shm|tcp] [allreduce|allgather|alltoall|broadcast|gather|scatter|reduce|p2p]
 *                     [cold BYTES | blocking]
 *        (default: 2 shm allreduce)
 * Prints one line per batch on rank 0, then
 *   "core 8 B <op>, <n> ranks, <transport>: median <us> us per call"
 * allgather and alltoall move 8 bytes (2 float32) per pair of ranks. Every
 * result is checked (the sum of the ranks' values; every block received
 * from the rank and for the rank it should come from). broadcast moves 8
 * bytes from rank 0, a small rooted op whose root returns at once; gather,
 * scatter and reduce (sum) 8 bytes per rank, to or from rank 0.
 *
 * p2p (2 ranks): round trips of 8 bytes, rank 0 sends and receives the
 * reply, rank 1 receives and sends it back plus one; each reply checked.
 *   "core 8 B send/recv round trip, 2 ranks, <transport>: median <us> us"
 * cold BYTES (collectives): before every call each rank copies BYTES (half
 * that size from one buffer to another) outside the clock, which then times
 * each call alone: the op on caches a large op's data has just gone
 * through (bench/bench_layers.py --cold).
 * blocking: every call is a blocking one (no op handle, include/tccomm.h)
 * instead of an op issued, waited on and released.
 * Transport "hybrid" (p2p only): 4 ranks on 2 simulated hosts (ranks 2h
 * and 2h+1 on host h); ranks 0 and 1, of one host, take the round trips
 * while the others leave.
 */
#include <stdlib.h>
#include <string.h>

#include "bench_median.h"
#include "check.h"
#include "group.h"

#define WARMUP 2000
#define BATCHES 5
#define CALLS 20000
#define TCC_MAX_BENCH_RANKS 8

typedef enum { OP_ALLREDUCE, OP_ALLGATHER, OP_ALLTOALL, OP_BROADCAST, OP_GATHER, OP_SCATTER, OP_REDUCE } coll_op_t;
static const char *const coll_names[] = {"allreduce", "allgather", "alltoall", "broadcast", "gather", "scatter", "reduce"};
#define COLL_KINDS 7

/* One op's buffers: 2 float32 per rank (all-reduce: its input and output). */
typedef struct blocks {
  float in[TCC_MAX_BENCH_RANKS][2], out[TCC_MAX_BENCH_RANKS][2];
  tcc_buf_t sends[TCC_MAX_BENCH_RANKS], recvs[TCC_MAX_BENCH_RANKS];
} blocks_t;

/* The value rank `from` sends rank `to` in call i (all-reduce and
 * all-gather: the same to every rank). */
static float value_of(coll_op_t what, int from, int to, int i) {
  return (float)((what == OP_ALLTOALL ? from * 16 + to : from + 1) + i % 64);
}

static bool blocking; /* set before the ranks fork */

/* Waits for and releases op, unless the call was blocking (op NULL). */
static int finished_ok(tcc_result_t issued, tcc_op_t *op) {
  if (issued != TCC_OK) return 0;
  if (!op) return 1;
  const tcc_result_t r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  return r == TCC_OK;
}

static int coll_once(tcc_comm_t *comm, coll_op_t what, blocks_t *b, int i) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  for (int j = 0; j < n; j++) {
    b->in[j][0] = b->in[j][1] = value_of(what, me, j, i);
    b->out[j][0] = b->out[j][1] = -1;
    b->sends[j] = (tcc_buf_t){b->in[j], 2, TCC_FLOAT32, -1, NULL};
    b->recvs[j] = (tcc_buf_t){b->out[j], 2, TCC_FLOAT32, -1, NULL};
  }
  tcc_op_t *op = NULL, **handle = blocking ? NULL : &op;
  if (what == OP_BROADCAST && me != 0) b->in[0][0] = b->in[0][1] = -1;
  tcc_result_t issued;
  switch (what) {
    case OP_ALLREDUCE: issued = tcc_allreduce(comm, b->sends[0], b->sends[0], TCC_SUM, NULL, handle); break;
    case OP_ALLGATHER: issued = tcc_allgather(comm, b->sends[0], b->recvs, NULL, handle); break;
    case OP_BROADCAST: issued = tcc_broadcast(comm, b->sends[0], 0, NULL, handle); break;
    case OP_GATHER: issued = tcc_gather(comm, b->sends[0], b->recvs, 0, NULL, handle); break;
    case OP_SCATTER: issued = tcc_scatter(comm, b->sends, b->recvs[0], 0, NULL, handle); break;
    case OP_REDUCE: issued = tcc_reduce(comm, b->sends[0], b->recvs[0], TCC_SUM, 0, NULL, handle); break;
    default: issued = tcc_alltoall(comm, b->sends, b->recvs, NULL, handle); break;
  }
  if (!finished_ok(issued, op)) return 0;
  if (what == OP_ALLREDUCE || (what == OP_REDUCE && me == 0)) {
    float want = 0;
    for (int j = 0; j < n; j++) want += value_of(what, j, me, i);
    const float *got = what == OP_REDUCE ? b->out[0] : b->in[0];
    return got[0] == want && got[1] == want;
  }
  if (what == OP_BROADCAST) return b->in[0][0] == value_of(what, 0, 0, i) && b->in[0][1] == value_of(what, 0, 0, i);
  if (what == OP_SCATTER) return b->out[0][0] == value_of(what, 0, me, i) && b->out[0][1] == value_of(what, 0, me, i);
  if ((what == OP_GATHER || what == OP_REDUCE) && me != 0) return 1; /* nothing received */
  for (int j = 0; j < n; j++)
    if (b->out[j][0] != value_of(what, j, me, i) || b->out[j][1] != value_of(what, j, me, i)) return 0;
  return 1;
}

static int p2p_once(tcc_comm_t *comm, float *x, int send) {
  const tcc_buf_t b = {x, 2, TCC_FLOAT32, -1, NULL};
  tcc_op_t *op = NULL, **handle = blocking ? NULL : &op;
  const int peer = 1 - tcc_comm_rank(comm);
  const tcc_result_t issued = send ? tcc_send(comm, b, peer, 7, NULL, handle) : tcc_recv(comm, b, peer, 7, NULL, handle);
  return finished_ok(issued, op); /* op read after the call set it */
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
    printf("core 8 B send/recv round trip%s, ranks 0-1 of %d, %s: median %.2f us\n", blocking ? " (blocking)" : "", tcc_comm_size(comm),
           tcc_comm_transport_name(comm),
           median(per_trip, BATCHES));
  fflush(stdout);
}

static coll_op_t bench_op; /* set before the ranks fork */
static size_t cold_bytes;  /* likewise */

/* Pushes the caches' contents out: cold_bytes copied through them. */
static void go_cold(char *from, char *to) {
  memcpy(to, from, cold_bytes / 2);
  __asm__ __volatile__("" ::: "memory"); /* the copy is not left out */
}

static void bench(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const coll_op_t what = bench_op;
  const char *name = coll_names[what];
  static blocks_t b;
  double per_call[BATCHES];
  char *cold = cold_bytes ? malloc(cold_bytes) : NULL;
  CHECK(!cold_bytes || cold, "out of memory");
  if (cold) memset(cold, 1, cold_bytes);
  for (int i = 0; i < WARMUP; i++) CHECK(coll_once(comm, what, &b, i), "warm-up %s %d gave a wrong result", name, i);
  for (int k = 0; k < BATCHES; k++) {
    CHECK(coll_once(comm, what, &b, 0), "%s lining the ranks up", name); /* before each batch */
    int64_t start = tcc__now_ns(), spent = 0;
    for (int i = 0; i < CALLS; i++) {
      if (cold) {
        go_cold(cold, cold + cold_bytes / 2);
        start = tcc__now_ns();
      }
      if (!coll_once(comm, what, &b, i)) {
        CHECK(0, "%s %d of batch %d failed or gave a wrong result", name, i, k);
        return;
      }
      if (cold) spent += tcc__now_ns() - start;
    }
    if (!cold) spent = tcc__now_ns() - start;
    per_call[k] = (double)spent / CALLS / 1000.0;
    if (me == 0) printf("batch %d: %.2f us per call\n", k, per_call[k]);
  }
  if (me == 0)
    printf("core 8 B %s%s, %d ranks, %s: median %.2f us per call\n", name, blocking ? " (blocking)" : "", n,
           tcc_comm_transport_name(comm), median(per_call, BATCHES));
  fflush(stdout);
  free(cold);
}

int main(int argc, char **argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 2;
  const char *transport = argc > 2 ? argv[2] : "shm";
  const char *what = argc > 3 ? argv[3] : "allreduce";
  const int p2p = strcmp(what, "p2p") == 0, hybrid = strcmp(transport, "hybrid") == 0;
  blocking = argc == 5 && strcmp(argv[4], "blocking") == 0;
  const int cold_ok = argc <= 4 || blocking || (argc == 6 && strcmp(argv[4], "cold") == 0 && atoll(argv[5]) > 0);
  if (argc == 6) cold_bytes = (size_t)atoll(argv[5]);
  int coll = -1;
  for (int k = 0; k < COLL_KINDS; k++)
    if (strcmp(what, coll_names[k]) == 0) coll = k;
  if (n < 1 || n > TCC_MAX_BENCH_RANKS || (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0 && !hybrid) ||
      (!p2p && coll < 0) || (p2p && n != (hybrid ? 4 : 2)) || (hybrid && !p2p) || !cold_ok || (p2p && cold_bytes)) {
    fprintf(stderr, "usage: bench_latency [ranks 1..8] [shm|tcp] [allreduce|allgather|alltoall|broadcast|gather|scatter|reduce|p2p (2 ranks)]"
                    " [cold BYTES (collectives) | blocking]\n"
                    "       bench_latency 4 hybrid p2p\n");
    return 2;
  }
  bench_op = coll < 0 ? OP_ALLREDUCE : (coll_op_t)coll;
  return run_group(n, hybrid ? "auto-pairs" : transport, 60000, "bench-latency", p2p ? bench_p2p : bench);
}
