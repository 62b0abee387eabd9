/*
 * test_nccl_groups.c - groups of CUDA ops (tcc_comm_group_start/end) on
 * one and on two communicators of the same ranks, through the fake NCCL,
 * whose groups are per thread as NCCL's are. Every op of a group must be
 * complete only once NCCL launched it (at the thread's outermost
 * ncclGroupEnd, whichever communicator's), and its data must then be right.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "../group.h"
#include "gpu_rank.h"

#define COUNT 33

/* A second communicator over the same ranks: endpoints swapped through
 * the first one's host path. */
static tcc_comm_t *second_comm(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  tcc_endpoint_t *ep = NULL;
  uint8_t mine[TCC_ENDPOINT_BLOB_SIZE];
  if (tcc_endpoint_open("127.0.0.1", &ep, mine) != TCC_OK) return NULL;
  uint8_t *all = calloc((size_t)n, TCC_ENDPOINT_BLOB_SIZE);
  tcc_buf_t recvs[8];
  for (int j = 0; j < n; j++) recvs[j] = (tcc_buf_t){all + (size_t)j * TCC_ENDPOINT_BLOB_SIZE, TCC_ENDPOINT_BLOB_SIZE, TCC_UINT8, -1, NULL};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allgather(comm, (tcc_buf_t){mine, sizeof mine, TCC_UINT8, -1, NULL}, recvs, NULL, &op);
  if (r == TCC_OK) {
    r = tcc_op_wait(op, -1);
    tcc_op_release(op);
  }
  tcc_comm_t *second = NULL;
  tcc_comm_config_t cfg = {me, n, 10000, "fake-gpu-groups-b", TCC_TRANSPORT_SHM};
  if (r == TCC_OK) r = tcc_comm_create(&cfg, ep, all, &second);
  else tcc_endpoint_close(ep);
  free(all);
  CHECK(r == TCC_OK, "second communicator on rank %d: %s", me, tcc_last_error());
  return r == TCC_OK ? second : NULL;
}

typedef struct {
  float *dev;
  tcc_op_t *op;
} pending_t;

/* Issues an allreduce of the rank's inputs (+ offset) on comm; the op is
 * left pending. */
static pending_t issue_allreduce(gpu_rank_t *g, tcc_comm_t *comm, double offset) {
  pending_t p = {dev_alloc(COUNT * 4), NULL};
  float in[COUNT];
  for (int i = 0; i < COUNT; i++) in[i] = (float)(input_value(g->rank, (size_t)i) + offset);
  upload(g, p.dev, in, sizeof in);
  tcc_buf_t b = {p.dev, COUNT, TCC_FLOAT32, g->device, g->stream};
  tcc_result_t r = tcc_allreduce(comm, b, b, TCC_SUM, NULL, &p.op);
  CHECK(r == TCC_OK, "allreduce on rank %d: %s", g->rank, tcc_last_error());
  return p;
}

/* Waits for the op from the host and checks the data where it lies
 * (device memory is host memory in the fake), without any stream work:
 * an op that says it is complete must have its result in place. */
static void finish_allreduce(gpu_rank_t *g, pending_t *p, double offset, const char *what) {
  if (p->op) {
    tcc_result_t r = tcc_op_wait(p->op, -1);
    CHECK(r == TCC_OK, "%s on rank %d: %s", what, g->rank, tcc_op_error(p->op));
    if (r == TCC_OK)
      for (int i = 0; i < COUNT; i++) {
        const double want = reduced_value(g->size, (size_t)i, TCC_FLOAT32, TCC_SUM, 0) + offset * g->size;
        CHECK(p->dev[i] == (float)want, "%s on rank %d [%d]: %g, want %g", what, g->rank, i, p->dev[i], want);
        if (p->dev[i] != (float)want) break;
      }
    tcc_op_release(p->op);
  }
  cudaFree(p->dev);
}

/* Several ops of one communicator in one group: one launch, all right. */
static void coalesced_on_one(gpu_rank_t *g) {
  pending_t p[3];
  CHECK(tcc_comm_group_start(g->comm) == TCC_OK, "group start");
  for (int k = 0; k < 3; k++) p[k] = issue_allreduce(g, g->comm, 10.0 * k);
  CHECK(tcc_comm_group_end(g->comm) == TCC_OK, "group end: %s", tcc_last_error());
  for (int k = 0; k < 3; k++) finish_allreduce(g, &p[k], 10.0 * k, "coalesced allreduce");
}

/* An op on B while A's group is open on this thread: NCCL launches it at
 * A's group end, so it must not be complete before. */
static void op_inside_another_group(gpu_rank_t *g, tcc_comm_t *b) {
  CHECK(tcc_comm_group_start(g->comm) == TCC_OK, "group start");
  pending_t in_group = issue_allreduce(g, g->comm, 1);
  pending_t other = issue_allreduce(g, b, 2);
  if (other.op) {
    tcc_result_t r = tcc_op_wait(other.op, 500);
    CHECK(r == TCC_ERR_INPROGRESS, "an op issued while another group is open on the thread completed before "
                                   "that group launched it (wait: %s)", tcc_result_string(r));
  }
  /* A blocking call could never return there: refused, nothing issued. */
  float *d = dev_alloc(sizeof(float));
  const tcc_buf_t one = dbuf(g, d, 1, TCC_FLOAT32);
  const uint64_t issued = tcc_comm_collective_count(b);
  tcc_result_t r = tcc_allreduce(b, one, one, TCC_SUM, NULL, NULL);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "allreduce") && strstr(tcc_last_error(), "group is open"),
        "a blocking allreduce inside a group: %s: %s", tcc_result_string(r), tcc_last_error());
  r = tcc_send(b, one, 1 - g->rank, 5, NULL, NULL);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "send") && strstr(tcc_last_error(), "group is open"),
        "a blocking send inside a group: %s: %s", tcc_result_string(r), tcc_last_error());
  CHECK(tcc_comm_collective_count(b) == issued, "a refused blocking call was counted as issued");
  CHECK(tcc_comm_group_end(g->comm) == TCC_OK, "group end: %s", tcc_last_error());
  finish_allreduce(g, &in_group, 1, "allreduce in the group");
  finish_allreduce(g, &other, 2, "allreduce on the other communicator");
  cudaFree(d);
}

/* Groups of two communicators nested on one thread: nothing launches
 * until the outer one ends. */
static void nested_groups(gpu_rank_t *g, tcc_comm_t *b) {
  CHECK(tcc_comm_group_start(g->comm) == TCC_OK, "group start A");
  CHECK(tcc_comm_group_start(b) == TCC_OK, "group start B");
  pending_t pa = issue_allreduce(g, g->comm, 3), pb = issue_allreduce(g, b, 4);
  CHECK(tcc_comm_group_end(b) == TCC_OK, "group end B: %s", tcc_last_error());
  if (pb.op) {
    tcc_result_t r = tcc_op_wait(pb.op, 300);
    CHECK(r == TCC_ERR_INPROGRESS, "B's op completed while A's group still held its launch (wait: %s)",
          tcc_result_string(r));
  }
  CHECK(tcc_comm_group_end(g->comm) == TCC_OK, "group end A: %s", tcc_last_error());
  finish_allreduce(g, &pa, 3, "allreduce on A");
  finish_allreduce(g, &pb, 4, "allreduce on B");
}

/* The embedding program's allocator, counting what the core's staging
 * takes and gives back. */
static int staged_allocs, staged_frees;

static void *count_alloc(void *ctx, size_t bytes, int device, void *stream) {
  (void)ctx;
  (void)device;
  void *p = NULL;
  if (cudaMallocAsync(&p, bytes, (cudaStream_t)stream) != cudaSuccess) return NULL;
  staged_allocs++;
  return p;
}

static void count_free(void *ctx, void *ptr, int device, void *stream) {
  (void)ctx;
  (void)device;
  staged_frees++;
  cudaFreeAsync(ptr, (cudaStream_t)stream);
}

/* ncclGroupEnd fails (on every rank: nothing launches anywhere): every op
 * of the group fails saying so, and the staging memory of the list-form
 * allgather in it goes back to the allocator, in order on the stream. */
static void group_end_fails(gpu_rank_t *g) {
  const int n = g->size;
  const tcc_device_allocator_t a = {count_alloc, count_free, NULL};
  tcc_set_device_allocator(&a);
  staged_allocs = staged_frees = 0;
  float *in = dev_alloc(COUNT * 4), *parts[8];
  tcc_buf_t outs[8];
  for (int j = 0; j < n; j++) {
    parts[j] = dev_alloc(COUNT * 4);
    outs[j] = dbuf(g, parts[j], COUNT, TCC_FLOAT32);
  }
  CHECK(tcc_comm_group_start(g->comm) == TCC_OK, "group start");
  tcc_op_t *gather = NULL;
  CHECK(tcc_allgather(g->comm, dbuf(g, in, COUNT, TCC_FLOAT32), outs, NULL, &gather) == TCC_OK,
        "allgather in a group: %s", tcc_last_error());
  pending_t reduce = issue_allreduce(g, g->comm, 0);
  CHECK(staged_allocs == 1, "the list-form allgather staged %d time(s)", staged_allocs);
  fake_nccl_inject("ncclGroupEnd", 1, FAKE_NCCL_FAIL);
  char rank_s[16];
  snprintf(rank_s, sizeof rank_s, "rank %d", g->rank);
  const tcc_result_t r = tcc_comm_group_end(g->comm);
  CHECK(r != TCC_OK && strstr(tcc_last_error(), "ncclGroupEnd") && strstr(tcc_last_error(), "fake-gpu-groups") &&
            strstr(tcc_last_error(), rank_s),
        "a failed ncclGroupEnd: %s", tcc_last_error());
  tcc_op_t *ops[2] = {gather, reduce.op};
  for (int k = 0; k < 2; k++)
    if (ops[k]) {
      CHECK(tcc_op_wait(ops[k], 5000) != TCC_OK && strstr(tcc_op_error(ops[k]), "ncclGroupEnd"),
            "op %d of a group that never launched: %s", k, tcc_op_error(ops[k]));
      tcc_op_release(ops[k]);
    }
  CHECK(staged_frees == staged_allocs, "staging of a group that never launched: %d taken, %d given back",
        staged_allocs, staged_frees);
  tcc_set_device_allocator(NULL);
  fake_nccl_clear_faults();
  CHECK(cudaDeviceSynchronize() == cudaSuccess, "device sync");
  for (int j = 0; j < n; j++) cudaFree(parts[j]);
  cudaFree(in);
  cudaFree(reduce.dev);
}

static void rank_main(tcc_comm_t *comm) {
  alarm(120);
  gpu_rank_t g = gpu_rank_open(comm);
  tcc_comm_t *b = second_comm(comm);
  /* Each communicator's group NCCL communicator exists before the cases:
   * its setup is a collective of its own. */
  pending_t wa = issue_allreduce(&g, comm, 0);
  finish_allreduce(&g, &wa, 0, "warm-up A");
  if (b) {
    pending_t wb = issue_allreduce(&g, b, 0);
    finish_allreduce(&g, &wb, 0, "warm-up B");
  }
  coalesced_on_one(&g);
  if (b) {
    op_inside_another_group(&g, b);
    nested_groups(&g, b);
    tcc_comm_destroy(b);
  }
  group_end_fails(&g); /* last: what NCCL is left in after it is not a test of anything */
  gpu_rank_close(&g);
}

int main(void) {
  alarm(300);
  CHECK(run_group(2, "shm", 10000, "fake-gpu-groups", rank_main) == 0, "2 ranks");
  CHECK_DONE();
}
