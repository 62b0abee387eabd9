/*
 * test_comm.c - end-to-end tests of the public API (engine + transports)
 * in real multi-process groups, without torch. Each group is forked from
 * this process; ranks swap endpoint blobs through an anonymous shared
 * mapping made before the fork.
 *
 * Usage: test_comm [shm|tcp]   (default: both)
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "group.h"
#include "tccomm.h"

static tcc_result_t wait_op(tcc_result_t r, tcc_op_t *op, char *msg, size_t len) {
  if (r != TCC_OK) return r;
  r = tcc_op_wait(op, -1);
  if (msg) snprintf(msg, len, "%s", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}

/* Issues `call` (which sets op), then waits for op. */
#define RUN(call) ({ tcc_result_t run_r_ = (call); wait_op(run_r_, op, NULL, 0); })

static tcc_buf_t host_buf(void *p, size_t count, tcc_dtype_t dt) {
  return (tcc_buf_t){p, count, dt, -1, NULL};
}

/* Value of element i of rank r's input in case `salt`: small integers so
 * float sums are exact and the reference is unambiguous. */
static float input_value(int r, size_t i, int salt) { return (float)((int)((i * 7 + (size_t)salt) % 13) - 6 + r); }

static void test_allreduce(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t counts[] = {0, 1, 7, 8, 9, 1000, 8191, 300001, 1u << 20}; /* 8 and 9: the last that travels in the descriptor's line, the first that does not */
  for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
    size_t count = counts[ci];
    for (int inplace = 0; inplace < 2; inplace++) {
      /* An empty tensor may have no data at all: torch passes NULL. */
      float *in = count ? malloc(count * 4) : NULL, *out = count ? malloc(count * 4) : NULL;
      for (size_t i = 0; i < count; i++) in[i] = input_value(me, i, (int)ci);
      tcc_op_t *op;
      float *dst = inplace ? in : out;
      tcc_result_t r = RUN(tcc_allreduce(comm, host_buf(in, count, TCC_FLOAT32),
                                         host_buf(dst, count, TCC_FLOAT32), TCC_SUM, NULL, &op));
      CHECK(r == TCC_OK, "allreduce count %zu: %s", count, tcc_result_string(r));
      size_t bad = 0;
      for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int k = 0; k < n; k++) want += input_value(k, i, (int)ci);
        bad += dst[i] != want;
      }
      CHECK(bad == 0, "allreduce sum count %zu inplace %d: %zu wrong (rank %d)", count, inplace, bad, me);
      free(in);
      free(out);
    }
  }
  /* integer MAX and truncating AVG */
  int32_t v[5], out[5];
  for (int i = 0; i < 5; i++) v[i] = (me - 2) * (i + 1) * 3 + 1;
  tcc_op_t *op;
  CHECK(RUN(tcc_allreduce(comm, host_buf(v, 5, TCC_INT32), host_buf(out, 5, TCC_INT32), TCC_MAX, NULL, &op)) == TCC_OK, "max");
  for (int i = 0; i < 5; i++) CHECK(out[i] == (n - 1 - 2) * (i + 1) * 3 + 1, "max[%d]=%d", i, out[i]);
  CHECK(RUN(tcc_allreduce(comm, host_buf(v, 5, TCC_INT32), host_buf(out, 5, TCC_INT32), TCC_AVG, NULL, &op)) == TCC_OK, "avg");
  for (int i = 0; i < 5; i++) {
    int32_t sum = 0;
    for (int k = 0; k < n; k++) sum += (k - 2) * (i + 1) * 3 + 1;
    CHECK(out[i] == sum / n, "avg[%d]=%d want %d", i, out[i], sum / n);
  }
}

static void test_reduce_and_bcast(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const int root = n - 1;
  const size_t counts[] = {3, 100000, 400000};
  for (size_t ci = 0; ci < 3; ci++) {
    size_t count = counts[ci];
    double *in = malloc(count * 8), *out = malloc(count * 8);
    for (size_t i = 0; i < count; i++) in[i] = input_value(me, i, 3);
    tcc_op_t *op;
    CHECK(RUN(tcc_reduce(comm, host_buf(in, count, TCC_FLOAT64), host_buf(out, count, TCC_FLOAT64), TCC_SUM,
                         root, NULL, &op)) == TCC_OK, "reduce");
    if (me == root) {
      size_t bad = 0;
      for (size_t i = 0; i < count; i++) {
        double want = 0;
        for (int k = 0; k < n; k++) want += input_value(k, i, 3);
        bad += out[i] != want;
      }
      CHECK(bad == 0, "reduce count %zu: %zu wrong", count, bad);
    }
    for (size_t i = 0; i < count; i++) in[i] = me == 0 ? (double)i * 0.25 : -1;
    CHECK(RUN(tcc_broadcast(comm, host_buf(in, count, TCC_FLOAT64), 0, NULL, &op)) == TCC_OK, "bcast");
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) bad += in[i] != (double)i * 0.25;
    CHECK(bad == 0, "broadcast count %zu: %zu wrong", count, bad);
    free(in);
    free(out);
  }
}

static void test_gathers(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t counts[] = {0, 5, 200003};
  for (size_t ci = 0; ci < 3; ci++) {
    size_t count = counts[ci];
    int32_t *in = malloc(count * 4 + 4), *all = malloc(count * 4 * (size_t)n + 4);
    tcc_buf_t bufs[GROUP_MAX_RANKS];
    for (size_t i = 0; i < count; i++) in[i] = (int32_t)(me * 1000003 + (int)i);
    for (int j = 0; j < n; j++) bufs[j] = host_buf(all + (size_t)j * count, count, TCC_INT32);
    tcc_op_t *op;
    memset(all, 0, count * 4 * (size_t)n);
    CHECK(RUN(tcc_allgather(comm, host_buf(in, count, TCC_INT32), bufs, NULL, &op)) == TCC_OK, "allgather");
    size_t bad = 0;
    for (int j = 0; j < n; j++)
      for (size_t i = 0; i < count; i++) bad += all[(size_t)j * count + i] != (int32_t)(j * 1000003 + (int)i);
    CHECK(bad == 0, "allgather count %zu: %zu wrong", count, bad);

    int root = n / 2;
    memset(all, 0, count * 4 * (size_t)n);
    CHECK(RUN(tcc_gather(comm, host_buf(in, count, TCC_INT32), bufs, root, NULL, &op)) == TCC_OK, "gather");
    if (me == root) {
      bad = 0;
      for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) bad += all[(size_t)j * count + i] != (int32_t)(j * 1000003 + (int)i);
      CHECK(bad == 0, "gather count %zu: %zu wrong", count, bad);
    }

    /* scatter: root sends block j = j*7 + i */
    for (int j = 0; j < n; j++)
      for (size_t i = 0; i < count; i++) all[(size_t)j * count + i] = j * 7 + (int32_t)i;
    CHECK(RUN(tcc_scatter(comm, bufs, host_buf(in, count, TCC_INT32), root, NULL, &op)) == TCC_OK, "scatter");
    bad = 0;
    for (size_t i = 0; i < count; i++) bad += in[i] != me * 7 + (int32_t)i;
    CHECK(bad == 0, "scatter count %zu: %zu wrong", count, bad);

    /* reduce_scatter: block j of rank r = r + j + i; rank me gets sum_r (r + me + i) */
    for (int j = 0; j < n; j++)
      for (size_t i = 0; i < count; i++) all[(size_t)j * count + i] = me + j + (int32_t)i;
    CHECK(RUN(tcc_reduce_scatter(comm, bufs, host_buf(in, count, TCC_INT32), TCC_SUM, NULL, &op)) == TCC_OK,
          "reduce_scatter");
    bad = 0;
    for (size_t i = 0; i < count; i++) bad += in[i] != n * (n - 1) / 2 + n * (me + (int32_t)i);
    CHECK(bad == 0, "reduce_scatter count %zu: %zu wrong", count, bad);
    free(in);
    free(all);
  }
}

static size_t a2a_count(int from, int to, int salt) { return (size_t)((from + 2 * to + salt) % 3) * (size_t)(salt ? 70001 : 3); }

static void test_alltoall(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  for (int salt = 0; salt < 2; salt++) {
    tcc_buf_t sends[GROUP_MAX_RANKS], recvs[GROUP_MAX_RANKS];
    for (int k = 0; k < n; k++) {
      size_t sc = a2a_count(me, k, salt), rc = a2a_count(k, me, salt);
      int16_t *s = malloc(sc * 2 + 2), *r = malloc(rc * 2 + 2);
      for (size_t i = 0; i < sc; i++) s[i] = (int16_t)(me * 100 + k * 10 + (int)(i % 7));
      sends[k] = host_buf(s, sc, TCC_INT16);
      recvs[k] = host_buf(r, rc, TCC_INT16);
    }
    tcc_op_t *op;
    CHECK(RUN(tcc_alltoall(comm, sends, recvs, NULL, &op)) == TCC_OK, "alltoall");
    size_t bad = 0;
    for (int j = 0; j < n; j++) {
      int16_t *r = recvs[j].ptr;
      for (size_t i = 0; i < recvs[j].count; i++) bad += r[i] != (int16_t)(j * 100 + me * 10 + (int)(i % 7));
    }
    CHECK(bad == 0, "alltoall salt %d: %zu wrong", salt, bad);
    for (int k = 0; k < n; k++) {
      free(sends[k].ptr);
      free(recvs[k].ptr);
    }
  }
  /* In place (outputs are the inputs), larger than a staging window: the
   * transport must not overwrite bytes it still has to send. */
  const size_t block = 150001;
  int32_t *buf = malloc(block * 4 * (size_t)n);
  tcc_buf_t same[GROUP_MAX_RANKS];
  for (int k = 0; k < n; k++) {
    for (size_t i = 0; i < block; i++) buf[(size_t)k * block + i] = me * 1000000 + k * 1000 + (int32_t)(i % 997);
    same[k] = host_buf(buf + (size_t)k * block, block, TCC_INT32);
  }
  tcc_op_t *op;
  CHECK(RUN(tcc_alltoall(comm, same, same, NULL, &op)) == TCC_OK, "alltoall in place");
  size_t bad = 0;
  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < block; i++) bad += buf[(size_t)j * block + i] != j * 1000000 + me * 1000 + (int32_t)(i % 997);
  CHECK(bad == 0, "alltoall in place: %zu wrong", bad);
  free(buf);
  CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier");
}

/* Nobody leaves a barrier before every rank entered it. The last rank
 * enters late and first raises a flag in memory shared by the ranks (named
 * after the test process); the others check the flag once they are out. */
static void test_barrier_waits(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  char name[64];
  snprintf(name, sizeof name, "/tcc-test-barrier-%d", (int)getppid());
  int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
  CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared flag");
  atomic_int *flag = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  for (int round = 0; round < 3; round++) {
    tcc_op_t *op;
    CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier before round %d", round);
    if (me == n - 1) {
      usleep(150 * 1000);
      atomic_store(flag, round + 1);
    }
    CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier of round %d", round);
    CHECK(atomic_load(flag) == round + 1, "round %d: rank %d left the barrier before rank %d entered it", round,
          me, n - 1);
  }
  munmap(flag, 4096);
  tcc_op_t *op;
  CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier after the rounds");
  if (me == 0) shm_unlink(name);
}

static void test_p2p(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2) return;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  const size_t big = 3u << 20; /* larger than a ring: forces streaming */
  char *a = malloc(big), *b = malloc(big);
  for (size_t i = 0; i < big; i++) a[i] = (char)(me + i);
  int small_out[2] = {me, -me}, small_in[2] = {0, 0};
  tcc_op_t *ops[4] = {NULL, NULL, NULL, NULL};
  /* Send two tagged messages; receive them in the opposite tag order. */
  CHECK(tcc_send(comm, host_buf(small_out, 2, TCC_INT32), next, 1, NULL, &ops[0]) == TCC_OK, "send");
  CHECK(tcc_send(comm, host_buf(a, big, TCC_UINT8), next, 2, NULL, &ops[1]) == TCC_OK, "send big");
  CHECK(tcc_recv(comm, host_buf(b, big, TCC_UINT8), prev, 2, NULL, &ops[2]) == TCC_OK, "recv big");
  CHECK(tcc_recv(comm, host_buf(small_in, 2, TCC_INT32), prev, 1, NULL, &ops[3]) == TCC_OK, "recv");
  for (int i = 0; i < 4; i++) {
    if (!ops[i]) continue;
    tcc_result_t r = tcc_op_wait(ops[i], -1);
    CHECK(r == TCC_OK, "p2p op %d: %s", i, tcc_op_error(ops[i]));
    tcc_op_release(ops[i]);
  }
  CHECK(small_in[0] == prev && small_in[1] == -prev, "small p2p got %d %d", small_in[0], small_in[1]);
  size_t bad = 0;
  for (size_t i = 0; i < big; i++) bad += b[i] != (char)(prev + i);
  CHECK(bad == 0, "big p2p: %zu wrong", bad);
  free(a);
  free(b);
}

/* Many messages issued before any is received: mostly 1 to 1024 bytes,
 * every tenth up to 70000 bytes (either side of the size up to which a
 * header and its payload go out in one gathered write). More bytes than a
 * shared-memory ring (1 MiB) or a socket's buffers hold, so writes stop
 * part-way through a message, within its header, its payload or between
 * the two, and go on later. Every message arrives whole, in order, with
 * its own tag. */
enum { MANY_MESSAGES = 2500 };

static size_t many_len(int i) { return i % 10 == 9 ? 1 + (size_t)(i * 7919) % 70000 : 1 + (size_t)(i * 37) % 1024; }

static void test_p2p_many_small(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2) return;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  size_t *at = malloc((MANY_MESSAGES + 1) * sizeof *at);
  CHECK(at != NULL, "out of memory");
  if (!at) return;
  at[0] = 0;
  for (int i = 0; i < MANY_MESSAGES; i++) at[i + 1] = at[i] + many_len(i);
  unsigned char *out = malloc(at[MANY_MESSAGES]), *in = malloc(at[MANY_MESSAGES]);
  tcc_op_t **sends = calloc(MANY_MESSAGES, sizeof *sends), **recvs = calloc(MANY_MESSAGES, sizeof *recvs);
  CHECK(out && in && sends && recvs, "out of memory");
  if (!out || !in || !sends || !recvs) return;
  for (int i = 0; i < MANY_MESSAGES; i++) {
    unsigned char *m = out + at[i];
    for (size_t k = 0; k < many_len(i); k++) m[k] = (unsigned char)(me * 31 + i * 7 + (int)k);
    CHECK(tcc_send(comm, host_buf(m, many_len(i), TCC_UINT8), next, (uint64_t)i, NULL, &sends[i]) == TCC_OK,
          "send %d", i);
  }
  memset(in, 0, at[MANY_MESSAGES]);
  for (int i = 0; i < MANY_MESSAGES; i++)
    CHECK(tcc_recv(comm, host_buf(in + at[i], many_len(i), TCC_UINT8), prev, (uint64_t)i, NULL, &recvs[i]) == TCC_OK,
          "recv %d", i);
  size_t bad = 0;
  for (int i = 0; i < MANY_MESSAGES; i++) {
    CHECK(tcc_op_wait(recvs[i], -1) == TCC_OK, "recv %d: %s", i, tcc_op_error(recvs[i]));
    CHECK(tcc_op_wait(sends[i], -1) == TCC_OK, "send %d: %s", i, tcc_op_error(sends[i]));
    tcc_op_release(recvs[i]);
    tcc_op_release(sends[i]);
    const unsigned char *m = in + at[i];
    for (size_t k = 0; k < many_len(i); k++) bad += m[k] != (unsigned char)(prev * 31 + i * 7 + (int)k);
  }
  CHECK(bad == 0, "many p2p messages issued at once: %zu bytes wrong", bad);
  free(at);
  free(out);
  free(in);
  free(sends);
  free(recvs);
}

/* Each flaw in one entry of a per-rank output list fails locally, naming
 * the entry, and nothing is issued. */
static void test_bad_output_lists(tcc_comm_t *comm) {
  enum { MAX_RANKS = 16 };
  const int n = tcc_comm_size(comm);
  if (n > MAX_RANKS) return;
  float in[2] = {0}, out[MAX_RANKS][2];
  tcc_buf_t outs[MAX_RANKS];
  const int last = n - 1;
  struct {
    const char *flaw, *want;
  } cases[] = {{"count", "has 3 elements, expected 2"}, {"dtype", "dtypes differ"},
               {"null", "buffer is NULL"}, {"bad dtype", "invalid dtype"}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    for (int j = 0; j < n; j++) outs[j] = host_buf(out[j], 2, TCC_FLOAT32);
    if (k == 0) outs[last].count = 3;
    if (k == 1) outs[last].dtype = TCC_INT32;
    if (k == 2) outs[last].ptr = NULL;
    if (k == 3) outs[last].dtype = (tcc_dtype_t)TCC_DTYPE_COUNT;
    char entry[32];
    snprintf(entry, sizeof entry, "output[%d]", last);
    tcc_op_t *op = NULL;
    tcc_result_t r = tcc_allgather(comm, host_buf(in, 2, TCC_FLOAT32), outs, NULL, &op);
    const char *msg = tcc_last_error();
    CHECK(r == TCC_ERR_INVALID && op == NULL, "allgather with a bad %s: %s", cases[k].flaw, tcc_result_string(r));
    CHECK(strstr(msg, cases[k].want) && (k == 1 || strstr(msg, entry)), "allgather with a bad %s: %s",
          cases[k].flaw, msg);
  }
}

static void test_mismatch(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2) return;
  float x[12] = {0};
  tcc_op_t *op;
  char msg[512];
  tcc_result_t r = tcc_allreduce(comm, host_buf(x, me == 1 ? 11 : 10, TCC_FLOAT32),
                                 host_buf(x, me == 1 ? 11 : 10, TCC_FLOAT32), TCC_SUM, NULL, &op);
  r = wait_op(r, op, msg, sizeof msg);
  CHECK(r == TCC_ERR_MISMATCH, "mismatch gave %s", tcc_result_string(r));
  CHECK(strstr(msg, "allreduce") && strstr(msg, "rank 1"), "mismatch message: %s", msg);
  /* The communicator stays usable. */
  for (int i = 0; i < 12; i++) x[i] = 1;
  CHECK(RUN(tcc_allreduce(comm, host_buf(x, 12, TCC_FLOAT32), host_buf(x, 12, TCC_FLOAT32), TCC_SUM, NULL, &op)) ==
            TCC_OK, "allreduce after mismatch");
  CHECK(x[11] == (float)n, "allreduce after mismatch gave %f", x[11]);
  /* An all-to-all whose every rank sends and expects one count alike (the
   * short descriptor over shared memory), the last rank 2 elements per
   * peer and the others 1: the first disagreeing pair in rank order is
   * rank 0 sending 1 to the last rank, which expects 2. */
  float ins[GROUP_MAX_RANKS][2], outs[GROUP_MAX_RANKS][2];
  tcc_buf_t sends[GROUP_MAX_RANKS], recvs[GROUP_MAX_RANKS];
  const size_t each = me == n - 1 ? 2 : 1;
  for (int j = 0; j < n; j++) {
    sends[j] = host_buf(ins[j], each, TCC_FLOAT32);
    recvs[j] = host_buf(outs[j], each, TCC_FLOAT32);
  }
  r = tcc_alltoall(comm, sends, recvs, NULL, &op);
  r = wait_op(r, op, msg, sizeof msg);
  char want[128];
  snprintf(want, sizeof want, "split size mismatch: rank 0 sends 1 elements to rank %d, which expects 2", n - 1);
  CHECK(r == TCC_ERR_MISMATCH && strstr(msg, want), "alltoall with uneven splits gave %s: %s", tcc_result_string(r),
        msg);
  for (int j = 0; j < n; j++) {
    ins[j][0] = (float)(me * 100 + j);
    sends[j] = host_buf(ins[j], 1, TCC_FLOAT32);
    recvs[j] = host_buf(outs[j], 1, TCC_FLOAT32);
  }
  CHECK(RUN(tcc_alltoall(comm, sends, recvs, NULL, &op)) == TCC_OK, "alltoall after mismatch");
  for (int j = 0; j < n; j++)
    CHECK(outs[j][0] == (float)(j * 100 + me), "alltoall after mismatch: from rank %d got %f", j, outs[j][0]);
  /* Invalid local arguments fail before anything is sent. */
  r = tcc_broadcast(comm, host_buf(x, 1, TCC_FLOAT32), n, NULL, &op);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "root"), "bad root: %s", tcc_last_error());
  r = tcc_allreduce(comm, host_buf(x, 1, TCC_FLOAT32), host_buf(x, 1, TCC_FLOAT32), TCC_BXOR, NULL, &op);
  CHECK(r == TCC_ERR_UNSUPPORTED, "bxor on float: %s", tcc_result_string(r));
  test_bad_output_lists(comm);
}

/* A collective nobody waits on must still run: rank 0 issues it and then
 * blocks on a message that rank 1 sends only after the collective. */
static void test_unwaited_collective(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2) return;
  float x = 1, token = 0;
  tcc_op_t *coll, *p2p;
  CHECK(tcc_allreduce(comm, host_buf(&x, 1, TCC_FLOAT32), host_buf(&x, 1, TCC_FLOAT32), TCC_SUM, NULL, &coll) ==
            TCC_OK, "allreduce");
  if (me == 0) {
    CHECK(tcc_recv(comm, host_buf(&token, 1, TCC_FLOAT32), 1, 7, NULL, &p2p) == TCC_OK, "recv");
    CHECK(tcc_op_wait(p2p, -1) == TCC_OK, "recv after an unwaited allreduce: %s", tcc_op_error(p2p));
    CHECK(token == (float)n, "token %f", token);
    tcc_op_release(p2p);
  }
  CHECK(tcc_op_wait(coll, -1) == TCC_OK, "allreduce: %s", tcc_op_error(coll));
  tcc_op_release(coll);
  if (me == 1) {
    token = x;
    CHECK(tcc_send(comm, host_buf(&token, 1, TCC_FLOAT32), 0, 7, NULL, &p2p) == TCC_OK, "send");
    CHECK(tcc_op_wait(p2p, -1) == TCC_OK, "send: %s", tcc_op_error(p2p));
    tcc_op_release(p2p);
  }
  CHECK(x == (float)n, "allreduce gave %f", x);
}

/* Ranks 2.. leave (destroy their communicator) while 0 and 1 still talk:
 * a peer that closed must not break the streams between the others. */
static void test_peer_leaves_early(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (tcc_comm_size(comm) < 3 || me >= 2) return;
  usleep(200 * 1000); /* long enough for the others to have closed */
  int v = me == 0 ? 42 : 0;
  tcc_op_t *op;
  tcc_result_t r = me == 0 ? tcc_send(comm, host_buf(&v, 1, TCC_INT32), 1, 9, NULL, &op)
                           : tcc_recv(comm, host_buf(&v, 1, TCC_INT32), 0, 9, NULL, &op);
  CHECK(r == TCC_OK, "p2p after peers left: %s", tcc_last_error());
  if (r != TCC_OK) return;
  CHECK(tcc_op_wait(op, -1) == TCC_OK, "p2p after peers left: %s", tcc_op_error(op));
  CHECK(v == 42, "p2p after peers left gave %d", v);
  tcc_op_release(op);
}

/* Rank 0 receives from any source: one message from every other rank,
 * each reported with its sender. At 2 ranks also the order rule: a
 * message goes to the earliest-posted matching receive, so an any-source
 * receive posted before a specific one takes the first message. */
static void test_any_source(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm), n = tcc_comm_size(comm);
  if (n < 2) return;
  if (me != 0) {
    int v = 1000 + me;
    tcc_op_t *op;
    CHECK(RUN(tcc_send(comm, host_buf(&v, 1, TCC_INT32), 0, 7, NULL, &op)) == TCC_OK, "send to any");
  } else {
    int seen = 0;
    for (int k = 1; k < n; k++) {
      int v = -1;
      tcc_op_t *op;
      CHECK(tcc_recv(comm, host_buf(&v, 1, TCC_INT32), TCC_ANY_SOURCE, 7, NULL, &op) == TCC_OK, "post");
      CHECK(tcc_op_peer(op) == TCC_ANY_SOURCE || tcc_op_test(op), "peer known before completion");
      CHECK(tcc_op_wait(op, -1) == TCC_OK, "recv from any: %s", tcc_op_error(op));
      int src = tcc_op_peer(op);
      CHECK(src >= 1 && src < n && v == 1000 + src, "recv from any: got %d from rank %d", v, src);
      if (src >= 1 && src < n) seen |= 1 << src;
      tcc_op_release(op);
    }
    CHECK(seen == ((1 << n) - 2), "senders seen: %#x", seen);
  }
  if (n != 2) return;
  int a = -1, b = -1, v1 = 1, v2 = 2;
  tcc_op_t *any, *mine, *s1, *s2;
  if (me == 0) {
    CHECK(tcc_recv(comm, host_buf(&a, 1, TCC_INT32), TCC_ANY_SOURCE, 8, NULL, &any) == TCC_OK, "post any");
    CHECK(tcc_recv(comm, host_buf(&b, 1, TCC_INT32), 1, 8, NULL, &mine) == TCC_OK, "post specific");
    CHECK(tcc_op_wait(any, -1) == TCC_OK && tcc_op_wait(mine, -1) == TCC_OK, "recvs");
    CHECK(a == 1 && b == 2 && tcc_op_peer(any) == 1, "order: any got %d, specific got %d", a, b);
    tcc_op_release(any);
    tcc_op_release(mine);
  } else {
    CHECK(tcc_send(comm, host_buf(&v1, 1, TCC_INT32), 0, 8, NULL, &s1) == TCC_OK, "send 1");
    CHECK(tcc_send(comm, host_buf(&v2, 1, TCC_INT32), 0, 8, NULL, &s2) == TCC_OK, "send 2");
    CHECK(tcc_op_wait(s1, -1) == TCC_OK && tcc_op_wait(s2, -1) == TCC_OK, "sends");
    tcc_op_release(s1);
    tcc_op_release(s2);
  }
}

/* tcc_op_started: a collective that reached the front of the queue has
 * started although its peers have not joined; the one queued behind it
 * has not; a point-to-point op starts when issued. Ranks >= 2 only join. */
static void test_op_started(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2) return;
  float a = 1, b = 2, token = 0;
  tcc_op_t *first, *second, *p2p;
  if (me == 1) { /* joins only once rank 0 has looked */
    CHECK(tcc_recv(comm, host_buf(&token, 1, TCC_FLOAT32), 0, 9, NULL, &p2p) == TCC_OK, "recv");
    CHECK(tcc_op_started(p2p) == 1, "an issued receive has not started");
    CHECK(tcc_op_wait(p2p, -1) == TCC_OK, "recv: %s", tcc_op_error(p2p));
    tcc_op_release(p2p);
  }
  CHECK(tcc_allreduce(comm, host_buf(&a, 1, TCC_FLOAT32), host_buf(&a, 1, TCC_FLOAT32), TCC_SUM, NULL, &first) ==
            TCC_OK, "allreduce");
  CHECK(tcc_allreduce(comm, host_buf(&b, 1, TCC_FLOAT32), host_buf(&b, 1, TCC_FLOAT32), TCC_SUM, NULL, &second) ==
            TCC_OK, "allreduce");
  if (me == 0) {
    tcc_op_start(first);
    for (int i = 0; i < 5000 && !tcc_op_started(first); i++) usleep(1000);
    CHECK(tcc_op_started(first) == 1, "the first allreduce did not start within 5 s");
    CHECK(tcc_op_started(second) == 0, "the second allreduce started before the first finished");
    CHECK(tcc_op_test(first) == 0, "the first allreduce finished without rank 1");
    token = 1;
    CHECK(tcc_send(comm, host_buf(&token, 1, TCC_FLOAT32), 1, 9, NULL, &p2p) == TCC_OK, "send");
    CHECK(tcc_op_wait(p2p, -1) == TCC_OK, "send: %s", tcc_op_error(p2p));
    tcc_op_release(p2p);
  }
  CHECK(tcc_op_wait(first, -1) == TCC_OK && tcc_op_wait(second, -1) == TCC_OK, "allreduce: %s %s",
        tcc_op_error(first), tcc_op_error(second));
  CHECK(tcc_op_started(first) && tcc_op_started(second), "finished ops must count as started");
  CHECK(a == (float)n && b == (float)(2 * n), "allreduce gave %f and %f", a, b);
  tcc_op_release(first);
  tcc_op_release(second);
}

/* Sends nobody waits on still go out: rank 0 issues more small messages
 * than its stream to rank 1 holds and then blocks in an allreduce that
 * rank 1 joins only once it received them all, so the p2p thread must
 * take the sends over from the submitting thread. Rank 1 takes half of
 * them by polling (tcc_op_test) and half by short bounded waits, so
 * neither of those needs the thread either. */
static void test_unwaited_p2p(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2) return;
  enum { COUNT = 64, INTS = 12 << 10 }; /* 48 KiB each, 3 MiB in all: more than a ring */
  int32_t *data = malloc((size_t)COUNT * INTS * sizeof *data);
  tcc_op_t *ops[COUNT] = {NULL};
  if (me == 0) {
    for (int k = 0; k < COUNT; k++) {
      for (int i = 0; i < INTS; i++) data[(size_t)k * INTS + i] = k * 100000 + i;
      CHECK(tcc_send(comm, host_buf(data + (size_t)k * INTS, INTS, TCC_INT32), 1, 50, NULL, &ops[k]) == TCC_OK,
            "send %d: %s", k, tcc_last_error());
    }
  } else if (me == 1) {
    memset(data, 0, (size_t)COUNT * INTS * sizeof *data);
    for (int k = 0; k < COUNT; k++) {
      CHECK(tcc_recv(comm, host_buf(data + (size_t)k * INTS, INTS, TCC_INT32), 0, 50, NULL, &ops[k]) == TCC_OK,
            "recv %d: %s", k, tcc_last_error());
      tcc_result_t r = TCC_ERR_INPROGRESS;
      for (int polls = 0; polls < 60000 && r == TCC_ERR_INPROGRESS; polls++) {
        if (k % 2) r = tcc_op_wait(ops[k], 5);
        else if (tcc_op_test(ops[k])) r = tcc_op_result(ops[k]);
        else usleep(100);
      }
      CHECK(r == TCC_OK, "recv %d by %s: %s (%s)", k, k % 2 ? "bounded waits" : "polling", tcc_result_string(r),
            tcc_op_error(ops[k]));
    }
  }
  float x = 1;
  tcc_op_t *op;
  CHECK(RUN(tcc_allreduce(comm, host_buf(&x, 1, TCC_FLOAT32), host_buf(&x, 1, TCC_FLOAT32), TCC_SUM, NULL, &op)) ==
            TCC_OK && x == (float)n, "allreduce after unwaited sends gave %f", x);
  for (int k = 0; k < COUNT && me <= 1; k++) {
    if (!ops[k]) continue;
    CHECK(tcc_op_test(ops[k]) == 1 && tcc_op_result(ops[k]) == TCC_OK, "p2p op %d not done: %s", k,
          tcc_op_error(ops[k]));
    tcc_op_release(ops[k]);
  }
  size_t bad = 0;
  for (int k = 0; k < COUNT && me == 1; k++)
    for (int i = 0; i < INTS; i++) bad += data[(size_t)k * INTS + i] != k * 100000 + i;
  CHECK(bad == 0, "unwaited sends: %zu wrong ints", bad);
  free(data);
}

/* Two threads of rank 0 wait on p2p ops at once. Thread A waits (and so
 * runs the p2p rounds) for a reply that rank 1 sends only after thread B's
 * second message, which B sends only once its first one is done. B's wait
 * must end when its op is done, not when A gives up the rounds. */
typedef struct p2p_thread_arg {
  tcc_comm_t *comm;
  int32_t out[2];
  tcc_result_t r;
  double secs;
} p2p_thread_arg_t;

static void *second_waiter(void *p) {
  p2p_thread_arg_t *a = p;
  usleep(100 * 1000); /* after A started waiting */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int k = 0; k < 2 && a->r == TCC_OK; k++) {
    tcc_op_t *op = NULL;
    a->r = tcc_send(a->comm, host_buf(&a->out[k], 1, TCC_INT32), 1, 40 + (uint64_t)k, NULL, &op);
    a->r = wait_op(a->r, op, NULL, 0);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  a->secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  return NULL;
}

static void test_p2p_two_waiters(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2 || me > 1) return;
  int32_t reply = 0;
  tcc_op_t *op = NULL;
  if (me == 1) {
    int32_t got[2] = {0, 0};
    CHECK(RUN(tcc_recv(comm, host_buf(&got[0], 1, TCC_INT32), 0, 40, NULL, &op)) == TCC_OK, "recv first");
    CHECK(RUN(tcc_recv(comm, host_buf(&got[1], 1, TCC_INT32), 0, 41, NULL, &op)) == TCC_OK, "recv second");
    reply = got[0] + got[1];
    CHECK(RUN(tcc_send(comm, host_buf(&reply, 1, TCC_INT32), 0, 42, NULL, &op)) == TCC_OK, "send reply");
    return;
  }
  p2p_thread_arg_t b = {.comm = comm, .out = {5, 7}, .r = TCC_OK, .secs = 0};
  pthread_t tb;
  CHECK(pthread_create(&tb, NULL, second_waiter, &b) == 0, "thread");
  tcc_result_t r = RUN(tcc_recv(comm, host_buf(&reply, 1, TCC_INT32), 1, 42, NULL, &op));
  pthread_join(tb, NULL);
  CHECK(r == TCC_OK && b.r == TCC_OK && reply == 12, "two waiters: reply %d (%s, %s)", reply,
        tcc_result_string(r), tcc_result_string(b.r));
  CHECK(b.secs < 5, "the second waiter's sends took %.2f s", b.secs);
}

/* Threads of ranks 0 and 1 send and receive at once, each in bursts of
 * ops issued before any is waited for, one tag per thread pair: messages
 * with one tag must arrive in the order they were sent, whichever thread
 * runs the rounds meanwhile and whether a submit found its op's
 * predecessors still waiting to be taken (host.h: the submitter's round). */
enum { ORDER_THREADS = 3, ORDER_BURST = 8, ORDER_BURSTS = 150 };

typedef struct order_arg {
  tcc_comm_t *comm;
  int thread;
  int wrong; /* messages that came out of order, or ops that failed */
} order_arg_t;

static void *order_thread(void *p) {
  order_arg_t *a = p;
  const int me = tcc_comm_rank(a->comm);
  const uint64_t tag = 300 + (uint64_t)a->thread;
  int32_t vals[ORDER_BURST];
  tcc_op_t *ops[ORDER_BURST];
  for (int b = 0; b < ORDER_BURSTS; b++) {
    for (int k = 0; k < ORDER_BURST; k++) {
      const int32_t seq = b * ORDER_BURST + k;
      vals[k] = me == 0 ? seq : -1;
      const tcc_buf_t buf = host_buf(&vals[k], 1, TCC_INT32);
      const tcc_result_t r = me == 0 ? tcc_send(a->comm, buf, 1, tag, NULL, &ops[k]) : tcc_recv(a->comm, buf, 0, tag, NULL, &ops[k]);
      if (r != TCC_OK) {
        a->wrong++;
        ops[k] = NULL;
      }
    }
    for (int k = 0; k < ORDER_BURST; k++) {
      if (!ops[k]) continue;
      if (tcc_op_wait(ops[k], -1) != TCC_OK) a->wrong++;
      else if (me == 1 && vals[k] != b * ORDER_BURST + k) a->wrong++;
      tcc_op_release(ops[k]);
    }
  }
  return NULL;
}

static void test_p2p_threads_order(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (n < 2 || me > 1) return;
  order_arg_t args[ORDER_THREADS];
  pthread_t th[ORDER_THREADS];
  for (int t = 0; t < ORDER_THREADS; t++) {
    args[t] = (order_arg_t){comm, t, 0};
    CHECK(pthread_create(&th[t], NULL, order_thread, &args[t]) == 0, "thread %d", t);
  }
  for (int t = 0; t < ORDER_THREADS; t++) {
    pthread_join(th[t], NULL);
    CHECK(args[t].wrong == 0, "p2p from %d threads, thread %d: %d of %d messages failed or out of order",
          ORDER_THREADS, t, args[t].wrong, ORDER_BURST * ORDER_BURSTS);
  }
}

/* Per-pair counts where rank 0 sends and receives 2 everywhere (its
 * counts are even: a short descriptor) and the others do not. */
static size_t a2a_mixed_count(int from, int to) { return from == 0 || to == 0 ? 2 : 1 + (size_t)((from + to) & 1); }

/* Small all-to-alls, whose streams may travel in the descriptor's line:
 * even counts from 1 to 9 int32 per pair (at 2 ranks streams of 4 to 36
 * bytes, across the line's room of 32), and mixed even and listed counts. */
enum { A2A_SMALL_MAX = 9 };
static void test_alltoall_small(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  for (int round = 0; round <= A2A_SMALL_MAX; round++) {
    const bool mixed = round == 0;
    int32_t sendbuf[GROUP_MAX_RANKS][A2A_SMALL_MAX], recvbuf[GROUP_MAX_RANKS][A2A_SMALL_MAX];
    tcc_buf_t sends[GROUP_MAX_RANKS], recvs[GROUP_MAX_RANKS];
    for (int k = 0; k < n; k++) {
      const size_t sc = mixed ? a2a_mixed_count(me, k) : (size_t)round;
      const size_t rc = mixed ? a2a_mixed_count(k, me) : (size_t)round;
      for (size_t i = 0; i < A2A_SMALL_MAX; i++) {
        sendbuf[k][i] = me * 1000 + k * 100 + round * 10 + (int32_t)i;
        recvbuf[k][i] = -1;
      }
      sends[k] = host_buf(sendbuf[k], sc, TCC_INT32);
      recvs[k] = host_buf(recvbuf[k], rc, TCC_INT32);
    }
    tcc_op_t *op;
    CHECK(RUN(tcc_alltoall(comm, sends, recvs, NULL, &op)) == TCC_OK, "small alltoall round %d", round);
    size_t bad = 0;
    for (int j = 0; j < n; j++)
      for (size_t i = 0; i < A2A_SMALL_MAX; i++) {
        const int32_t want = i < recvs[j].count ? j * 1000 + me * 100 + round * 10 + (int32_t)i : -1;
        bad += recvbuf[j][i] != want;
      }
    CHECK(bad == 0, "small alltoall %s count %d: %zu wrong", mixed ? "mixed" : "even", round, bad);
  }
}

/* What a completion callback saw. */
typedef struct seen_by_callback {
  atomic_int runs;
  atomic_int finished_then; /* the op read as finished, with its result, inside the callback */
} seen_by_callback_t;

static void count_run(tcc_op_t *op, void *arg) {
  seen_by_callback_t *s = arg;
  if (tcc_op_test(op) && tcc_op_result(op) == TCC_OK) atomic_fetch_add(&s->finished_then, 1);
  atomic_fetch_add(&s->runs, 1);
}

/* The runs of a callback of a finished op: a waiter may return while the
 * engine's thread, which finished the op, is still to run it. */
static int runs_once_settled(seen_by_callback_t *s) {
  for (int i = 0; i < 10000 && atomic_load(&s->runs) == 0; i++) usleep(1000);
  usleep(1000); /* a second run would come now */
  return atomic_load(&s->runs);
}

/* Completion callbacks: one per op, run exactly once whether the op
 * finishes before, during or after the registration; a second one while
 * the op runs is refused and never runs. */
static void test_callbacks(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  float x = 1;
  tcc_op_t *op;
  /* Registered while the op cannot finish: the other ranks join late. */
  if (me != 0) usleep(50 * 1000);
  seen_by_callback_t first = {0, 0}, second = {0, 0};
  CHECK(tcc_allreduce(comm, host_buf(&x, 1, TCC_FLOAT32), host_buf(&x, 1, TCC_FLOAT32), TCC_SUM, NULL, &op) == TCC_OK,
        "issue");
  CHECK(tcc_op_on_complete(op, count_run, &first) == TCC_OK, "first callback: %s", tcc_last_error());
  if (n > 1 && me == 0) {
    CHECK(tcc_op_on_complete(op, count_run, &second) == TCC_ERR_INVALID, "a second callback was accepted");
    CHECK(strstr(tcc_last_error(), "allreduce") && strstr(tcc_last_error(), "callback already"),
          "second callback refused with: %s", tcc_last_error());
  }
  CHECK(tcc_op_wait(op, -1) == TCC_OK && x == (float)n, "allreduce: %s, %g", tcc_op_error(op), (double)x);
  CHECK(runs_once_settled(&first) == 1 && atomic_load(&first.finished_then) == 1, "first callback ran %d times, %d finished",
        atomic_load(&first.runs), atomic_load(&first.finished_then));
  CHECK(atomic_load(&second.runs) == 0, "the refused callback ran");
  /* On a finished op: at once, on this thread. */
  CHECK(tcc_op_on_complete(op, count_run, &second) == TCC_OK && atomic_load(&second.runs) == 1,
        "callback on a finished op ran %d times", atomic_load(&second.runs));
  tcc_op_release(op);

  /* Registrations racing the op's end: the engine's thread runs it. */
  enum { RACES = 300 };
  seen_by_callback_t *raced = calloc(RACES, sizeof *raced);
  tcc_op_t **ops = calloc(RACES, sizeof *ops);
  CHECK(raced && ops, "out of memory");
  if (!raced || !ops) return;
  for (int i = 0; i < RACES; i++) {
    CHECK(tcc_barrier(comm, NULL, &ops[i]) == TCC_OK, "race %d: issue", i);
    tcc_op_start(ops[i]);
    if (i % 2) usleep((useconds_t)(i % 7)); /* registers before, during or after the end */
    CHECK(tcc_op_on_complete(ops[i], count_run, &raced[i]) == TCC_OK, "race %d: %s", i, tcc_last_error());
  }
  for (int i = 0; i < RACES; i++) {
    CHECK(tcc_op_wait(ops[i], -1) == TCC_OK, "race %d: %s", i, tcc_op_error(ops[i]));
    CHECK(runs_once_settled(&raced[i]) == 1 && atomic_load(&raced[i].finished_then) == 1,
          "race %d: the callback ran %d times, %d finished", i, atomic_load(&raced[i].runs),
          atomic_load(&raced[i].finished_then));
    tcc_op_release(ops[i]);
  }
  free(raced);
  free(ops);
}

/* More collectives in flight than the queue's ring holds (64): the rest
 * wait on its overflow list, and the ring takes ops again once the list
 * is empty. The waiter of op 120 runs the queue up to it (through the
 * list); ops after it run on the collective thread, which the waiter's
 * release wakes for them (op 199 is only polled); then each op's result. */
#define IN_FLIGHT 200
static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void test_many_in_flight(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  static int in[IN_FLIGHT], out[IN_FLIGHT];
  tcc_op_t *ops[IN_FLIGHT];
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < IN_FLIGHT; i++) {
      in[i] = me * 1000 + i + round;
      out[i] = -1;
      CHECK(tcc_allreduce(comm, host_buf(&in[i], 1, TCC_INT32), host_buf(&out[i], 1, TCC_INT32), TCC_SUM, NULL,
                          &ops[i]) == TCC_OK, "issue %d of %d in flight", i, IN_FLIGHT);
    }
    CHECK(tcc_op_wait(ops[120], -1) == TCC_OK, "op 120 of %d in flight: %s", IN_FLIGHT, tcc_op_error(ops[120]));
    const int64_t give_up = now_ms() + 30000;
    while (!tcc_op_test(ops[IN_FLIGHT - 1]) && now_ms() < give_up) usleep(100);
    CHECK(tcc_op_test(ops[IN_FLIGHT - 1]), "the last op in flight never ran on the collective thread");
    for (int i = IN_FLIGHT - 1; i >= 0; i--) {
      CHECK(tcc_op_wait(ops[i], -1) == TCC_OK, "op %d in flight: %s", i, tcc_op_error(ops[i]));
      const int want = 1000 * n * (n - 1) / 2 + n * (i + round);
      CHECK(out[i] == want, "op %d in flight gave %d, expected %d", i, out[i], want);
      tcc_op_release(ops[i]);
    }
  }
}

/* Two threads of every rank take turns issuing collectives (the same
 * order on every rank) and each waits for its own at once, so one thread
 * claims the queue while the other runs it, or submits into it. */
#define TURN_OPS 300
typedef struct turn_state {
  tcc_comm_t *comm;
  pthread_mutex_t lock;
  pthread_cond_t cv;
  int turn; /* index of the next op to issue */
  int bad;  /* ops whose result was wrong */
} turn_state_t;
typedef struct turn_arg {
  turn_state_t *st;
  int thread;
} turn_arg_t;

static void *turn_thread(void *p) {
  turn_arg_t *a = p;
  turn_state_t *st = a->st;
  const int n = tcc_comm_size(st->comm), me = tcc_comm_rank(st->comm);
  for (int i = a->thread; i < TURN_OPS; i += 2) {
    int in = me + i, out = -1;
    tcc_op_t *op;
    pthread_mutex_lock(&st->lock);
    while (st->turn != i) pthread_cond_wait(&st->cv, &st->lock);
    tcc_result_t r = tcc_allreduce(st->comm, host_buf(&in, 1, TCC_INT32), host_buf(&out, 1, TCC_INT32), TCC_SUM,
                                   NULL, &op);
    st->turn++;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->lock);
    if (r == TCC_OK) r = wait_op(r, op, NULL, 0);
    if (r != TCC_OK || out != n * (n - 1) / 2 + n * i) {
      fprintf(stderr, "rank %d thread %d op %d: %s, got %d\n", me, a->thread, i, tcc_result_string(r), out);
      pthread_mutex_lock(&st->lock);
      st->bad++;
      pthread_mutex_unlock(&st->lock);
    }
  }
  return NULL;
}

static void test_threads_take_turns(tcc_comm_t *comm) {
  turn_state_t st = {.comm = comm, .turn = 0, .bad = 0};
  pthread_mutex_init(&st.lock, NULL);
  pthread_cond_init(&st.cv, NULL);
  pthread_t th[2];
  turn_arg_t args[2] = {{&st, 0}, {&st, 1}};
  for (int t = 0; t < 2; t++) CHECK(pthread_create(&th[t], NULL, turn_thread, &args[t]) == 0, "thread");
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  CHECK(st.bad == 0, "%d of %d collectives issued by two threads in turn went wrong", st.bad, TURN_OPS);
  pthread_mutex_destroy(&st.lock);
  pthread_cond_destroy(&st.cv);
}

static void all_tests(tcc_comm_t *comm) {
  test_unwaited_p2p(comm); /* first: the p2p thread sleeps until a submit wakes it */
  test_unwaited_collective(comm);
  test_allreduce(comm);
  test_reduce_and_bcast(comm);
  test_gathers(comm);
  test_alltoall(comm);
  test_alltoall_small(comm);
  test_barrier_waits(comm);
  test_p2p(comm);
  test_p2p_many_small(comm);
  test_p2p_two_waiters(comm);
  test_p2p_threads_order(comm);
  test_any_source(comm);
  test_mismatch(comm);
  test_op_started(comm);
  test_callbacks(comm);
  test_many_in_flight(comm);
  test_threads_take_turns(comm);
  /* Again while the engine is busy (it polls rather than being woken). */
  test_unwaited_collective(comm);
  test_unwaited_p2p(comm);
  test_peer_leaves_early(comm); /* last: ranks 2.. leave here */
}

/* Ops with per-rank lists in a group wider than an op holds in itself
 * (TCC_OP_INLINE_RANKS, 8): the lists go to memory of their own. */
static void list_tests(tcc_comm_t *comm) {
  test_gathers(comm);
  test_alltoall(comm);
  test_alltoall_small(comm);
}

/* Rank 1 never joins the allreduce: rank 0 must time out naming it. */
static void timeout_test(tcc_comm_t *comm) {
  if (tcc_comm_rank(comm) == 1) {
    usleep(1500 * 1000);
    return;
  }
  float x = 1;
  tcc_op_t *op;
  char msg[512];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  tcc_result_t r = tcc_allreduce(comm, host_buf(&x, 1, TCC_FLOAT32), host_buf(&x, 1, TCC_FLOAT32), TCC_SUM,
                                 NULL, &op);
  r = wait_op(r, op, msg, sizeof msg);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  CHECK(r == TCC_ERR_TIMEOUT, "timeout gave %s", tcc_result_string(r));
  CHECK(strstr(msg, "allreduce") && strstr(msg, "rank(s) 1") && strstr(msg, "timeout-group"), "message: %s", msg);
  /* The message gives the op's own timeout (the group's 500 ms here). */
  CHECK(strstr(msg, "[op timeout 500 ms]"), "message without the op's timeout: %s", msg);
  CHECK(secs > 0.4 && secs < 5, "timed out after %.2f s", secs);
  CHECK(tcc_comm_status(comm) == TCC_ERR_TIMEOUT, "comm status after timeout");
}

int main(int argc, char **argv) {
  const char *transports[] = {"shm", "tcp"};
  alarm(600); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT"); /* the "auto" groups test the choice itself */
  int passed = 0, failed = 0;
  for (int t = 0; t < 2; t++) {
    if (argc > 1 && strcmp(argv[1], transports[t]) != 0) continue;
    for (int n = 1; n <= 4; n++) {
      int bad = run_group(n, transports[t], 60000, "test-group", all_tests);
      printf("%s %s n=%d\n", bad ? "FAIL" : "ok  ", transports[t], n);
      bad ? failed++ : passed++;
    }
    int bad = run_group(2, transports[t], 500, "timeout-group", timeout_test);
    printf("%s %s timeout\n", bad ? "FAIL" : "ok  ", transports[t]);
    bad ? failed++ : passed++;
    bad = run_group(9, transports[t], 60000, "wide-group", list_tests);
    printf("%s %s n=9 lists\n", bad ? "FAIL" : "ok  ", transports[t]);
    bad ? failed++ : passed++;
  }
  if (argc <= 1) {
    /* The transport follows the endpoints' host identity unless forced. */
    const char *specs[] = {"auto", "auto-hosts", "shm-hosts", "auto-shmdirs", "shm-shmdirs"};
    for (int i = 0; i < 5; i++) {
      rank_fn fn = strncmp(specs[i], "auto", 4) == 0 ? test_mismatch : NULL;
      int bad = run_group(3, specs[i], 60000, "choice-group", fn);
      printf("%s transport choice: %s\n", bad ? "FAIL" : "ok  ", specs[i]);
      bad ? failed++ : passed++;
    }
  }
  printf("test_comm: %d groups passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
