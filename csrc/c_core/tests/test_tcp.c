/*
 * test_tcp.c - the TCP transport on its own, without the engine.
 *
 * Each group forks N processes (N = 1..4) that open endpoints, swap blobs
 * through shared memory mapped before the fork, build a bare tcc_comm by
 * hand, connect with tcc__tcp_setup and run collectives with tcc__coll_run
 * and p2p functions directly. Results are compared with references
 * computed here from the same input formulas. Groups also cover a
 * mismatch (every rank fails alike, the next op works), a missing rank
 * (timeout naming it), abort, a peer that went away, stray connections
 * during setup and setups that cannot complete.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "transport/tcp/tcp.h"

#define MAXN 4
#define BIG ((3u << 20) + 5) /* elements: several pipeline segments per rank */

/* ---- a group of forked ranks ------------------------------------------ */

typedef struct shared {
  atomic_int arrived, generation; /* barrier */
  uint8_t blobs[MAXN][TCC_ENDPOINT_BLOB_SIZE];
} shared_t;

typedef struct rank_ctx {
  int rank, n;
  shared_t *sh;
  tcc_comm_t *comm;
  uint64_t seq;
} rank_ctx_t;

static void barrier(rank_ctx_t *t) {
  int gen = atomic_load(&t->sh->generation);
  if (atomic_fetch_add(&t->sh->arrived, 1) == t->n - 1) {
    atomic_store(&t->sh->arrived, 0);
    atomic_fetch_add(&t->sh->generation, 1);
    return;
  }
  while (atomic_load(&t->sh->generation) == gen) usleep(500);
}

static double now_s(void) { return (double)tcc__now_ns() / 1e9; }

/* Forks n ranks running fn; returns the number of ranks that failed. */
static int run_group(const char *name, int n, void (*fn)(rank_ctx_t *)) {
  shared_t *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                      -1, 0);
  if (sh == MAP_FAILED) return n;
  memset(sh, 0, sizeof(*sh));
  fflush(NULL);
  pid_t pids[MAXN];
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      alarm(120); /* a hang fails the test instead of stalling it */
      rank_ctx_t t = {.rank = r, .n = n, .sh = sh};
      fn(&t);
      fflush(NULL);
      exit(check_failures ? 1 : 0); /* exit, not _exit: LeakSanitizer checks each rank */
    }
  }
  int failed = 0;
  for (int r = 0; r < n; r++) {
    int status;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "%s (n=%d): rank %d failed (status 0x%x)\n", name, n, r, status);
      failed++;
    }
  }
  munmap(sh, sizeof(*sh));
  printf("%-28s n=%d %s\n", name, n, failed ? "FAILED" : "ok");
  return failed;
}

/* ---- endpoints and setup ---------------------------------------------- */

static tcc_endpoint_t *publish_endpoint(rank_ctx_t *t) {
  tcc_endpoint_t *ep = NULL;
  tcc_result_t r = tcc_endpoint_open(NULL, &ep, t->sh->blobs[t->rank]);
  CHECK(r == TCC_OK, "rank %d: tcc_endpoint_open: %s", t->rank, tcc_last_error());
  return ep;
}

static tcc_comm_t *new_comm(rank_ctx_t *t, int64_t timeout_ms) {
  tcc_comm_t *comm = calloc(1, sizeof(*comm));
  comm->rank = t->rank;
  comm->size = t->n;
  snprintf(comm->name, sizeof(comm->name), "test%d", t->n);
  atomic_store(&comm->timeout_ms, timeout_ms);
  return comm;
}

/* machines > 0: rank j's blob claims to come from machine j % machines
 * (its boot id), as ranks on other machines' kernels would. */
static tcc_result_t setup_on(rank_ctx_t *t, tcc_endpoint_t *ep, int64_t timeout_ms, int machines,
                             tcc_err_t *err) {
  tcc_blob_t blobs[MAXN];
  for (int j = 0; j < t->n; j++) {
    memcpy(&blobs[j], t->sh->blobs[j], sizeof(tcc_blob_t));
    if (machines > 0) snprintf(blobs[j].boot_id, sizeof blobs[j].boot_id, "machine-%d", j % machines);
  }
  t->comm = new_comm(t, timeout_ms);
  memset(err, 0, sizeof(*err));
  tcc_result_t r = tcc__tcp_setup(t->comm, ep, blobs, err);
  if (r == TCC_OK) r = tcc__coll_attach(t->comm, err); /* the algorithms' scratch, as tcc_comm_create has it */
  CHECK(ep->listen_fd == -1, "rank %d: setup left the listening socket open", t->rank);
  tcc_endpoint_close(ep);
  return r;
}

static tcc_result_t setup(rank_ctx_t *t, tcc_endpoint_t *ep, int64_t timeout_ms, tcc_err_t *err) {
  return setup_on(t, ep, timeout_ms, 0, err);
}

static void teardown(rank_ctx_t *t) {
  if (t->comm->ops) t->comm->ops->destroy(t->comm);
  CHECK(t->comm->transport_state == NULL, "destroy left state behind");
  tcc__coll_release(t->comm);
  free(t->comm);
  t->comm = NULL;
}

static tcc_result_t run(rank_ctx_t *t, tcc_coll_t *c, int64_t timeout_ms, tcc_err_t *err) {
  memset(err, 0, sizeof(*err));
  int64_t deadline = tcc__now_ns() + timeout_ms * 1000000;
  return tcc__coll_run(t->comm, c, t->seq++, deadline, err);
}

static void run_ok(rank_ctx_t *t, tcc_coll_t *c, const char *what) {
  tcc_err_t err;
  tcc_result_t r = run(t, c, 20000, &err);
  CHECK(r == TCC_OK, "rank %d: %s failed (%d): %s", t->rank, what, r, err.msg);
}

/* ---- inputs and references -------------------------------------------- */

/* Small half-integers: float sums are exact in any order. */
static float fval(int r, size_t i, int salt) {
  return (float)((int)((r * 131u + i * 7u + (unsigned)salt) % 17u) - 8) * 0.5f;
}
static int32_t ival(int r, size_t i, int salt) {
  return (int32_t)((r * 7919u + i * 13u + (unsigned)salt) % 2001u) - 1000;
}

static void fill(void *buf, tcc_dtype_t dt, int r, size_t off, size_t count, int salt) {
  for (size_t i = 0; i < count; i++) {
    if (dt == TCC_FLOAT32) ((float *)buf)[i] = fval(r, off + i, salt);
    else ((int32_t *)buf)[i] = ival(r, off + i, salt);
  }
}

/* Element i of the reduction over all n ranks, in rank order. */
static double reduced(tcc_dtype_t dt, tcc_redop_t op, int n, size_t i, int salt) {
  double acc = 0;
  for (int r = 0; r < n; r++) {
    double v = dt == TCC_FLOAT32 ? fval(r, i, salt) : ival(r, i, salt);
    if (r == 0) acc = v;
    else if (op == TCC_SUM) acc += v;
    else if (op == TCC_MAX) acc = v > acc ? v : acc;
    else acc = v < acc ? v : acc; /* TCC_MIN */
  }
  return acc;
}

static double elem(const void *buf, tcc_dtype_t dt, size_t i) {
  return dt == TCC_FLOAT32 ? ((const float *)buf)[i] : ((const int32_t *)buf)[i];
}

/* Checks count elements of got against want(i) for i = off.., reports the first miss. */
#define EXPECT_ELEMS(got, dt, count, off, want_expr, ...)                       \
  do {                                                                         \
    for (size_t i_ = 0; i_ < (count); i_++) {                                  \
      size_t i = (off) + i_;                                                   \
      double want_ = (want_expr), got_ = elem((got), (dt), i_);                \
      if (got_ != want_) {                                                     \
        CHECK(0, "element %zu: got %g want %g: " __VA_ARGS__);                 \
        break;                                                                 \
      }                                                                        \
    }                                                                          \
  } while (0)

/* ---- collectives ------------------------------------------------------ */

/* 20003: past one exchange's budget on every group size here, its chunks
 * (uneven on 2, 3 and 4 ranks) within a frame's payload: an all-reduce's
 * reduce-scatter then travels with the descriptors. */
static const size_t counts[] = {0, 1, 3, 1001, 20003, BIG};
#define NCOUNTS (sizeof(counts) / sizeof(counts[0]))

static void test_broadcast(rank_ctx_t *t) {
  for (size_t k = 0; k < NCOUNTS; k++)
    for (int root = 0; root < t->n; root++) {
      size_t count = counts[k];
      int32_t *buf = malloc(count * 4 + 4);
      fill(buf, TCC_INT32, t->rank, 0, count, root);
      tcc_coll_t c = {.kind = TCC_COLL_BROADCAST, .dtype = TCC_INT32, .root = root,
                      .count = count, .send = buf, .recv = buf};
      run_ok(t, &c, "broadcast");
      EXPECT_ELEMS(buf, TCC_INT32, count, 0, ival(root, i, root),
                   "rank %d broadcast root %d count %zu", i, got_, want_, t->rank, root, count);
      free(buf);
    }
}

/* mode 0: separate buffers, 1: in place, 2: recv overlaps send by one element */
static void test_allreduce(rank_ctx_t *t) {
  const tcc_dtype_t dts[] = {TCC_FLOAT32, TCC_INT32};
  const tcc_redop_t ops[][2] = {{TCC_SUM, TCC_MAX}, {TCC_SUM, TCC_MIN}};
  for (int d = 0; d < 2; d++)
    for (int o = 0; o < 2; o++)
      for (size_t k = 0; k < NCOUNTS; k++)
        for (int mode = 0; mode < 3; mode++) {
          size_t count = counts[k];
          if (count == BIG && (d || o)) continue; /* big only once per mode */
          tcc_dtype_t dt = dts[d];
          tcc_redop_t op = ops[d][o];
          int salt = (int)(k * 3 + (size_t)mode);
          uint8_t *mem = malloc((count + 1) * 4);
          uint8_t *send = mem, *recv = mode == 0 ? malloc(count * 4 + 4)
                                     : mode == 1 ? mem : mem + 4;
          fill(send, dt, t->rank, 0, count, salt);
          tcc_coll_t c = {.kind = TCC_COLL_ALLREDUCE, .dtype = dt, .redop = op,
                          .count = count, .send = send, .recv = recv};
          run_ok(t, &c, "allreduce");
          EXPECT_ELEMS(recv, dt, count, 0, reduced(dt, op, t->n, i, salt),
                       "rank %d allreduce dt %d op %d count %zu mode %d", i, got_, want_,
                       t->rank, dt, op, count, mode);
          if (mode == 0) free(recv);
          free(mem);
        }
}

static void test_reduce(rank_ctx_t *t) {
  const size_t cs[] = {0, 5, 1001, BIG};
  for (size_t k = 0; k < 4; k++)
    for (int root = 0; root < t->n; root++)
      for (int inplace = 0; inplace < 2; inplace++) {
        size_t count = cs[k];
        int salt = root + inplace;
        float *send = malloc(count * 4 + 4);
        float *recv = inplace ? send : t->rank == root ? malloc(count * 4 + 4) : NULL;
        fill(send, TCC_FLOAT32, t->rank, 0, count, salt);
        tcc_coll_t c = {.kind = TCC_COLL_REDUCE, .dtype = TCC_FLOAT32, .redop = TCC_SUM,
                        .root = root, .count = count, .send = send, .recv = recv};
        run_ok(t, &c, "reduce");
        if (t->rank == root)
          EXPECT_ELEMS(recv, TCC_FLOAT32, count, 0,
                       reduced(TCC_FLOAT32, TCC_SUM, t->n, i, salt),
                       "rank %d reduce root %d count %zu", i, got_, want_, t->rank, root,
                       count);
        else if (!inplace) /* a non-root's input is left alone */
          EXPECT_ELEMS(send, TCC_FLOAT32, count, 0, fval(t->rank, i, salt),
                       "rank %d reduce input changed", i, got_, want_, t->rank);
        if (recv != send) free(recv);
        free(send);
      }
}

/* One flat buffer of n slices, as torch's *_into_tensor variants use. */
static void test_allgather_gather(rank_ctx_t *t) {
  const size_t cs[] = {0, 1, 7, 1001, BIG / 4};
  for (int gather = 0; gather < 2; gather++)
    for (size_t k = 0; k < 5; k++)
      for (int root = 0; root < (gather ? t->n : 1); root++)
        for (int inplace = 0; inplace < 2; inplace++) {
          size_t count = cs[k];
          int salt = (int)k + root;
          bool receives = !gather || t->rank == root;
          int32_t *flat = malloc((size_t)t->n * count * 4 + 4);
          int32_t *own = malloc(count * 4 + 4);
          void *recvs[MAXN];
          for (int j = 0; j < t->n; j++) recvs[j] = flat + (size_t)j * count;
          int32_t *send = inplace && receives ? recvs[t->rank] : own;
          fill(send, TCC_INT32, t->rank, 0, count, salt);
          tcc_coll_t c = {.kind = gather ? TCC_COLL_GATHER : TCC_COLL_ALLGATHER,
                          .dtype = TCC_INT32, .root = root, .count = count, .send = send,
                          .recvs = receives ? recvs : NULL};
          run_ok(t, &c, gather ? "gather" : "allgather");
          for (int j = 0; j < t->n && receives; j++)
            EXPECT_ELEMS(recvs[j], TCC_INT32, count, 0, ival(j, i, salt),
                         "rank %d %s from %d count %zu inplace %d", i, got_, want_, t->rank,
                         gather ? "gather" : "allgather", j, count, inplace);
          free(flat);
          free(own);
        }
}

static void test_scatter(rank_ctx_t *t) {
  const size_t cs[] = {0, 1, 1001, BIG / 4};
  for (size_t k = 0; k < 4; k++)
    for (int root = 0; root < t->n; root++) {
      size_t count = cs[k];
      float *flat = malloc((size_t)t->n * count * 4 + 4), *recv = malloc(count * 4 + 4);
      void *sends[MAXN];
      for (int j = 0; j < t->n; j++) {
        sends[j] = flat + (size_t)j * count;
        fill(sends[j], TCC_FLOAT32, j + 10 * t->rank, 0, count, root);
      }
      tcc_coll_t c = {.kind = TCC_COLL_SCATTER, .dtype = TCC_FLOAT32, .root = root,
                      .count = count, .sends = t->rank == root ? sends : NULL, .recv = recv};
      run_ok(t, &c, "scatter");
      EXPECT_ELEMS(recv, TCC_FLOAT32, count, 0, fval(t->rank + 10 * root, i, root),
                   "rank %d scatter root %d count %zu", i, got_, want_, t->rank, root, count);
      free(flat);
      free(recv);
    }
}

/* Contribution of rank r to slice j is elements [j*count, (j+1)*count) of
 * its input formula, so the reference is reduced() at the global index. */
static void test_reduce_scatter(rank_ctx_t *t) {
  const size_t cs[] = {0, 1, 1001, BIG / 2};
  for (size_t k = 0; k < 4; k++)
    for (int inplace = 0; inplace < 3; inplace++) { /* 2: recv is another rank's slice */
      size_t count = cs[k];
      int salt = (int)k;
      int32_t *flat = malloc((size_t)t->n * count * 4 + 4), *own = malloc(count * 4 + 4);
      void *sends[MAXN];
      for (int j = 0; j < t->n; j++) sends[j] = flat + (size_t)j * count;
      fill(flat, TCC_INT32, t->rank, 0, (size_t)t->n * count, salt);
      void *recv = inplace == 1 ? sends[t->rank]
                   : inplace == 2 ? sends[(t->rank + 1) % t->n] : own;
      tcc_coll_t c = {.kind = TCC_COLL_REDUCE_SCATTER, .dtype = TCC_INT32, .redop = TCC_SUM,
                      .count = count, .sends = sends, .recv = recv};
      run_ok(t, &c, "reduce_scatter");
      EXPECT_ELEMS(recv, TCC_INT32, count, (size_t)t->rank * count,
                   reduced(TCC_INT32, TCC_SUM, t->n, i, salt),
                   "rank %d reduce_scatter count %zu inplace %d", i, got_, want_, t->rank,
                   count, inplace);
      free(flat);
      free(own);
    }
}

/* Uneven counts (zeros included) that both ends derive alike. */
static size_t a2a_count(int from, int to, int salt, size_t scale) {
  return (size_t)((from * 3 + to * 5 + salt) % 4) * scale;
}
static int32_t a2a_val(int from, int to, size_t i) {
  return (int32_t)(from * 1000000 + to * 100000 + (int)(i % 99991));
}

static void test_alltoall(rank_ctx_t *t) {
  const size_t scales[] = {1, 7, 100003};
  for (int s = 0; s < 3; s++)
    for (int salt = 0; salt < 2; salt++) {
      void *sends[MAXN], *recvs[MAXN];
      size_t sc[MAXN], rc[MAXN];
      for (int j = 0; j < t->n; j++) {
        sc[j] = a2a_count(t->rank, j, salt, scales[s]);
        rc[j] = a2a_count(j, t->rank, salt, scales[s]);
        sends[j] = sc[j] ? malloc(sc[j] * 4) : NULL;
        recvs[j] = rc[j] ? malloc(rc[j] * 4) : NULL;
        for (size_t i = 0; i < sc[j]; i++) ((int32_t *)sends[j])[i] = a2a_val(t->rank, j, i);
      }
      tcc_coll_t c = {.kind = TCC_COLL_ALLTOALL, .dtype = TCC_INT32, .sends = sends,
                      .recvs = recvs, .send_counts = sc, .recv_counts = rc};
      run_ok(t, &c, "alltoall");
      for (int j = 0; j < t->n; j++) {
        EXPECT_ELEMS(recvs[j], TCC_INT32, rc[j], 0, a2a_val(j, t->rank, i),
                     "rank %d alltoall from %d scale %zu", i, got_, want_, t->rank, j,
                     scales[s]);
        free(sends[j]);
        free(recvs[j]);
      }
    }
}

/* The same memory as input and output: inputs must be copied first. */
static void test_alltoall_inplace(rank_ctx_t *t) {
  const size_t each = 1001;
  int32_t *flat = malloc((size_t)t->n * each * 4);
  void *bufs[MAXN];
  size_t cnt[MAXN];
  for (int j = 0; j < t->n; j++) {
    bufs[j] = flat + (size_t)j * each;
    cnt[j] = each;
    for (size_t i = 0; i < each; i++) ((int32_t *)bufs[j])[i] = a2a_val(t->rank, j, i);
  }
  tcc_coll_t c = {.kind = TCC_COLL_ALLTOALL, .dtype = TCC_INT32, .sends = bufs,
                  .recvs = bufs, .send_counts = cnt, .recv_counts = cnt};
  run_ok(t, &c, "alltoall in place");
  for (int j = 0; j < t->n; j++)
    EXPECT_ELEMS(bufs[j], TCC_INT32, each, 0, a2a_val(j, t->rank, i),
                 "rank %d in-place alltoall from %d", i, got_, want_, t->rank, j);
  free(flat);
}

/* Blocks in the descriptor frames (up to 64 KiB / (n - 1)) and blocks in
 * the exchange after it, in one op: 3 (frames), 2000 (frames up to 8
 * ranks) or 30000 elements (never). */
static size_t mixed_count(int a, int b) {
  static const size_t sizes[] = {3, 2000, 30000};
  return sizes[(a + b) % 3];
}

static void test_alltoall_mixed(rank_ctx_t *t) {
  void *sends[MAXN], *recvs[MAXN];
  size_t sc[MAXN], rc[MAXN];
  /* counts from a to b: asymmetric (b + 2a), so each pair's two ways differ */
  for (int j = 0; j < t->n; j++) {
    sc[j] = mixed_count(j, 2 * t->rank);
    rc[j] = mixed_count(t->rank, 2 * j);
    sends[j] = malloc(sc[j] * 4);
    recvs[j] = malloc(rc[j] * 4);
    for (size_t i = 0; i < sc[j]; i++) ((int32_t *)sends[j])[i] = a2a_val(t->rank, j, i);
  }
  tcc_coll_t c = {.kind = TCC_COLL_ALLTOALL, .dtype = TCC_INT32, .sends = sends,
                  .recvs = recvs, .send_counts = sc, .recv_counts = rc};
  run_ok(t, &c, "alltoall of mixed blocks");
  for (int j = 0; j < t->n; j++) {
    EXPECT_ELEMS(recvs[j], TCC_INT32, rc[j], 0, a2a_val(j, t->rank, i),
                 "rank %d mixed alltoall from %d", i, got_, want_, t->rank, j);
    free(sends[j]);
    free(recvs[j]);
  }

  /* in place: block j holds what goes to j and then what came from j, so
   * the counts are symmetric; small blocks land before large ones move */
  size_t cnt[MAXN], total = 0;
  for (int j = 0; j < t->n; j++) total += cnt[j] = mixed_count(t->rank, j);
  int32_t *flat = malloc(total * 4), *at = flat;
  for (int j = 0; j < t->n; j++) {
    sends[j] = at;
    for (size_t i = 0; i < cnt[j]; i++) at[i] = a2a_val(t->rank, j, i);
    at += cnt[j];
  }
  c = (tcc_coll_t){.kind = TCC_COLL_ALLTOALL, .dtype = TCC_INT32, .sends = sends,
                   .recvs = sends, .send_counts = cnt, .recv_counts = cnt};
  run_ok(t, &c, "alltoall of mixed blocks in place");
  for (int j = 0; j < t->n; j++)
    EXPECT_ELEMS(sends[j], TCC_INT32, cnt[j], 0, a2a_val(j, t->rank, i),
                 "rank %d mixed in-place alltoall from %d", i, got_, want_, t->rank, j);
  free(flat);
}

static void test_collectives(rank_ctx_t *t) {
  tcc_coll_t barrier_op = {.kind = TCC_COLL_BARRIER};
  run_ok(t, &barrier_op, "barrier");
  test_broadcast(t);
  test_allreduce(t);
  test_reduce(t);
  test_allgather_gather(t);
  test_scatter(t);
  test_reduce_scatter(t);
  test_alltoall(t);
  test_alltoall_inplace(t);
  test_alltoall_mixed(t);
  run_ok(t, &barrier_op, "barrier");
}

/* ---- disagreement, absence, abort, failure ---------------------------- */

static void expect_code(rank_ctx_t *t, tcc_coll_t *c, tcc_result_t want, const char *what) {
  tcc_err_t err;
  tcc_result_t r = run(t, c, 10000, &err);
  CHECK(r == want, "rank %d: %s gave %d, want %d: %s", t->rank, what, r, want, err.msg);
}

/* Small ops send their data with their descriptor (one exchange), mid-sized
 * all-reduces their reduce-scatter, others everything after it: ranks on
 * different paths must still all fail, take exactly what was sent, and
 * leave every output alone. */
static void test_mismatch_paths(rank_ctx_t *t) {
  const size_t big = 100000; /* chunks past a frame's payload on any group */
  const size_t mid = 20003;  /* past one exchange's budget, chunks within a frame */
  float *in = malloc(big * sizeof(float)), *out = malloc(big * sizeof(float));
  fill(in, TCC_FLOAT32, t->rank, 0, big, 1);
  const bool last = t->rank == t->n - 1;
  const size_t others_last[][2] = {{8, big}, {8, mid}, {mid, big}, {mid, mid + 1}};
  for (int k = 0; k < 4; k++) {
    for (size_t i = 0; i < big; i++) out[i] = -1.0f;
    const size_t others = others_last[k][0];
    tcc_coll_t c = {.kind = TCC_COLL_ALLREDUCE, .dtype = TCC_FLOAT32, .redop = TCC_SUM,
                    .count = last ? others_last[k][1] : others, .send = in, .recv = out};
    char what[96];
    snprintf(what, sizeof what, "allreduce of %zu elements against one of %zu", others, others_last[k][1]);
    expect_code(t, &c, TCC_ERR_MISMATCH, what);
    size_t untouched = 0;
    for (size_t i = 0; i < big; i++) untouched += out[i] == -1.0f;
    CHECK(untouched == big, "rank %d: a mismatched %s wrote %zu outputs", t->rank, what, big - untouched);
    c.count = others;
    run_ok(t, &c, "allreduce after a mismatch between paths");
    EXPECT_ELEMS(out, TCC_FLOAT32, others, 0, reduced(TCC_FLOAT32, TCC_SUM, t->n, i, 1),
                 "rank %d allreduce of %zu after a mismatch between paths (case %d)", i, got_, want_, t->rank,
                 others, k);
  }
  size_t untouched;

  /* a frame with a payload against one with an all-to-all's counts */
  void *outs[MAXN], *ins[MAXN];
  size_t counts[MAXN];
  for (int j = 0; j < t->n; j++) {
    outs[j] = out + 16 * j;
    ins[j] = in + 16 * j;
    counts[j] = 4;
  }
  tcc_coll_t ag = {.kind = TCC_COLL_ALLGATHER, .dtype = TCC_FLOAT32, .count = 4, .send = in, .recvs = outs};
  tcc_coll_t a2a = {.kind = TCC_COLL_ALLTOALL, .dtype = TCC_FLOAT32, .sends = ins, .recvs = outs,
                    .send_counts = counts, .recv_counts = counts};
  for (size_t i = 0; i < 16 * MAXN; i++) out[i] = -1.0f;
  expect_code(t, t->rank == 0 ? &a2a : &ag, TCC_ERR_MISMATCH, "alltoall against allgather");
  untouched = 0;
  for (size_t i = 0; i < 16 * MAXN; i++) untouched += out[i] == -1.0f;
  CHECK(untouched == 16 * MAXN, "rank %d: a mismatched allgather wrote outputs", t->rank);
  run_ok(t, &ag, "allgather after a mismatch");
  for (int j = 0; j < t->n; j++)
    EXPECT_ELEMS(outs[j], TCC_FLOAT32, 4, 0, fval(j, i, 1), "rank %d allgather from %d after a mismatch", i, got_,
                 want_, t->rank, j);

  /* An all-to-all block the last rank sends to rank 0 against what rank 0
   * expects: in its frame against after it, both ways, and two lengths in
   * frames. Every other block agrees and is small, so it travels in the
   * frames: still no output may be written. */
  const size_t sent_expected[][2] = {{4, big / 4}, {big / 4, 4}, {4, 5}};
  const int last_rank = t->n - 1;
  for (int k = 0; k < 3; k++) {
    size_t sc[MAXN], rc[MAXN];
    for (int j = 0; j < t->n; j++) {
      sc[j] = rc[j] = 4;
      ins[j] = in + (size_t)j * (big / 4);
      outs[j] = out + (size_t)j * (big / 4);
    }
    if (t->rank == last_rank) sc[0] = sent_expected[k][0];
    if (t->rank == 0) rc[last_rank] = sent_expected[k][1];
    a2a = (tcc_coll_t){.kind = TCC_COLL_ALLTOALL, .dtype = TCC_FLOAT32, .sends = ins, .recvs = outs,
                       .send_counts = sc, .recv_counts = rc};
    for (size_t i = 0; i < big; i++) out[i] = -1.0f;
    expect_code(t, &a2a, TCC_ERR_MISMATCH, "alltoall whose block sizes differ across the frame budget");
    untouched = 0;
    for (size_t i = 0; i < big; i++) untouched += out[i] == -1.0f;
    CHECK(untouched == big, "rank %d: a mismatched alltoall (case %d) wrote %zu outputs", t->rank, k,
          big - untouched);
    sc[0] = rc[last_rank] = 4;
    run_ok(t, &a2a, "alltoall after a mismatch across the frame budget");
    for (int j = 0; j < t->n; j++)
      EXPECT_ELEMS(outs[j], TCC_FLOAT32, 4, 0, fval(j, i + (size_t)t->rank * (big / 4), 1),
                   "rank %d alltoall from %d after a mismatch", i, got_, want_, t->rank, j);
  }
  free(in);
  free(out);
}

/* Every rank must see the mismatch, and the next op must still work. */
static void test_mismatch(rank_ctx_t *t) {
  float a[8], b[8];
  fill(a, TCC_FLOAT32, t->rank, 0, 8, 1);
  tcc_coll_t c = {.kind = TCC_COLL_ALLREDUCE, .dtype = TCC_FLOAT32, .redop = TCC_SUM,
                  .count = t->rank == t->n - 1 ? 8 : 7, .send = a, .recv = b};
  expect_code(t, &c, TCC_ERR_MISMATCH, "allreduce with one rank's count off");
  c.count = 8;
  run_ok(t, &c, "allreduce after a mismatch");
  EXPECT_ELEMS(b, TCC_FLOAT32, 8, 0, reduced(TCC_FLOAT32, TCC_SUM, t->n, i, 1),
               "rank %d allreduce after mismatch", i, got_, want_, t->rank);

  /* different kinds, and descriptors of different lengths */
  size_t zeros[MAXN] = {0};
  void *none[MAXN] = {0};
  tcc_coll_t a2a = {.kind = TCC_COLL_ALLTOALL, .dtype = TCC_INT32, .sends = none,
                    .recvs = none, .send_counts = zeros, .recv_counts = zeros};
  tcc_coll_t bar = {.kind = TCC_COLL_BARRIER};
  expect_code(t, t->rank == 0 ? &a2a : &bar, TCC_ERR_MISMATCH, "alltoall vs barrier");
  run_ok(t, &bar, "barrier after a mismatch");

  /* all-to-all counts that do not pair up */
  size_t sc[MAXN], rc[MAXN];
  int32_t *sends[MAXN], *recvs[MAXN];
  for (int j = 0; j < t->n; j++) {
    sc[j] = rc[j] = 2;
    sends[j] = malloc(12);
    recvs[j] = malloc(12);
  }
  if (t->rank == 0) rc[t->n - 1] = 3;
  a2a = (tcc_coll_t){.kind = TCC_COLL_ALLTOALL, .dtype = TCC_INT32, .sends = (void **)sends,
                     .recvs = (void **)recvs, .send_counts = sc, .recv_counts = rc};
  expect_code(t, &a2a, TCC_ERR_MISMATCH, "alltoall with unpaired counts");
  rc[t->n - 1] = 2;
  run_ok(t, &a2a, "alltoall after a mismatch");
  for (int j = 0; j < t->n; j++) {
    free(sends[j]);
    free(recvs[j]);
  }

  /* Past the one-exchange budget, so every rank waits in the op (a small
   * one runs one-sided: test_one_sided.c). */
  static float big[20000];
  tcc_coll_t bc = {.kind = TCC_COLL_BROADCAST, .dtype = TCC_FLOAT32, .count = 20000,
                   .root = t->rank == 1 ? 1 : 0, .send = big, .recv = big};
  expect_code(t, &bc, TCC_ERR_MISMATCH, "broadcast with different roots");
  run_ok(t, &bar, "barrier after a mismatch");
  test_mismatch_paths(t);
}

static void *abort_later(void *arg) {
  usleep(150000);
  atomic_store(&((tcc_comm_t *)arg)->aborted, 1);
  return NULL;
}

/* The last rank stays away: the others time out naming it, then abort
 * works while waiting, then the last rank leaves and the others see it
 * go. The streams are out of step afterwards; the group ends here. */
static void test_failures(rank_ctx_t *t) {
  int last = t->n - 1;
  float buf[4] = {0};
  tcc_coll_t c = {.kind = TCC_COLL_ALLREDUCE, .dtype = TCC_FLOAT32, .redop = TCC_SUM,
                  .count = 4, .send = buf, .recv = buf};
  tcc_err_t err;
  char want[32];
  snprintf(want, sizeof(want), "%d", last);
  if (t->rank != last) {
    double t0 = now_s();
    tcc_result_t r = run(t, &c, 400, &err);
    double took = now_s() - t0;
    CHECK(r == TCC_ERR_TIMEOUT, "rank %d: got %d: %s", t->rank, r, err.msg);
    CHECK(took >= 0.35 && took < 3.0, "rank %d: timeout took %.3f s", t->rank, took);
    const char *waiting = strstr(err.msg, "waiting for rank(s) ");
    CHECK(waiting && strstr(waiting, want) && strstr(err.msg, "allreduce") &&
              strstr(err.msg, "test"),
          "rank %d: timeout message does not name the op, group and rank %s: %s", t->rank,
          want, err.msg);

    pthread_t th;
    pthread_create(&th, NULL, abort_later, t->comm);
    t0 = now_s();
    r = run(t, &c, 10000, &err);
    took = now_s() - t0;
    pthread_join(th, NULL);
    CHECK(r == TCC_ERR_ABORTED, "rank %d: got %d: %s", t->rank, r, err.msg);
    CHECK(took < 1.5, "rank %d: abort noticed after %.3f s", t->rank, took);
    r = run(t, &c, 10000, &err);
    CHECK(r == TCC_ERR_ABORTED, "rank %d: op on an aborted comm gave %d", t->rank, r);
    atomic_store(&t->comm->aborted, 0);
  }
  barrier(t);
  if (t->rank == last) teardown(t);
  barrier(t);
  if (t->rank != last) {
    tcc_result_t r = run(t, &c, 5000, &err);
    snprintf(want, sizeof(want), "rank %d", last);
    CHECK(r == TCC_ERR_REMOTE, "rank %d: got %d: %s", t->rank, r, err.msg);
    CHECK(strstr(err.msg, want), "rank %d: message does not name %s: %s", t->rank, want,
          err.msg);
  }
}

/* ---- point to point --------------------------------------------------- */

static uint8_t p2p_byte(int from, int to, size_t off) {
  return (uint8_t)(from * 31 + to * 17 + off * 13 + off / 251);
}
static size_t p2p_len(int from) { return (3u << 20) + (size_t)from * 7; }

/* Every rank streams a few MiB to every other at the same time. */
static void test_p2p(rank_ctx_t *t) {
  tcc_comm_t *comm = t->comm;
  const tcc_transport_ops_t *ops = comm->ops;
  uint8_t *out[MAXN], *in[MAXN];
  size_t sent[MAXN] = {0}, got[MAXN] = {0};
  bool want_write[MAXN] = {0};
  for (int j = 0; j < t->n; j++) {
    out[j] = malloc(p2p_len(t->rank));
    in[j] = malloc(p2p_len(j));
    for (size_t i = 0; i < p2p_len(t->rank); i++) out[j][i] = p2p_byte(t->rank, j, i);
  }
  double deadline = now_s() + 30;
  bool done = false;
  tcc_err_t err = {0};
  while (!done && now_s() < deadline) {
    done = true;
    for (int j = 0; j < t->n; j++) {
      if (j == t->rank) continue;
      ssize_t k;
      while (sent[j] < p2p_len(t->rank) &&
             (k = ops->p2p_write(comm, j, &(struct iovec){out[j] + sent[j], p2p_len(t->rank) - sent[j]}, 1, &err)) > 0)
        sent[j] += (size_t)k;
      while (got[j] < p2p_len(j) &&
             (k = ops->p2p_read(comm, j, in[j] + got[j], p2p_len(j) - got[j], &err)) > 0)
        got[j] += (size_t)k;
      CHECK(err.code == TCC_OK, "rank %d: p2p with %d: %s", t->rank, j, err.msg);
      if (err.code) return;
      want_write[j] = sent[j] < p2p_len(t->rank);
      if (want_write[j] || got[j] < p2p_len(j)) done = false;
    }
    if (!done) ops->p2p_wait(comm, want_write, 50000000);
  }
  CHECK(done, "rank %d: p2p streams did not finish", t->rank);
  for (int j = 0; j < t->n; j++) {
    if (j != t->rank)
      for (size_t i = 0; i < p2p_len(j); i++)
        if (in[j][i] != p2p_byte(j, t->rank, i)) {
          CHECK(0, "rank %d: p2p byte %zu from %d is wrong", t->rank, i, j);
          break;
        }
    free(out[j]);
    free(in[j]);
  }
  /* nothing to do: the wait lasts its full time, unless notified */
  barrier(t);
  double t0 = now_s();
  ops->p2p_wait(comm, want_write, 60000000);
  double took = now_s() - t0;
  CHECK(took > 0.04 && took < 1.0, "rank %d: idle p2p_wait took %.3f s", t->rank, took);
  ops->p2p_notify(comm);
  t0 = now_s();
  ops->p2p_wait(comm, want_write, 5000000000LL);
  took = now_s() - t0;
  CHECK(took < 0.5, "rank %d: notified p2p_wait took %.3f s", t->rank, took);
  barrier(t);
}

/* ---- setup ------------------------------------------------------------ */

static int connect_to(const tcc_blob_t *b) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(b->port),
                           .sin_addr.s_addr = b->ipv4};
  if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) return fd;
  CHECK(0, "stray connect: %s", strerror(errno));
  if (fd >= 0) close(fd);
  return -1;
}

/* Connections to rank 0's port made before anyone connects: garbage, a
 * well-formed hello with a wrong token claiming rank 1's channel, a
 * silent one and one closed at once. None may disturb the setup. */
static int make_strays(rank_ctx_t *t, int fds[4]) {
  const tcc_blob_t *b = (const tcc_blob_t *)t->sh->blobs[0];
  char garbage[64];
  memset(garbage, 0x5a, sizeof(garbage));
  tcp_hello_t fake = {.magic = TCP_HELLO_MAGIC, .rank = 1, .chan = TCP_CHAN_COLL,
                      .size = (uint32_t)t->n};
  memset(fake.token, 0x11, sizeof(fake.token));
  for (int i = 0; i < 4; i++) fds[i] = connect_to(b);
  if (fds[0] >= 0) CHECK(write(fds[0], garbage, sizeof(garbage)) == sizeof(garbage), "write");
  if (fds[1] >= 0) CHECK(write(fds[1], &fake, sizeof(fake)) == sizeof(fake), "write");
  if (fds[3] >= 0) close(fds[3]);
  fds[3] = -1;
  return 4;
}

static void full_group(rank_ctx_t *t) {
  tcc_endpoint_t *ep = publish_endpoint(t);
  if (!ep) return;
  int strays[4] = {-1, -1, -1, -1};
  barrier(t);
  if (t->rank == 0 && t->n > 1) make_strays(t, strays);
  barrier(t);
  tcc_err_t err;
  tcc_result_t r = setup(t, ep, 10000, &err);
  CHECK(r == TCC_OK, "rank %d: setup: %s", t->rank, err.msg);
  for (int i = 0; i < 4; i++)
    if (strays[i] >= 0) close(strays[i]);
  if (r != TCC_OK) return;
  CHECK(t->comm->ops && !strcmp(t->comm->ops->name, "tcp"), "ops not set");
  test_collectives(t);
  test_p2p(t);
  if (t->n > 1) {
    test_mismatch(t);
    test_failures(t);
  } else {
    atomic_store(&t->comm->aborted, 1);
    tcc_coll_t bar = {.kind = TCC_COLL_BARRIER};
    expect_code(t, &bar, TCC_ERR_ABORTED, "barrier on an aborted comm");
  }
  if (t->comm) teardown(t);
}

/* Waits poll without sleeping for a while only where the ranks on this
 * rank's machine (boot id) have a CPU each (core/cpu_share.h); the
 * collectives are right either way. */
static int machines_of_group;

static void machines_group(rank_ctx_t *t) {
  tcc_endpoint_t *ep = publish_endpoint(t);
  if (!ep) return;
  barrier(t);
  tcc_err_t err;
  const int machines = machines_of_group;
  tcc_result_t r = setup_on(t, ep, 10000, machines, &err);
  CHECK(r == TCC_OK, "rank %d: setup: %s", t->rank, err.msg);
  if (r != TCC_OK) return;
  int mates = 0;
  for (int q = 0; q < t->n; q++) mates += q % machines == t->rank % machines;
  cpu_set_t allowed;
  const int cpus = sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : 0;
  CHECK(t->comm->cpu_share.spin_while_away == (cpus > 0 && mates <= cpus),
        "rank %d: %d rank(s) on its machine, %d CPU(s): spin_while_away %d", t->rank, mates, cpus,
        t->comm->cpu_share.spin_while_away);
  /* Polls before a yield follow the ranks of its machine, not the group's size. */
  const int spins = mates <= cpus ? TCC_SPINS_OWN_CPU : TCC_SPINS_SHARED;
  CHECK(t->comm->cpu_share.spins == spins, "rank %d: %d rank(s) on its machine, %d CPU(s): %d polls, want %d",
        t->rank, mates, cpus, t->comm->cpu_share.spins, spins);
  test_allreduce(t);
  test_reduce_scatter(t);
  test_alltoall(t);
  teardown(t);
}

/* ---- the collective streams' read-ahead (tcp_streams.c) -------------- */

static uint8_t stream_byte(size_t off) { return (uint8_t)(off * 7 + off / 4093); }

/* How rank 1 cuts the stream into sends, and rank 0 into receives: sizes
 * on both sides of the read-ahead's 4 KiB, cut differently, so receives
 * start and end inside what was read ahead, and take it with bytes still
 * in the socket. */
static const size_t send_cuts[] = {40, 2048, 1, 4096, 4095, 70000, 3, 4097, 40, 100, 200000, 12};
static const size_t recv_cuts[] = {16, 24, 1, 4000, 2047, 5000, 4096, 1, 65536, 300, 4097, 7, 90000};
#define STREAM_BYTES (40 + 2048 + 1 + 4096 + 4095 + 70000 + 3 + 4097 + 40 + 100 + 200000 + 12)

/* Receives exactly len bytes from peer into dst (false: failed, reported). */
static bool stream_take(rank_ctx_t *t, int peer, uint8_t *dst, size_t len) {
  const tcc__stream_ops_t *io = t->comm->ops->streams;
  while (len > 0) {
    short ev = POLLIN, rev = 0;
    int rc = io->poll(t->comm, 1, &peer, &ev, &rev, 20000);
    CHECK(rc == 1 && (rev & POLLIN), "rank %d: poll for bytes from %d: rc %d revents 0x%x", t->rank, peer, rc, rev);
    if (rc != 1) return false;
    ssize_t k = io->recv(t->comm, peer, dst, len);
    if (k < 0 && errno == EAGAIN) continue;
    CHECK(k > 0, "rank %d: recv from %d: %zd (%s)", t->rank, peer, k, strerror(errno));
    if (k <= 0) return false;
    dst += k;
    len -= (size_t)k;
  }
  return true;
}

static void stream_give(rank_ctx_t *t, int peer, const uint8_t *src, size_t len) {
  const tcc__stream_ops_t *io = t->comm->ops->streams;
  while (len > 0) {
    short ev = POLLOUT, rev = 0;
    io->poll(t->comm, 1, &peer, &ev, &rev, 1000);
    ssize_t k = io->send(t->comm, peer, src, len);
    if (k < 0 && errno == EAGAIN) continue;
    CHECK(k > 0, "rank %d: send to %d: %s", t->rank, peer, strerror(errno));
    if (k <= 0) return;
    src += k;
    len -= (size_t)k;
  }
}

/* Rank 1 sends a known byte stream in pieces, now and then pausing so a
 * piece arrives alone; rank 0 takes it in other pieces and checks every
 * byte; none may be lost, repeated or reordered by what was read ahead.
 * Then: bytes read ahead make the stream readable at once, none left
 * means not readable, and the end of the stream shows only once the bytes
 * before it are taken. */
static void streams_group(rank_ctx_t *t) {
  tcc_endpoint_t *ep = publish_endpoint(t);
  if (!ep) return;
  barrier(t);
  tcc_err_t err;
  tcc_result_t r = setup(t, ep, 10000, &err);
  CHECK(r == TCC_OK, "rank %d: setup: %s", t->rank, err.msg);
  if (r != TCC_OK) return;
  const tcc__stream_ops_t *io = t->comm->ops->streams;
  const int peer = 1 - t->rank;
  uint8_t *bytes = malloc(STREAM_BYTES);
  if (t->rank == 1) {
    for (size_t i = 0; i < STREAM_BYTES; i++) bytes[i] = stream_byte(i);
    size_t at = 0;
    for (size_t c = 0; c < sizeof send_cuts / sizeof *send_cuts; c++) {
      stream_give(t, peer, bytes + at, send_cuts[c]);
      at += send_cuts[c];
      if (c % 3 == 2) usleep(2000);
    }
    CHECK(at == STREAM_BYTES, "the cuts add up");
    barrier(t);
    uint8_t more[100];
    for (size_t i = 0; i < sizeof more; i++) more[i] = (uint8_t)(i ^ 0x5a);
    stream_give(t, peer, more, sizeof more);
    barrier(t); /* rank 0 has taken them: nothing more comes until the next barrier */
    barrier(t);
    stream_give(t, peer, more, 50); /* and then the end of the stream */
    shutdown(((tcp_state_t *)t->comm->transport_state)->coll_fd[peer], SHUT_WR);
  } else {
    memset(bytes, 0, STREAM_BYTES);
    size_t at = 0;
    for (size_t c = 0; at < STREAM_BYTES; c = (c + 1) % (sizeof recv_cuts / sizeof *recv_cuts)) {
      size_t len = recv_cuts[c] < STREAM_BYTES - at ? recv_cuts[c] : STREAM_BYTES - at;
      if (!stream_take(t, peer, bytes + at, len)) break;
      at += len;
    }
    for (size_t i = 0; i < STREAM_BYTES; i++)
      if (bytes[i] != stream_byte(i)) {
        CHECK(0, "rank 0: stream byte %zu is %u, want %u", i, bytes[i], stream_byte(i));
        break;
      }
    barrier(t);
    uint8_t more[100];
    CHECK(stream_take(t, peer, more, 10), "the first 10 bytes after the barrier");
    /* The other 90 sit read ahead, the socket empty, and the sender waits
     * at the barrier: poll must say they are there without waiting (it
     * would time out after 20 s and fail). */
    CHECK(stream_take(t, peer, more + 10, 90), "the other 90 bytes");
    for (size_t i = 0; i < sizeof more; i++)
      if (more[i] != (uint8_t)(i ^ 0x5a)) {
        CHECK(0, "rank 0: byte %zu after the barrier is wrong", i);
        break;
      }
    barrier(t);
    short ev = POLLIN, rev = 0;
    CHECK(io->poll(t->comm, 1, &peer, &ev, &rev, 0) == 0 && rev == 0, "rank 0: nothing left, yet readable");
    uint8_t one;
    errno = 0;
    CHECK(io->recv(t->comm, peer, &one, 1) == -1 && errno == EAGAIN, "rank 0: a byte that was never sent");
    barrier(t);
    /* 50 bytes, then the end: the end shows only after all 50, even when
     * the socket had it while some of them were still read ahead. */
    CHECK(stream_take(t, peer, more, 10), "the first 10 of the last 50 bytes");
    size_t tail = 0;
    ssize_t k;
    while (tail <= 40) {
      CHECK(io->poll(t->comm, 1, &peer, &ev, &rev, 20000) == 1, "rank 0: the end of the stream is not seen");
      k = io->recv(t->comm, peer, more + 10 + tail, sizeof more - 10 - tail);
      if (k <= 0) break;
      tail += (size_t)k;
    }
    CHECK(tail == 40 && k == 0, "rank 0: %zu bytes before the end of the stream (want 40), then %zd", tail, k);
    for (size_t i = 0; i < 50; i++)
      if (more[i] != (uint8_t)(i ^ 0x5a)) {
        CHECK(0, "rank 0: byte %zu of the last 50 is wrong", i);
        break;
      }
  }
  free(bytes);
  barrier(t);
  teardown(t);
}

/* Rank 2 publishes its endpoint but never sets up. */
static void setup_timeout_group(rank_ctx_t *t) {
  tcc_endpoint_t *ep = publish_endpoint(t);
  if (!ep) return;
  barrier(t);
  if (t->rank == 2) {
    barrier(t);
    tcc_endpoint_close(ep);
    return;
  }
  tcc_err_t err;
  double t0 = now_s();
  tcc_result_t r = setup(t, ep, 500, &err);
  double took = now_s() - t0;
  CHECK(r == TCC_ERR_TIMEOUT, "rank %d: got %d: %s", t->rank, r, err.msg);
  CHECK(took >= 0.45 && took < 3.0, "rank %d: setup timeout took %.3f s", t->rank, took);
  CHECK(strstr(err.msg, "rank 2") && strstr(err.msg, "test3") && !strstr(err.msg, "rank 1 ("),
        "rank %d: message should name rank 2 only: %s", t->rank, err.msg);
  CHECK(t->comm->ops == NULL && t->comm->transport_state == NULL, "state left on failure");
  free(t->comm);
  barrier(t);
}

/* Rank 0 closes its endpoint: rank 1's connects are refused until the deadline. */
static void setup_refused_group(rank_ctx_t *t) {
  tcc_endpoint_t *ep = publish_endpoint(t);
  if (!ep) return;
  barrier(t);
  if (t->rank == 0) {
    tcc_endpoint_close(ep);
    barrier(t);
    return;
  }
  barrier(t);
  tcc_err_t err;
  tcc_result_t r = setup(t, ep, 300, &err);
  CHECK(r == TCC_ERR_TIMEOUT, "got %d: %s", r, err.msg);
  CHECK(strstr(err.msg, "rank 0") && strstr(err.msg, "refused"), "message: %s", err.msg);
  free(t->comm);
}

int main(void) {
  tcc_endpoint_t *ep = (tcc_endpoint_t *)1;
  uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
  CHECK(tcc_endpoint_open("not-an-address", &ep, blob) == TCC_ERR_INVALID &&
            ep == NULL && strstr(tcc_last_error(), "not-an-address"),
        "bad address accepted: %s", tcc_last_error());
  CHECK(tcc_endpoint_open("", &ep, blob) == TCC_OK, "%s", tcc_last_error());
  const tcc_blob_t *b = (const tcc_blob_t *)blob;
  CHECK(b->magic == TCC_BLOB_MAGIC && b->port && b->ipv4 == htonl(INADDR_LOOPBACK) &&
            b->pid == (uint32_t)getpid(),
        "blob fields");
  tcc_endpoint_close(ep);

  int failed = 0;
  for (int n = 1; n <= MAXN; n++) failed += run_group("collectives, p2p, failures", n, full_group);
  for (machines_of_group = 1; machines_of_group <= MAXN; machines_of_group *= 2) {
    char what[64];
    snprintf(what, sizeof what, "waits: %d machine(s)", machines_of_group);
    failed += run_group(what, MAXN, machines_group);
  }
  failed += run_group("streams: read-ahead", 2, streams_group);
  failed += run_group("setup: missing rank", 3, setup_timeout_group);
  failed += run_group("setup: connection refused", 2, setup_refused_group);
  CHECK(failed == 0, "%d rank(s) failed", failed);
  CHECK_DONE();
}
