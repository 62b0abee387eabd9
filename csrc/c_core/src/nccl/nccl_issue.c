/*
 * nccl_issue.c - one op of the core as NCCL calls on the communicator's stream.
 *
 * Native NCCL collectives where they exist (AllReduce, Broadcast, Reduce,
 * AllGather, ReduceScatter). Gather, scatter and all-to-all(-v) are grouped
 * Send/Recv on every NCCL: which path a rank takes must not depend on
 * anything only that rank sees (its buffer layout), or ranks would issue
 * different NCCL calls and hang; ncclGather/ncclScatter/ncclAlltoAll are
 * themselves grouped point-to-point and take uniform counts only. For the
 * same reason, per-peer buffers that are not one consecutive block are
 * staged through one (AllGather into it, ReduceScatter out of it) rather
 * than switching to another algorithm.
 *
 * Data that is only moved (broadcast, gathers, point-to-point) travels as
 * bytes, so every dtype works; reductions map the dtype and op to NCCL's
 * and fail, before anything is enqueued, for what NCCL cannot reduce.
 */
#include "nccl/nccl_state.h"

#include <stdio.h>
#include <string.h>

static inline ncclComm_t handle(tcc__ncomm_t *ncomm) { return atomic_load(&ncomm->nc); }

static tcc_result_t nccl_failed(tcc_comm_t *comm, tcc__ncomm_t *ncomm, const tcc_op_t *op, const char *call,
                                ncclResult_t r, tcc_err_t *err) {
  (void)comm;
  return tcc__ncomm_failed(ncomm, tcc__op_name(op), call, r, err);
}

static tcc_result_t cuda_failed(tcc_comm_t *comm, const tcc_op_t *op, const char *call, cudaError_t e,
                                tcc_err_t *err) {
  return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm %s on '%s' (rank %d): %s failed: %s", tcc__op_name(op),
                     comm->name, comm->rank, call, cudaGetErrorString(e));
}

#define NCCL_TRY(call_name, expr)                                      \
  do {                                                                 \
    ncclResult_t nccl_r_ = (expr);                                     \
    if (nccl_r_ != ncclSuccess && nccl_r_ != ncclInProgress)           \
      return nccl_failed(comm, ncomm, op, call_name, nccl_r_, err);        \
  } while (0)

#define CUDA_TRY(call_name, expr)                                      \
  do {                                                                 \
    cudaError_t cuda_e_ = (expr);                                      \
    if (cuda_e_ != cudaSuccess) return cuda_failed(comm, op, call_name, cuda_e_, err); \
  } while (0)

static tcc_result_t unsupported(tcc_comm_t *comm, const tcc_op_t *op, const char *why, tcc_err_t *err) {
  return tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm %s on '%s' (rank %d): %s", tcc__op_name(op),
                     comm->name, comm->rank, why);
}

static void version_str(int v, char *out, size_t len) { tcc__nccl_version_string(v, out, len); }

/* ---- dtype and reduce op -------------------------------------------------- */

static tcc_result_t map_dtype(tcc_comm_t *comm, tcc__ncomm_t *ncomm, const tcc_op_t *op, tcc_dtype_t dt,
                              ncclDataType_t *out, tcc_err_t *err) {
  switch (dt) {
    case TCC_FLOAT32: *out = ncclFloat32; return TCC_OK;
    case TCC_FLOAT64: *out = ncclFloat64; return TCC_OK;
    case TCC_FLOAT16: *out = ncclFloat16; return TCC_OK;
    case TCC_BFLOAT16: {
      if (ncomm->nccl->version < TCC_NCCL_BF16_VERSION) {
        char have[32], msg[160];
        version_str(ncomm->nccl->version, have, sizeof have);
        snprintf(msg, sizeof msg, "bfloat16 reductions need NCCL >= 2.10; this process has NCCL %s", have);
        return unsupported(comm, op, msg, err);
      }
      *out = ncclBfloat16;
      return TCC_OK;
    }
    case TCC_INT8: *out = ncclInt8; return TCC_OK;
    case TCC_INT32: *out = ncclInt32; return TCC_OK;
    case TCC_INT64: *out = ncclInt64; return TCC_OK;
    case TCC_UINT8: *out = ncclUint8; return TCC_OK;
    case TCC_BOOL: *out = ncclUint8; return TCC_OK; /* 0/1 bytes; the ops are mapped below */
    case TCC_INT16:
      return unsupported(comm, op, "NCCL cannot reduce int16 tensors (it has no 16-bit integer type); "
                                   "use int32, or CPU tensors", err);
    default:
      return unsupported(comm, op, "unknown dtype", err);
  }
}

/* The NCCL op for (dtype, redop). *created is set when the op is a
 * PreMulSum the caller must destroy after the call. */
static tcc_result_t map_redop(tcc_comm_t *comm, tcc__ncomm_t *ncomm, const tcc_op_t *op, ncclDataType_t t,
                              ncclRedOp_t *out, int *created, tcc_err_t *err) {
  const tcc_dtype_t dt = op->coll.dtype;
  const tcc_redop_t r = op->coll.redop;
  *created = 0;
  if (dt == TCC_BOOL) {
    /* On 0/1 bytes: any-true is MAX, all-true is MIN (as torch's NCCL backend does). */
    switch (r) {
      case TCC_SUM: case TCC_MAX: case TCC_BOR: *out = ncclMax; return TCC_OK;
      case TCC_PRODUCT: case TCC_MIN: case TCC_BAND: *out = ncclMin; return TCC_OK;
      default:
        return unsupported(comm, op, "NCCL cannot apply this reduce op to bool (supported: SUM, PRODUCT, "
                                     "MIN, MAX, BAND, BOR)", err);
    }
  }
  char have[32], msg[200];
  version_str(ncomm->nccl->version, have, sizeof have);
  switch (r) {
    case TCC_SUM: *out = ncclSum; return TCC_OK;
    case TCC_PRODUCT: *out = ncclProd; return TCC_OK;
    case TCC_MIN: *out = ncclMin; return TCC_OK;
    case TCC_MAX: *out = ncclMax; return TCC_OK;
    case TCC_AVG:
      if (ncomm->nccl->version < TCC_NCCL_AVG_VERSION) {
        snprintf(msg, sizeof msg, "AVG needs NCCL >= 2.10 (ncclAvg); this process has NCCL %s", have);
        return unsupported(comm, op, msg, err);
      }
      *out = ncclAvg;
      return TCC_OK;
    case TCC_BAND: case TCC_BOR: case TCC_BXOR:
      snprintf(msg, sizeof msg, "NCCL has no bitwise reductions (%s on %s); only bool tensors take BAND/BOR "
                                "on CUDA", tcc_redop_name(r), tcc_dtype_name(dt));
      return unsupported(comm, op, msg, err);
    case TCC_PREMUL_SUM: {
      if (!ncomm->nccl->RedOpCreatePreMulSum || !ncomm->nccl->RedOpDestroy) {
        snprintf(msg, sizeof msg, "PREMUL_SUM needs NCCL >= 2.11 (ncclRedOpCreatePreMulSum); this process "
                                  "has NCCL %s", have);
        return unsupported(comm, op, msg, err);
      }
      /* The scalar has the tensor's type. A device factor is read by the
       * kernel (no host sync, legal while capturing, as ProcessGroupNCCL
       * passes it); a host one is copied by NCCL during this call. */
      if (op->coll.premul_device) {
        NCCL_TRY("ncclRedOpCreatePreMulSum",
                 ncomm->nccl->RedOpCreatePreMulSum(out, (void *)op->coll.premul_device, t, ncclScalarDevice,
                                                   handle(ncomm)));
        *created = 1;
        return TCC_OK;
      }
      union { float f; double d; uint16_t h; } scalar;
      if (dt == TCC_FLOAT32) scalar.f = (float)op->coll.premul;
      else if (dt == TCC_FLOAT64) scalar.d = op->coll.premul;
      else {
        /* float16 / bfloat16: 1.0 x factor, rounded the way the host path rounds. */
        const uint16_t one = dt == TCC_FLOAT16 ? 0x3C00 : 0x3F80;
        const void *src = &one;
        tcc__reduce_n(&scalar.h, &src, 1, 1, dt, TCC_PREMUL_SUM, op->coll.premul);
      }
      NCCL_TRY("ncclRedOpCreatePreMulSum",
               ncomm->nccl->RedOpCreatePreMulSum(out, &scalar, t, ncclScalarHostImmediate, handle(ncomm)));
      *created = 1;
      return TCC_OK;
    }
    default:
      return unsupported(comm, op, "unknown reduce op", err);
  }
}

/* ---- helpers ------------------------------------------------------------------ */

/* True when bufs[j] == bufs[0] + j * bytes for every j: one block. */
static int consecutive(void *const *bufs, int n, size_t bytes) {
  for (int j = 1; j < n; j++)
    if ((char *)bufs[j] != (char *)bufs[0] + (size_t)j * bytes) return 0;
  return 1;
}

static tcc_result_t copy_async(tcc_comm_t *comm, tcc__ncomm_t *ncomm, const tcc_op_t *op, void *dst,
                               const void *src, size_t bytes, tcc_err_t *err) {
  if (!bytes || dst == src) return TCC_OK;
  CUDA_TRY("cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ncomm->stream));
  return TCC_OK;
}

/* Stream-ordered staging memory (legal during graph capture, unlike
 * cudaMalloc): the embedding program's allocator (torch's caching
 * allocator), else cudaMallocAsync. */
static tcc_result_t stage_alloc(tcc_comm_t *comm, tcc__ncomm_t *ncomm, tcc_op_t *op, size_t bytes,
                                tcc_err_t *err) {
  const tcc_device_allocator_t *a = tcc__device_allocator();
  if (a) {
    nccl_op_of(op)->tmp = a->alloc(a->ctx, bytes, op->device, ncomm->stream);
    if (!nccl_op_of(op)->tmp)
      return tcc__err_set(err, TCC_ERR_SYSTEM,
                          "tccomm %s on '%s' (rank %d): the device allocator could not provide %zu bytes of staging "
                          "memory on CUDA device %d",
                          tcc__op_name(op), comm->name, comm->rank, bytes, op->device);
    return TCC_OK;
  }
  CUDA_TRY("cudaMallocAsync", cudaMallocAsync(&nccl_op_of(op)->tmp, bytes, ncomm->stream));
  return TCC_OK;
}

cudaError_t tcc__cuda_stage_free(tcc_op_t *op, tcc__ncomm_t *ncomm) {
  void *tmp = nccl_op_of(op)->tmp;
  nccl_op_of(op)->tmp = NULL;
  if (!tmp) return cudaSuccess;
  const tcc_device_allocator_t *a = tcc__device_allocator();
  if (a) {
    a->free(a->ctx, tmp, op->device, ncomm->stream);
    return cudaSuccess;
  }
  return cudaFreeAsync(tmp, ncomm->stream);
}

/* ---- collectives ---------------------------------------------------------- */

static tcc_result_t issue_reduction(tcc_comm_t *comm, tcc__ncomm_t *ncomm, tcc_op_t *op, tcc_err_t *err) {
  const tcc_coll_t *k = &op->coll;
  const int n = comm->size;
  const size_t bytes = k->count * tcc__dtype_size(k->dtype);
  ncclDataType_t t = ncclInt8;
  ncclRedOp_t rop = ncclSum;
  int created = 0;
  tcc_result_t r = map_dtype(comm, ncomm, op, k->dtype, &t, err);
  if (r == TCC_OK) r = map_redop(comm, ncomm, op, t, &rop, &created, err);
  if (r != TCC_OK) return r;
  ncclResult_t nr = ncclSuccess;
  const char *call = "";
  if (k->kind == TCC_COLL_ALLREDUCE) {
    call = "ncclAllReduce";
    nr = ncomm->nccl->AllReduce(k->send, k->recv, k->count, t, rop, handle(ncomm), ncomm->stream);
  } else if (k->kind == TCC_COLL_REDUCE) {
    call = "ncclReduce"; /* recv is only read on the root */
    nr = ncomm->nccl->Reduce(k->send, k->recv ? k->recv : k->send, k->count, t, rop, k->root, handle(ncomm), ncomm->stream);
  } else {
    call = "ncclReduceScatter";
    const void *src = k->sends[0];
    if (bytes && !consecutive(k->sends, n, bytes)) {
      r = stage_alloc(comm, ncomm, op, (size_t)n * bytes, err);
      for (int j = 0; j < n && r == TCC_OK; j++)
        r = copy_async(comm, ncomm, op, (char *)nccl_op_of(op)->tmp + (size_t)j * bytes, k->sends[j], bytes, err);
      src = nccl_op_of(op)->tmp;
    }
    if (r == TCC_OK) nr = ncomm->nccl->ReduceScatter(src, k->recv, k->count, t, rop, handle(ncomm), ncomm->stream);
  }
  if (created) ncomm->nccl->RedOpDestroy(rop, handle(ncomm)); /* legal right after the last call using it */
  if (r != TCC_OK) return r;
  NCCL_TRY(call, nr);
  return TCC_OK;
}

static tcc_result_t issue_allgather(tcc_comm_t *comm, tcc__ncomm_t *ncomm, tcc_op_t *op, tcc_err_t *err) {
  const tcc_coll_t *k = &op->coll;
  const int n = comm->size;
  const size_t bytes = k->count * tcc__dtype_size(k->dtype);
  void *dst = k->recvs[0];
  if (bytes && !consecutive(k->recvs, n, bytes)) {
    tcc_result_t r = stage_alloc(comm, ncomm, op, (size_t)n * bytes, err);
    if (r != TCC_OK) return r;
    dst = nccl_op_of(op)->tmp; /* copied out in tcc__cuda_post */
  }
  NCCL_TRY("ncclAllGather", ncomm->nccl->AllGather(k->send, dst, bytes, ncclInt8, handle(ncomm), ncomm->stream));
  return TCC_OK;
}

/* Gather, scatter and all-to-all as one group of sends and receives; the
 * part a rank keeps for itself is a device copy. */
static tcc_result_t issue_grouped(tcc_comm_t *comm, tcc__ncomm_t *ncomm, tcc_op_t *op, tcc_err_t *err) {
  const tcc_coll_t *k = &op->coll;
  const int n = comm->size, me = comm->rank;
  const size_t es = tcc__dtype_size(k->dtype), bytes = k->count * es;
  const tcc__nccl_lib_t *L = ncomm->nccl;
  tcc_result_t r = TCC_OK;
  ncclResult_t nr = ncclSuccess;
  const char *call = "";
  NCCL_TRY("ncclGroupStart", L->GroupStart());
  if (k->kind == TCC_COLL_GATHER) {
    if (me != k->root) {
      call = "ncclSend";
      nr = L->Send(k->send, bytes, ncclInt8, k->root, handle(ncomm), ncomm->stream);
    } else {
      for (int j = 0; j < n && r == TCC_OK && nr == ncclSuccess; j++) {
        if (j == me) r = copy_async(comm, ncomm, op, k->recvs[j], k->send, bytes, err);
        else { call = "ncclRecv"; nr = L->Recv(k->recvs[j], bytes, ncclInt8, j, handle(ncomm), ncomm->stream); }
      }
    }
  } else if (k->kind == TCC_COLL_SCATTER) {
    if (me != k->root) {
      call = "ncclRecv";
      nr = L->Recv(k->recv, bytes, ncclInt8, k->root, handle(ncomm), ncomm->stream);
    } else {
      for (int j = 0; j < n && r == TCC_OK && nr == ncclSuccess; j++) {
        if (j == me) r = copy_async(comm, ncomm, op, k->recv, k->sends[j], bytes, err);
        else { call = "ncclSend"; nr = L->Send(k->sends[j], bytes, ncclInt8, j, handle(ncomm), ncomm->stream); }
      }
    }
  } else { /* ALLTOALL: per-peer counts; a zero count on one side is zero on the other */
    for (int j = 0; j < n && r == TCC_OK && nr == ncclSuccess; j++) {
      const size_t sb = k->send_counts[j] * es, rb = k->recv_counts[j] * es;
      if (j == me) { r = copy_async(comm, ncomm, op, k->recvs[j], k->sends[j], sb, err); continue; }
      if (sb) { call = "ncclSend"; nr = L->Send(k->sends[j], sb, ncclInt8, j, handle(ncomm), ncomm->stream); }
      if (rb && nr == ncclSuccess) { call = "ncclRecv"; nr = L->Recv(k->recvs[j], rb, ncclInt8, j, handle(ncomm), ncomm->stream); }
    }
  }
  /* The group is always closed, whatever failed inside it. */
  ncclResult_t end = L->GroupEnd();
  if (r != TCC_OK) return r;
  NCCL_TRY(call, nr);
  NCCL_TRY("ncclGroupEnd", end);
  return TCC_OK;
}

tcc_result_t tcc__cuda_issue(tcc_comm_t *comm, tcc__ncomm_t *ncomm, tcc_op_t *op, tcc_err_t *err) {
  if (op->kind == TCC_OP_SEND) {
    NCCL_TRY("ncclSend", ncomm->nccl->Send(op->buf, op->bytes, ncclInt8, nccl_op_of(op)->nccl_peer, handle(ncomm), ncomm->stream));
    return TCC_OK;
  }
  if (op->kind == TCC_OP_RECV) {
    NCCL_TRY("ncclRecv", ncomm->nccl->Recv(op->buf, op->bytes, ncclInt8, nccl_op_of(op)->nccl_peer, handle(ncomm), ncomm->stream));
    return TCC_OK;
  }
  const tcc_coll_t *k = &op->coll;
  switch (k->kind) {
    case TCC_COLL_BROADCAST:
      NCCL_TRY("ncclBroadcast", ncomm->nccl->Broadcast(k->send, k->recv, k->count * tcc__dtype_size(k->dtype),
                                                   ncclInt8, k->root, handle(ncomm), ncomm->stream));
      return TCC_OK;
    case TCC_COLL_ALLREDUCE:
    case TCC_COLL_REDUCE:
    case TCC_COLL_REDUCE_SCATTER:
      return issue_reduction(comm, ncomm, op, err);
    case TCC_COLL_ALLGATHER:
      return issue_allgather(comm, ncomm, op, err);
    case TCC_COLL_GATHER:
    case TCC_COLL_SCATTER:
    case TCC_COLL_ALLTOALL:
      return issue_grouped(comm, ncomm, op, err);
    case TCC_COLL_BARRIER:
      break;
  }
  return unsupported(comm, op, "this collective has no CUDA form", err);
}

tcc_result_t tcc__cuda_post(tcc_comm_t *comm, tcc__ncomm_t *ncomm, tcc_op_t *op, tcc_err_t *err) {
  if (!nccl_op_of(op)->tmp) return TCC_OK;
  tcc_result_t r = TCC_OK;
  if (op->kind == TCC_OP_COLL && op->coll.kind == TCC_COLL_ALLGATHER) {
    const size_t bytes = op->coll.count * tcc__dtype_size(op->coll.dtype);
    for (int j = 0; j < comm->size && r == TCC_OK; j++)
      r = copy_async(comm, ncomm, op, op->coll.recvs[j], (char *)nccl_op_of(op)->tmp + (size_t)j * bytes, bytes, err);
  }
  cudaError_t e = tcc__cuda_stage_free(op, ncomm);
  if (r != TCC_OK) return r;
  CUDA_TRY("freeing the staging memory", e);
  return TCC_OK;
}
