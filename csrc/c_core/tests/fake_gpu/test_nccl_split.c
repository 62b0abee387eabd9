/*
 * test_nccl_split.c - tcc_comm_cuda_split through the fake NCCL: a child
 * communicator gets its NCCL communicator by ncclCommSplit of its
 * parent's (no bootstrap of its own), in the child's rank order, while
 * ranks outside every child take part with no color; the parent keeps
 * working; a parent without NCCL yet splits nothing; bad arguments, ranks
 * that disagree and a failing split give clear errors, never a hang.
 *
 * Three ranks. A child's host side is made as any communicator is: the
 * members' endpoints, gathered here over the parent's host path.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "../group.h"
#include "gpu_rank.h"

#include <time.h>

#define COUNT 29
#define NAME "fake-gpu-split"

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A communicator of the parent's ranks `members` (in that order: the
 * order gives the child's ranks). Collective over the parent; NULL on a
 * rank outside. */
static tcc_comm_t *sub_comm(tcc_comm_t *parent, const int *members, int n, const char *name) {
  const int size = tcc_comm_size(parent), me = tcc_comm_rank(parent);
  tcc_endpoint_t *ep = NULL;
  uint8_t mine[TCC_ENDPOINT_BLOB_SIZE];
  CHECK(tcc_endpoint_open("127.0.0.1", &ep, mine) == TCC_OK, "endpoint: %s", tcc_last_error());
  uint8_t *all = calloc((size_t)size, TCC_ENDPOINT_BLOB_SIZE);
  tcc_buf_t recvs[8];
  for (int j = 0; j < size; j++)
    recvs[j] = (tcc_buf_t){all + (size_t)j * TCC_ENDPOINT_BLOB_SIZE, TCC_ENDPOINT_BLOB_SIZE, TCC_UINT8, -1, NULL};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allgather(parent, (tcc_buf_t){mine, sizeof mine, TCC_UINT8, -1, NULL}, recvs, NULL, &op);
  if (r == TCC_OK) {
    r = tcc_op_wait(op, -1);
    tcc_op_release(op);
  }
  CHECK(r == TCC_OK, "gathering endpoints on rank %d: %s", me, tcc_last_error());
  int my_rank = -1;
  uint8_t *blobs = calloc((size_t)n, TCC_ENDPOINT_BLOB_SIZE);
  for (int k = 0; k < n; k++) {
    memcpy(blobs + (size_t)k * TCC_ENDPOINT_BLOB_SIZE, all + (size_t)members[k] * TCC_ENDPOINT_BLOB_SIZE,
           TCC_ENDPOINT_BLOB_SIZE);
    if (members[k] == me) my_rank = k;
  }
  tcc_comm_t *child = NULL;
  if (my_rank >= 0 && r == TCC_OK) {
    tcc_comm_config_t cfg = {my_rank, n, 10000, name, TCC_TRANSPORT_SHM};
    r = tcc_comm_create(&cfg, ep, blobs, &child);
    CHECK(r == TCC_OK, "creating '%s' on rank %d: %s", name, me, tcc_last_error());
  } else {
    tcc_endpoint_close(ep);
  }
  free(blobs);
  free(all);
  return child;
}

/* Allreduce of every rank's input (+ offset) on comm's CUDA path, checked
 * against the host sum over the parent ranks `members` hold. */
static void check_allreduce(gpu_rank_t *g, tcc_comm_t *comm, const int *members, int n, const char *what) {
  float *d = dev_alloc(COUNT * 4);
  float in[COUNT], out[COUNT];
  for (int i = 0; i < COUNT; i++) in[i] = (float)input_value(g->rank, (size_t)i);
  upload(g, d, in, sizeof in);
  tcc_op_t *op = NULL;
  tcc_buf_t b = dbuf(g, d, COUNT, TCC_FLOAT32);
  if (settle(g, tcc_allreduce(comm, b, b, TCC_SUM, NULL, &op), &op, what) == 0) {
    download(g, out, d, sizeof out);
    for (int i = 0; i < COUNT; i++) {
      double want = 0;
      for (int k = 0; k < n; k++) want += input_value(members[k], (size_t)i);
      CHECK(out[i] == (float)want, "%s on rank %d [%d]: %g, want %g", what, g->rank, i, out[i], want);
      if (out[i] != (float)want) break;
    }
  }
  cudaFree(d);
}

/* Broadcast from the child's rank 0: every member gets that parent rank's
 * value, which shows the NCCL ranks follow the child's order. */
static void check_broadcast_order(gpu_rank_t *g, tcc_comm_t *child, int root_parent_rank, const char *what) {
  float *d = dev_alloc(COUNT * 4);
  float in[COUNT], out[COUNT];
  for (int i = 0; i < COUNT; i++) in[i] = (float)(100 * g->rank + i);
  upload(g, d, in, sizeof in);
  tcc_op_t *op = NULL;
  tcc_buf_t b = dbuf(g, d, COUNT, TCC_FLOAT32);
  if (settle(g, tcc_broadcast(child, b, 0, NULL, &op), &op, what) == 0) {
    download(g, out, d, sizeof out);
    for (int i = 0; i < COUNT; i++) {
      CHECK(out[i] == (float)(100 * root_parent_rank + i), "%s on rank %d [%d]: %g, want rank %d's", what, g->rank,
            i, out[i], root_parent_rank);
      if (out[i] != (float)(100 * root_parent_rank + i)) break;
    }
  }
  cudaFree(d);
}

/* Parent ranks 2 and 0 (in that order) split off; rank 1 takes part with
 * no color. The child's first collective makes no NCCL communicator. */
static void split_shares_setup(gpu_rank_t *g, tcc_comm_t *parent) {
  static const int members[] = {2, 0};
  const int in_child = g->rank != 1;
  tcc_comm_t *child = sub_comm(parent, members, 2, NAME "-child");
  const int splits = fake_nccl_calls("ncclCommSplit"), inits = fake_nccl_calls("ncclCommInitRankConfig");
  int done = -1;
  tcc_result_t r = tcc_comm_cuda_split(parent, in_child ? 2 : TCC_SPLIT_NOCOLOR, child, &done);
  CHECK(r == TCC_OK && done == 1, "split on rank %d: %s (done %d)", g->rank, tcc_last_error(), done);
  CHECK(fake_nccl_calls("ncclCommSplit") == splits + 1, "rank %d called ncclCommSplit %d time(s)", g->rank,
        fake_nccl_calls("ncclCommSplit") - splits);
  if (child) {
    CHECK(tcc_comm_cuda_device(child) == g->device, "the child's device is %d", tcc_comm_cuda_device(child));
    check_allreduce(g, child, members, 2, "allreduce on the split child");
    check_broadcast_order(g, child, members[0], "broadcast on the split child");
    CHECK(fake_nccl_calls("ncclCommInitRankConfig") == inits, "the split child bootstrapped NCCL on rank %d",
          g->rank);
  }
  static const int everyone[] = {0, 1, 2};
  check_allreduce(g, parent, everyone, 3, "allreduce on the parent after its split");
  if (child) tcc_comm_destroy(child);
}

/* A parent that made no NCCL communicator yet has nothing to share: no
 * NCCL call, and the child sets up its own at its first collective. */
static void split_before_nccl(gpu_rank_t *g, tcc_comm_t *parent) {
  static const int members[] = {0, 1, 2};
  tcc_comm_t *fresh = sub_comm(parent, members, 3, NAME "-fresh"); /* a parent with no CUDA op yet */
  tcc_comm_t *child = sub_comm(parent, members, 3, NAME "-fresh-child");
  const int splits = fake_nccl_calls("ncclCommSplit"), inits = fake_nccl_calls("ncclCommInitRankConfig");
  int done = -1;
  tcc_result_t r = tcc_comm_cuda_split(fresh, 0, child, &done);
  CHECK(r == TCC_OK && done == 0, "split of a parent without NCCL on rank %d: %s (done %d)", g->rank,
        tcc_last_error(), done);
  CHECK(fake_nccl_calls("ncclCommSplit") == splits, "ncclCommSplit was called without a parent communicator");
  check_allreduce(g, child, members, 3, "allreduce on a child of a parent without NCCL");
  CHECK(fake_nccl_calls("ncclCommInitRankConfig") == inits + 1, "the child did not bootstrap its own NCCL");
  tcc_comm_destroy(child);
  tcc_comm_destroy(fresh);
}

/* Arguments that cannot be right are refused before NCCL is called. */
static void split_misuse(gpu_rank_t *g, tcc_comm_t *parent) {
  const int splits = fake_nccl_calls("ncclCommSplit");
  CHECK(tcc_comm_cuda_split(parent, -7, NULL, NULL) == TCC_ERR_INVALID && strstr(tcc_last_error(), "color") &&
            strstr(tcc_last_error(), NAME),
        "color -7: %s", tcc_last_error());
  CHECK(tcc_comm_cuda_split(parent, 3, NULL, NULL) == TCC_ERR_INVALID && strstr(tcc_last_error(), "child"),
        "a color without a child: %s", tcc_last_error());
  CHECK(tcc_comm_cuda_split(parent, TCC_SPLIT_NOCOLOR, parent, NULL) == TCC_ERR_INVALID,
        "no color with a child: %s", tcc_last_error());
  CHECK(fake_nccl_calls("ncclCommSplit") == splits, "a refused split called NCCL on rank %d", g->rank);
  CHECK(tcc_comm_status(parent) == TCC_OK, "a refused split broke the parent: %s", tcc_comm_failure(parent));
}

/* Rank 1 claims the color of ranks 2 and 0 with a child of its own: NCCL
 * makes one communicator of three, which matches no child. Every rank says
 * so instead of running ops on a communicator of the wrong ranks. */
static void split_disagreement(gpu_rank_t *g, tcc_comm_t *parent) {
  static const int pair[] = {2, 0}, alone[] = {1};
  tcc_comm_t *child = g->rank == 1 ? sub_comm(parent, alone, 1, NAME "-alone")
                                   : sub_comm(parent, pair, 2, NAME "-pair");
  /* sub_comm is collective: the other child's creation needs everyone too. */
  tcc_comm_t *other = g->rank == 1 ? sub_comm(parent, pair, 2, NAME "-pair") : sub_comm(parent, alone, 1, NAME "-alone");
  CHECK(other == NULL, "rank %d is in both children", g->rank);
  tcc_result_t r = tcc_comm_cuda_split(parent, 5, child, NULL);
  CHECK(r == TCC_ERR_MISMATCH && strstr(tcc_last_error(), "disagree") && strstr(tcc_last_error(), NAME),
        "a split that matches no child on rank %d: %s", g->rank, tcc_last_error());
  static const int everyone[] = {0, 1, 2};
  check_allreduce(g, parent, everyone, 3, "allreduce on the parent after a split that disagreed");
  tcc_comm_destroy(child);
}

/* The split fails inside NCCL on rank 0: rank 0 says so, the others stop
 * waiting for it at the parent's deadline (or when they hear of its
 * failure), and the parent, whose NCCL communicator is left mid-split, is
 * unusable everywhere. Last: it breaks the parent. */
static void split_fails(gpu_rank_t *g, tcc_comm_t *parent) {
  static const int members[] = {2, 1, 0};
  tcc_comm_t *child = sub_comm(parent, members, 3, NAME "-doomed");
  tcc_comm_set_timeout(parent, 1500);
  if (g->rank == 0) fake_nccl_inject("ncclCommSplit", 1, FAKE_NCCL_FAIL);
  const int64_t t0 = now_ms();
  tcc_result_t r = tcc_comm_cuda_split(parent, 0, child, NULL);
  const int64_t took = now_ms() - t0;
  char rank_s[16];
  snprintf(rank_s, sizeof rank_s, "rank %d", g->rank);
  CHECK(r != TCC_OK && strstr(tcc_last_error(), "cuda_split") && strstr(tcc_last_error(), NAME) &&
            strstr(tcc_last_error(), rank_s),
        "a failing split on rank %d: %s", g->rank, tcc_last_error());
  if (g->rank == 0) CHECK(strstr(tcc_last_error(), "ncclCommSplit") != NULL, "rank 0: %s", tcc_last_error());
  CHECK(took < 10000, "the failing split took %lld ms on rank %d", (long long)took, g->rank);
  CHECK(tcc_comm_status(parent) != TCC_OK, "the parent is still usable on rank %d after a broken split", g->rank);
  fake_nccl_clear_faults();
  tcc_comm_destroy(child);
}

static void rank_main(tcc_comm_t *comm) {
  alarm(120);
  gpu_rank_t g = gpu_rank_open(comm);
  CHECK(tcc_comm_cuda_init(comm, g.device) == TCC_OK, "cuda_init on rank %d: %s", g.rank, tcc_last_error());
  split_shares_setup(&g, comm);
  split_before_nccl(&g, comm);
  split_misuse(&g, comm);
  split_disagreement(&g, comm);
  split_fails(&g, comm);
  gpu_rank_close(&g);
}

int main(void) {
  alarm(300);
  setenv("TCCOMM_ASYNC_ERROR_HANDLING", "2", 1); /* a broken parent must raise, not end the process */
  CHECK(run_group(3, "shm", 10000, NAME, rank_main) == 0, "3 ranks");
  CHECK_DONE();
}
