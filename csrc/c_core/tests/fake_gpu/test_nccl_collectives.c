/*
 * test_nccl_collectives.c - every collective and point-to-point op of the
 * core's CUDA path, on 2 and 3 ranks, through the fake CUDA runtime and
 * the fake NCCL; each result checked against the host reference of
 * gpu_rank.h. Odd counts, zero counts, every dtype NCCL can reduce, every
 * reduce op it has, and the list forms whose per-peer buffers are not one
 * block (the core stages those). Allreduce also blocking (no op handle).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "../group.h"
#include "gpu_rank.h"
#include "nccl/nccl_lib.h"

#define COUNT 37 /* odd, so no path can assume a multiple of anything */

static void check_reduced(gpu_rank_t *g, const char *what, const void *host, size_t count, tcc_dtype_t dt,
                          tcc_redop_t op, double premul, size_t first) {
  /* AVG and PREMUL_SUM of floats scale each input (NCCL: by 1/n, or the
   * factor) before summing, so they are exact only up to rounding. */
  const int scaled = (op == TCC_AVG || op == TCC_PREMUL_SUM) &&
                     (dt == TCC_FLOAT32 || dt == TCC_FLOAT64 || dt == TCC_FLOAT16 || dt == TCC_BFLOAT16);
  const double tol = !scaled ? 0 : dt == TCC_FLOAT16 || dt == TCC_BFLOAT16 ? 1e-2 : 1e-6;
  for (size_t i = 0; i < count; i++) {
    double want = reduced_value(g->size, first + i, dt, op, premul), got = get_value(host, i, dt);
    CHECK(fabs(got - want) <= tol * fabs(want), "%s %s %s rank %d [%zu]: got %g, want %g", what, tcc_dtype_name(dt), tcc_redop_name(op),
          g->rank, first + i, got, want);
    if (fabs(got - want) > tol * fabs(want)) break;
  }
}

static void allreduce_case(gpu_rank_t *g, tcc_dtype_t dt, tcc_redop_t op, size_t count) {
  const size_t bytes = count * tcc_dtype_size(dt);
  void *in = host_input(g->rank, count, dt, 0), *out = calloc(1, bytes + 1);
  void *d_in = dev_alloc(bytes), *d_out = dev_alloc(bytes);
  upload(g, d_in, in, bytes);
  tcc_op_opts_t opts = {.timeout_ms = 0, .premul_factor = 0.5};
  tcc_op_t *o = NULL;
  if (settle(g, tcc_allreduce(g->comm, dbuf(g, d_in, count, dt), dbuf(g, d_out, count, dt), op, &opts, &o), &o,
             "allreduce") == 0) {
    download(g, out, d_out, bytes);
    check_reduced(g, "allreduce", out, count, dt, op, 0.5, 0);
  }
  /* In place, waited on from the host: completion must mean the data is there. */
  upload(g, d_in, in, bytes);
  o = NULL;
  tcc_result_t r = tcc_allreduce(g->comm, dbuf(g, d_in, count, dt), dbuf(g, d_in, count, dt), op, &opts, &o);
  CHECK(r == TCC_OK, "in-place allreduce: %s", tcc_last_error());
  if (r == TCC_OK) {
    CHECK(tcc_op_wait(o, -1) == TCC_OK, "wait: %s", tcc_op_error(o));
    /* Device memory is host memory here: read it without any stream work. */
    check_reduced(g, "in-place allreduce (host wait)", d_in, count, dt, op, 0.5, 0);
    tcc_op_release(o);
  }
  /* Blocking (no handle): issued and waited for inside the call, as above. */
  upload(g, d_in, in, bytes);
  r = tcc_allreduce(g->comm, dbuf(g, d_in, count, dt), dbuf(g, d_in, count, dt), op, &opts, NULL);
  CHECK(r == TCC_OK, "blocking in-place allreduce: %s", tcc_last_error());
  if (r == TCC_OK) check_reduced(g, "blocking in-place allreduce", d_in, count, dt, op, 0.5, 0);
  cudaFree(d_in);
  cudaFree(d_out);
  free(in);
  free(out);
}

/* PREMUL_SUM whose factor lives on the device (read by the kernel): it
 * wins over the host factor given beside it. */
static void allreduce_premul_device(gpu_rank_t *g, tcc_dtype_t dt) {
  const size_t count = COUNT, bytes = count * tcc_dtype_size(dt);
  void *in = host_input(g->rank, count, dt, 0), *out = calloc(1, bytes), *factor = calloc(1, 8);
  put_value(factor, 0, dt, 0.25);
  void *d = dev_alloc(bytes), *d_factor = dev_alloc(8);
  upload(g, d, in, bytes);
  upload(g, d_factor, factor, tcc_dtype_size(dt));
  tcc_op_opts_t opts = {.timeout_ms = 0, .premul_factor = 0.5, .premul_device_factor = d_factor};
  tcc_op_t *o = NULL;
  if (settle(g, tcc_allreduce(g->comm, dbuf(g, d, count, dt), dbuf(g, d, count, dt), TCC_PREMUL_SUM, &opts, &o), &o,
             "allreduce premul (device factor)") == 0) {
    download(g, out, d, bytes);
    check_reduced(g, "allreduce premul (device factor 0.25)", out, count, dt, TCC_PREMUL_SUM, 0.25, 0);
  }
  cudaFree(d);
  cudaFree(d_factor);
  free(in);
  free(out);
  free(factor);
}

static void test_allreduce(gpu_rank_t *g) {
  const tcc_dtype_t types[] = {TCC_FLOAT32, TCC_FLOAT64, TCC_FLOAT16, TCC_BFLOAT16, TCC_INT32, TCC_INT64, TCC_UINT8};
  const tcc_redop_t ops[] = {TCC_SUM, TCC_PRODUCT, TCC_MIN, TCC_MAX, TCC_AVG};
  for (size_t t = 0; t < sizeof types / sizeof *types; t++)
    for (size_t k = 0; k < sizeof ops / sizeof *ops; k++) allreduce_case(g, types[t], ops[k], COUNT);
  allreduce_case(g, TCC_FLOAT32, TCC_PREMUL_SUM, COUNT);
  allreduce_case(g, TCC_FLOAT64, TCC_PREMUL_SUM, COUNT);
  allreduce_case(g, TCC_BFLOAT16, TCC_PREMUL_SUM, COUNT);
  allreduce_premul_device(g, TCC_FLOAT32);
  allreduce_premul_device(g, TCC_BFLOAT16);
  const tcc_redop_t bool_ops[] = {TCC_SUM, TCC_PRODUCT, TCC_MIN, TCC_MAX};
  for (size_t k = 0; k < 4; k++) allreduce_case(g, TCC_BOOL, bool_ops[k], COUNT);
  allreduce_case(g, TCC_FLOAT32, TCC_SUM, 0);
  allreduce_case(g, TCC_FLOAT32, TCC_SUM, 100000); /* several of the fake's chunks, if it chunks */
}

/* What NCCL cannot reduce fails before anything is enqueued, naming why. */
static void test_unsupported(gpu_rank_t *g) {
  void *d = dev_alloc(64);
  tcc_op_t *o = NULL;
  tcc_result_t r = tcc_allreduce(g->comm, dbuf(g, d, 8, TCC_INT32), dbuf(g, d, 8, TCC_INT32), TCC_BXOR, NULL, &o);
  CHECK(r == TCC_ERR_UNSUPPORTED && strstr(tcc_last_error(), "bitwise"), "BXOR on int32: %d %s", r, tcc_last_error());
  r = tcc_allreduce(g->comm, dbuf(g, d, 8, TCC_INT16), dbuf(g, d, 8, TCC_INT16), TCC_SUM, NULL, &o);
  CHECK(r == TCC_ERR_UNSUPPORTED && strstr(tcc_last_error(), "int16"), "int16: %d %s", r, tcc_last_error());
  cudaFree(d);
  /* The communicator is still usable. */
  allreduce_case(g, TCC_INT32, TCC_SUM, 5);
}

static void test_broadcast_reduce(gpu_rank_t *g) {
  const tcc_dtype_t dt = TCC_INT64;
  const size_t bytes = COUNT * 8;
  for (int root = 0; root < g->size; root++) {
    void *in = host_input(g->rank, COUNT, dt, 0), *out = calloc(1, bytes);
    void *d = dev_alloc(bytes), *d_out = dev_alloc(bytes);
    upload(g, d, in, bytes);
    tcc_op_t *o = NULL;
    if (settle(g, tcc_broadcast(g->comm, dbuf(g, d, COUNT, dt), root, NULL, &o), &o, "broadcast") == 0) {
      download(g, out, d, bytes);
      for (size_t i = 0; i < COUNT; i++)
        CHECK(get_value(out, i, dt) == input_value(root, i), "broadcast root %d [%zu]", root, i);
    }
    upload(g, d, in, bytes);
    o = NULL;
    if (settle(g, tcc_reduce(g->comm, dbuf(g, d, COUNT, dt), dbuf(g, d_out, COUNT, dt), TCC_MAX, root, NULL, &o),
               &o, "reduce") == 0 && g->rank == root) {
      download(g, out, d_out, bytes);
      check_reduced(g, "reduce", out, COUNT, dt, TCC_MAX, 0, 0);
    }
    cudaFree(d);
    cudaFree(d_out);
    free(in);
    free(out);
  }
}

/* Per-peer buffers as one block and as separate allocations (staged). */
static void test_allgather_reduce_scatter(gpu_rank_t *g) {
  const int n = g->size;
  const tcc_dtype_t dt = TCC_FLOAT32;
  const size_t bytes = COUNT * 4;
  for (int blocked = 0; blocked < 2; blocked++) {
    void *in = host_input(g->rank, COUNT, dt, 0), *out = calloc(1, bytes);
    void *d_in = dev_alloc(bytes), *block = dev_alloc(bytes * (size_t)n);
    void *parts[8];
    tcc_buf_t bufs[8];
    for (int j = 0; j < n; j++) {
      parts[j] = blocked ? (char *)block + (size_t)j * bytes : dev_alloc(bytes);
      bufs[j] = dbuf(g, parts[j], COUNT, dt);
    }
    upload(g, d_in, in, bytes);
    tcc_op_t *o = NULL;
    if (settle(g, tcc_allgather(g->comm, dbuf(g, d_in, COUNT, dt), bufs, NULL, &o), &o, "allgather") == 0) {
      for (int j = 0; j < n; j++) {
        download(g, out, parts[j], bytes);
        for (size_t i = 0; i < COUNT; i++)
          CHECK(get_value(out, i, dt) == input_value(j, i), "allgather (%s) part %d [%zu] on rank %d",
                blocked ? "block" : "list", j, i, g->rank);
      }
    }
    /* reduce_scatter: part j of every rank's input holds rank r's values + j * COUNT */
    for (int j = 0; j < n; j++) {
      void *h = host_input(g->rank, COUNT, dt, 0);
      upload(g, parts[j], h, bytes);
      free(h);
    }
    o = NULL;
    if (settle(g, tcc_reduce_scatter(g->comm, bufs, dbuf(g, d_in, COUNT, dt), TCC_SUM, NULL, &o), &o,
               "reduce_scatter") == 0) {
      download(g, out, d_in, bytes);
      check_reduced(g, blocked ? "reduce_scatter (block)" : "reduce_scatter (list)", out, COUNT, dt, TCC_SUM, 0, 0);
    }
    if (!blocked)
      for (int j = 0; j < n; j++) cudaFree(parts[j]);
    cudaFree(block);
    cudaFree(d_in);
    free(in);
    free(out);
  }
}

/* Gather, scatter and all-to-all(-v, with a zero count) */
static void test_gather_scatter_alltoall(gpu_rank_t *g) {
  const int n = g->size, me = g->rank;
  const tcc_dtype_t dt = TCC_INT32;
  const size_t bytes = COUNT * 4;
  void *parts[8];
  tcc_buf_t bufs[8];
  for (int j = 0; j < n; j++) {
    parts[j] = dev_alloc(bytes);
    bufs[j] = dbuf(g, parts[j], COUNT, dt);
  }
  void *in = host_input(me, COUNT, dt, 0), *out = calloc(1, bytes), *d = dev_alloc(bytes);
  const int root = n - 1;
  upload(g, d, in, bytes);
  tcc_op_t *o = NULL;
  if (settle(g, tcc_gather(g->comm, dbuf(g, d, COUNT, dt), me == root ? bufs : NULL, root, NULL, &o), &o, "gather") == 0 &&
      me == root) {
    for (int j = 0; j < n; j++) {
      download(g, out, parts[j], bytes);
      for (size_t i = 0; i < COUNT; i++) CHECK(get_value(out, i, dt) == input_value(j, i), "gather part %d [%zu]", j, i);
    }
  }
  if (me == root)
    for (int j = 0; j < n; j++) {
      void *h = host_input(j, COUNT, dt, 100);
      upload(g, parts[j], h, bytes);
      free(h);
    }
  o = NULL;
  if (settle(g, tcc_scatter(g->comm, me == root ? bufs : NULL, dbuf(g, d, COUNT, dt), root, NULL, &o), &o, "scatter") == 0) {
    download(g, out, d, bytes);
    for (size_t i = 0; i < COUNT; i++) CHECK(get_value(out, i, dt) == input_value(me, i) + 100, "scatter [%zu]", i);
  }
  /* all-to-all-v: rank r sends (r + j) % 3 * 5 elements to rank j (zero for some pairs) */
  void *sparts[8];
  tcc_buf_t sends[8], recvs[8];
  for (int j = 0; j < n; j++) {
    const size_t sc = (size_t)((me + j) % 3) * 5, rc = (size_t)((j + me) % 3) * 5;
    void *h = host_input(me, sc, dt, 1000 * j);
    sparts[j] = dev_alloc(sc * 4);
    upload(g, sparts[j], h, sc * 4);
    free(h);
    sends[j] = dbuf(g, sparts[j], sc, dt);
    recvs[j] = dbuf(g, parts[j], rc, dt);
  }
  o = NULL;
  if (settle(g, tcc_alltoall(g->comm, sends, recvs, NULL, &o), &o, "alltoall") == 0) {
    for (int j = 0; j < n; j++) {
      const size_t rc = (size_t)((j + me) % 3) * 5;
      download(g, out, parts[j], rc * 4);
      for (size_t i = 0; i < rc; i++)
        CHECK(get_value(out, i, dt) == input_value(j, i) + 1000 * me, "alltoall from %d [%zu] on %d", j, i, me);
    }
  }
  for (int j = 0; j < n; j++) {
    cudaFree(parts[j]);
    cudaFree(sparts[j]);
  }
  cudaFree(d);
  free(in);
  free(out);
}

/* A ring of send/recv: every rank sends to the next, receives from the previous. */
static void test_send_recv(gpu_rank_t *g) {
  const int n = g->size, me = g->rank, next = (me + 1) % n, prev = (me + n - 1) % n;
  const tcc_dtype_t dt = TCC_FLOAT64;
  const size_t count = 1000, bytes = count * 8;
  void *in = host_input(me, count, dt, 7), *out = calloc(1, bytes), *d_s = dev_alloc(bytes), *d_r = dev_alloc(bytes);
  upload(g, d_s, in, bytes);
  tcc_op_t *s = NULL, *r = NULL;
  /* Even ranks send first: NCCL send/recv outside a group block until the peer posts. */
  tcc_result_t rs, rr;
  CHECK(tcc_comm_group_start(g->comm) == TCC_OK, "group start");
  rs = tcc_send(g->comm, dbuf(g, d_s, count, dt), next, 0, NULL, &s);
  rr = tcc_recv(g->comm, dbuf(g, d_r, count, dt), prev, 0, NULL, &r);
  CHECK(tcc_comm_group_end(g->comm) == TCC_OK, "group end: %s", tcc_last_error());
  settle(g, rs, &s, "send");
  if (settle(g, rr, &r, "recv") == 0) {
    download(g, out, d_r, bytes);
    for (size_t i = 0; i < count; i++) CHECK(get_value(out, i, dt) == input_value(prev, i) + 7, "recv [%zu]", i);
  }
  cudaFree(d_s);
  cudaFree(d_r);
  free(in);
  free(out);
}

/* The embedding program's allocator (torch's caching allocator in the
 * shim) serves the core's staging memory, every allocation given back. */
static struct {
  int allocs, frees;
  int wrong_stream;
} counted;

static void *counting_alloc(void *ctx, size_t bytes, int device, void *stream) {
  (void)ctx;
  void *p = NULL;
  int dev = -1;
  cudaGetDevice(&dev);
  if (dev != device || stream == NULL) counted.wrong_stream++;
  if (cudaMallocAsync(&p, bytes, (cudaStream_t)stream) != cudaSuccess) return NULL;
  counted.allocs++;
  return p;
}

static void counting_free(void *ctx, void *ptr, int device, void *stream) {
  (void)ctx;
  (void)device;
  counted.frees++;
  cudaFreeAsync(ptr, (cudaStream_t)stream);
}

static void test_staging_allocator(gpu_rank_t *g) {
  tcc_device_allocator_t a = {counting_alloc, counting_free, NULL};
  tcc_set_device_allocator(&a);
  test_allgather_reduce_scatter(g);
  tcc_set_device_allocator(NULL);
  /* The list forms (one allgather, one reduce_scatter) staged; the block forms did not. */
  CHECK(counted.allocs == 2 && counted.frees == 2 && counted.wrong_stream == 0,
        "staging through the allocator on rank %d: %d allocs, %d frees, %d on the wrong device/stream", g->rank,
        counted.allocs, counted.frees, counted.wrong_stream);
}

static void rank_main(tcc_comm_t *comm) {
  gpu_rank_t g = gpu_rank_open(comm);
  test_allreduce(&g);
  test_unsupported(&g);
  test_broadcast_reduce(&g);
  test_allgather_reduce_scatter(&g);
  test_staging_allocator(&g);
  test_gather_scatter_alltoall(&g);
  test_send_recv(&g);
  gpu_rank_close(&g);
}

/* NCCL reported its version as major*1000 + minor*100 + patch before 2.9
 * and as major*10000 + minor*100 + patch since: both read alike. */
static void test_versions(void) {
  CHECK(tcc__nccl_version_normalize(2708) == 20708, "2.7.8: %d", tcc__nccl_version_normalize(2708));
  CHECK(tcc__nccl_version_normalize(2804) == 20804, "2.8.4: %d", tcc__nccl_version_normalize(2804));
  CHECK(tcc__nccl_version_normalize(20906) == 20906, "2.9.6");
  CHECK(tcc__nccl_version_normalize(23007) == 23007, "2.30.7");
  CHECK(tcc__nccl_version_normalize(2708) >= TCC_NCCL_MIN_VERSION, "2.7.8 meets the minimum (2.7.0)");
  char s[32];
  tcc__nccl_version_string(tcc__nccl_version_normalize(2804), s, sizeof s);
  CHECK(strcmp(s, "2.8.4") == 0, "2804 reads as %s", s);
  int v = 0;
  CHECK(tcc_nccl_runtime_version(&v) == TCC_OK && v == NCCL_VERSION_CODE,
        "the fake NCCL reports %d, the version of the nccl.h it was built with is %d (%s)", v, NCCL_VERSION_CODE, tcc_last_error());
}

int main(void) {
  alarm(300);
  test_versions();
  for (int n = 2; n <= 3; n++) {
    int failed = run_group(n, "shm", 20000, "fake-gpu-coll", rank_main);
    CHECK(!failed, "%d ranks failed", n);
  }
  CHECK_DONE();
}
