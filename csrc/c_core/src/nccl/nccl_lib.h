/*
 * lib.h - the NCCL library as the core uses it (CUDA builds only).
 *
 * NCCL is never linked: the copy torch already loaded is looked up by
 * soname at run time, so the process holds one NCCL whatever the build
 * found, and a core built without CUDA needs no NCCL at all. Calls go
 * through the function table below; entries of features newer than the
 * NCCL found at run time are NULL and their users fall back or fail with
 * a message that names the version needed.
 */
#ifndef TCC_NCCL_LIB_H
#define TCC_NCCL_LIB_H

#include <nccl.h>

#include "core/internal.h"

typedef struct tcc__nccl_lib {
  int version; /* ncclGetVersion in the 2.9+ scheme, e.g. 23007 for 2.30.7 (older codes converted) */
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
  /* NULL before 2.14: no nonblocking communicators (ncomm.c) */
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *); /* 2.14 */
  /* NULL before 2.18: subgroups bootstrap their own communicator */
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *); /* 2.18 */
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommCount)(const ncclComm_t, int *);
  ncclResult_t (*CommUserRank)(const ncclComm_t, int *);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*GroupStart)(void);
  ncclResult_t (*GroupEnd)(void);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                cudaStream_t);
  ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  /* NULL when the NCCL found at run time is older than the feature */
  ncclResult_t (*RedOpCreatePreMulSum)(ncclRedOp_t *, void *, ncclDataType_t, ncclScalarResidence_t,
                                       ncclComm_t);                                 /* 2.11 */
  ncclResult_t (*RedOpDestroy)(ncclRedOp_t, ncclComm_t);                           /* 2.11 */
  ncclResult_t (*AlltoAll)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Gather)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Scatter)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
} tcc__nccl_lib_t;

/* Versions (NCCL_VERSION_CODE scheme of 2.9+) that gate features. */
#define TCC_NCCL_V(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))
#define TCC_NCCL_MIN_VERSION TCC_NCCL_V(2, 7, 0)  /* send/recv */
#define TCC_NCCL_BF16_VERSION TCC_NCCL_V(2, 10, 0)
#define TCC_NCCL_AVG_VERSION TCC_NCCL_V(2, 10, 0)
#define TCC_NCCL_PREMUL_VERSION TCC_NCCL_V(2, 11, 0)
#define TCC_NCCL_CONFIG_VERSION TCC_NCCL_V(2, 14, 0) /* ncclCommInitRankConfig, nonblocking */
#define TCC_NCCL_SPLIT_VERSION TCC_NCCL_V(2, 18, 0)  /* ncclCommSplit (with a config) */

/* A code of ncclGetVersion in the 2.9+ scheme: before 2.9 NCCL reported
 * major*1000 + minor*100 + patch (2.8.4 was 2804). */
int tcc__nccl_version_normalize(int code);

/* Loads NCCL once per process (the copy already in the process first) and
 * returns its table, or NULL with err set (the message says what is missing). */
const tcc__nccl_lib_t *tcc__nccl_lib(tcc_err_t *err);

/* "2.30.7" for 23007 (a normalized code). */
void tcc__nccl_version_string(int version, char *out, size_t len);

#endif /* TCC_NCCL_LIB_H */
