/*
 * gpu_rank.h - what the fake-GPU tests share: a rank's device, stream and
 * buffers, and the values every rank can compute for every other rank, so
 * each result is checked against a reference computed here on the host.
 * Include check.h and group.h first.
 *
 * Device memory of the fake runtime is host memory, but the tests only
 * touch it through the runtime (copies ordered on the rank's stream), as
 * they would on a GPU; the one exception says so where it reads directly.
 */
#ifndef TCC_TESTS_GPU_RANK_H
#define TCC_TESTS_GPU_RANK_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "fake_gpu.h"

typedef struct gpu_rank {
  tcc_comm_t *comm;
  int rank, size;
  int device;
  cudaStream_t stream; /* the caller's stream of every op */
} gpu_rank_t;

/* The rank's device (one per rank, as torch's one-GPU-per-process) and stream. */
static inline gpu_rank_t gpu_rank_open(tcc_comm_t *comm) {
  gpu_rank_t g = {comm, tcc_comm_rank(comm), tcc_comm_size(comm), tcc_comm_rank(comm), NULL};
  CHECK(cudaSetDevice(g.device) == cudaSuccess, "cudaSetDevice(%d)", g.device);
  CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
  return g;
}

static inline void gpu_rank_close(gpu_rank_t *g) {
  cudaStreamSynchronize(g->stream);
  cudaStreamDestroy(g->stream);
}

static inline void *dev_alloc(size_t bytes) {
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  CHECK(e == cudaSuccess, "cudaMalloc(%zu): %s", bytes, cudaGetErrorString(e));
  return p;
}

/* Host to device, ordered on the rank's stream; returns once copied, so
 * the host buffer may be reused (a real cudaMemcpyAsync from pageable
 * memory reads it before returning; the fake reads it when the stream
 * gets there). */
static inline void upload(gpu_rank_t *g, void *dev, const void *host, size_t bytes) {
  CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, g->stream) == cudaSuccess, "upload");
  CHECK(cudaStreamSynchronize(g->stream) == cudaSuccess, "upload sync");
}

/* Device to host once everything queued on the rank's stream ran. */
static inline void download(gpu_rank_t *g, void *host, const void *dev, size_t bytes) {
  CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, g->stream) == cudaSuccess, "download");
  CHECK(cudaStreamSynchronize(g->stream) == cudaSuccess, "sync");
}

static inline void gpu_sync(gpu_rank_t *g) {
  CHECK(cudaStreamSynchronize(g->stream) == cudaSuccess, "sync");
}

static inline tcc_buf_t dbuf(gpu_rank_t *g, void *p, size_t count, tcc_dtype_t dt) {
  tcc_buf_t b = {p, count, dt, g->device, g->stream};
  return b;
}

/* Ends an op issued on the rank's stream: the issue result must be OK, the
 * rank's stream then waits for it (the device-side completion the shim
 * uses), and the op is released. 0 on success. */
static inline int settle(gpu_rank_t *g, tcc_result_t issued, tcc_op_t **opp, const char *what) {
  /* The op is read here, not passed by value: argument evaluation order
   * would let a caller's settle(g, tcc_x(..., &op), op, ...) read it unset. */
  tcc_op_t *op = *opp;
  CHECK(issued == TCC_OK, "%s on rank %d: %s", what, g->rank, tcc_last_error());
  if (issued != TCC_OK) return 1;
  tcc_result_t r = tcc_op_stream_wait(op, g->stream);
  CHECK(r == TCC_OK, "%s stream wait on rank %d: %s", what, g->rank, tcc_op_error(op));
  tcc_op_release(op);
  return r == TCC_OK ? 0 : 1;
}

/* ---- reference values ------------------------------------------------------ */

/* Element i of rank r's input: small integers, so every sum, product, min
 * and max is exact in every dtype whatever the order of the reduction. */
static inline double input_value(int r, size_t i) { return (double)(r + 1) + (double)(i % 5); }

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Exact for the small integers used here (|x| < 2048). */
static inline uint16_t f32_to_f16(float f) {
  if (f == 0) return 0;
  uint16_t sign = f < 0 ? 0x8000 : 0;
  if (f < 0) f = -f;
  int e = 0;
  while (f >= 2.0f) { f /= 2; e++; }
  while (f < 1.0f) { f *= 2; e--; }
  return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)((f - 1.0f) * 1024.0f + 0.5f));
}

static inline float f16_to_f32(uint16_t h) {
  int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float f = e == 0 ? (float)m / 1024.0f / 16384.0f : (1.0f + (float)m / 1024.0f) * (float)(1 << e) / 32768.0f;
  return (h & 0x8000) ? -f : f;
}

static inline void put_value(void *buf, size_t i, tcc_dtype_t dt, double v) {
  switch (dt) {
    case TCC_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case TCC_FLOAT64: ((double *)buf)[i] = v; break;
    case TCC_FLOAT16: ((uint16_t *)buf)[i] = f32_to_f16((float)v); break;
    case TCC_BFLOAT16: ((uint16_t *)buf)[i] = f32_to_bf16((float)v); break;
    case TCC_INT8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case TCC_UINT8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case TCC_BOOL: ((uint8_t *)buf)[i] = v != 0; break;
    case TCC_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case TCC_INT64: ((int64_t *)buf)[i] = (int64_t)v; break;
    default: break;
  }
}

static inline double get_value(const void *buf, size_t i, tcc_dtype_t dt) {
  switch (dt) {
    case TCC_FLOAT32: return ((const float *)buf)[i];
    case TCC_FLOAT64: return ((const double *)buf)[i];
    case TCC_FLOAT16: return f16_to_f32(((const uint16_t *)buf)[i]);
    case TCC_BFLOAT16: return bf16_to_f32(((const uint16_t *)buf)[i]);
    case TCC_INT8: return ((const int8_t *)buf)[i];
    case TCC_UINT8: return ((const uint8_t *)buf)[i];
    case TCC_BOOL: return ((const uint8_t *)buf)[i];
    case TCC_INT32: return ((const int32_t *)buf)[i];
    case TCC_INT64: return (double)((const int64_t *)buf)[i];
    default: return 0;
  }
}

/* A host buffer of `count` elements holding rank r's input (+ offset). */
static inline void *host_input(int r, size_t count, tcc_dtype_t dt, double offset) {
  void *h = calloc(count ? count : 1, tcc_dtype_size(dt));
  for (size_t i = 0; i < count; i++) put_value(h, i, dt, dt == TCC_BOOL ? (double)((r + i) % 2) : input_value(r, i) + offset);
  return h;
}

/* The reduction of element i over ranks 0..n-1 of host_input. */
static inline double reduced_value(int n, size_t i, tcc_dtype_t dt, tcc_redop_t op, double premul) {
  double acc = 0;
  for (int r = 0; r < n; r++) {
    double v = dt == TCC_BOOL ? (double)((r + i) % 2) : input_value(r, i);
    if (r == 0) acc = op == TCC_PREMUL_SUM ? v * premul : v;
    else if (op == TCC_SUM || op == TCC_AVG) acc += v;
    else if (op == TCC_PREMUL_SUM) acc += v * premul;
    else if (op == TCC_PRODUCT) acc *= v;
    else if (op == TCC_MIN) acc = v < acc ? v : acc;
    else if (op == TCC_MAX) acc = v > acc ? v : acc;
  }
  if (dt == TCC_BOOL) return acc != 0; /* SUM, MAX: any true; PRODUCT, MIN: all true */
  if (op == TCC_AVG) {
    if (dt == TCC_INT32 || dt == TCC_INT64 || dt == TCC_UINT8 || dt == TCC_INT8) return (double)((int64_t)acc / n);
    return acc / n;
  }
  return acc;
}

#endif /* TCC_TESTS_GPU_RANK_H */
