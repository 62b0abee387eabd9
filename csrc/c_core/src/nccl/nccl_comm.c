/*
 * comm.c - the NCCL side of a communicator: its per-communicator state,
 * setting NCCL up on the first CUDA op, tearing it down, and the public
 * CUDA calls.
 *
 * Bootstrap: rank 0 creates the ncclUniqueId and broadcasts it over the
 * group's own host path (the host executor), so NCCL needs no store of its
 * own and the exchange is bounded by the group's timeout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nccl/nccl_state.h"

int tcc_cuda_built(void) { return 1; }
int tcc_nccl_header_version(void) { return NCCL_VERSION_CODE; }

tcc_result_t tcc_nccl_runtime_version(int *version) {
  tcc_err_t err = {TCC_OK, {0}};
  const tcc_nccl_lib_t *lib = tcc_nccl_lib(&err);
  *version = lib ? lib->version : 0;
  return lib ? TCC_OK : tcc__fail_with(&err, err.code);
}

cudaError_t tcc_cuda_enter_device(int device, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e != cudaSuccess) return e;
  return *prev == device ? cudaSuccess : cudaSetDevice(device);
}

void tcc_cuda_leave_device(int device, int prev) {
  if (prev != device) cudaSetDevice(prev);
}

/* Shares rank 0's ncclUniqueId (with a status byte: rank 0 may fail to
 * make one, and the others must hear that rather than time out). */
static tcc_result_t share_unique_id(tcc_comm_t *comm, const tcc_nccl_lib_t *lib, ncclUniqueId *id,
                                    tcc_err_t *err) {
  uint8_t msg[1 + sizeof(ncclUniqueId)];
  memset(msg, 0, sizeof msg);
  ncclResult_t nr = ncclSuccess;
  if (comm->rank == 0) {
    nr = lib->GetUniqueId(id);
    msg[0] = nr == ncclSuccess ? 1 : 0;
    if (nr == ncclSuccess) memcpy(msg + 1, id, sizeof *id);
  }
  tcc_buf_t b = {msg, sizeof msg, TCC_UINT8, -1, NULL};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_broadcast(comm, b, 0, NULL, &op);
  if (r != TCC_OK)
    return tcc__err_set(err, r, "tccomm '%s' (rank %d): sharing the NCCL unique id failed: %s", comm->name,
                       comm->rank, tcc_last_error());
  r = tcc_op_wait(op, -1);
  if (r != TCC_OK)
    tcc__err_set(err, r, "tccomm '%s' (rank %d): sharing the NCCL unique id failed: %s", comm->name, comm->rank,
                tcc_op_error(op));
  tcc_op_release(op);
  if (r != TCC_OK) return r;
  if (msg[0] != 1)
    return tcc__err_set(err, TCC_ERR_REMOTE, "tccomm '%s' (rank %d): rank 0 could not create an NCCL unique id%s%s",
                       comm->name, comm->rank, comm->rank == 0 ? ": " : "",
                       comm->rank == 0 ? lib->GetErrorString(nr) : "");
  memcpy(id, msg + 1, sizeof *id);
  return TCC_OK;
}

static void free_state(struct tcc_cuda *c) {
  if (c->order_event) cudaEventDestroy(c->order_event);
  if (c->stream) cudaStreamDestroy(c->stream);
  free(c);
}

/* Sets up the NCCL side for `device`. Caller holds the lock. Collective. */
static tcc_result_t cuda_init_locked(tcc_comm_t *comm, int device, tcc_err_t *err) {
  const tcc_nccl_lib_t *lib = tcc_nccl_lib(err);
  if (!lib) return err->code;
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0)
    return tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm '%s' (rank %d): no usable CUDA device: %s", comm->name,
                       comm->rank, e != cudaSuccess ? cudaGetErrorString(e) : "the device count is 0");
  if (device < 0 || device >= ndev)
    return tcc__err_set(err, TCC_ERR_INVALID, "tccomm '%s' (rank %d): CUDA device %d does not exist (%d visible)",
                       comm->name, comm->rank, device, ndev);
  ncclUniqueId id;
  tcc_result_t r = share_unique_id(comm, lib, &id, err);
  if (r != TCC_OK) return r;

  struct tcc_cuda *c = calloc(1, sizeof *c);
  if (!c) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  c->nccl = lib;
  c->device = device;
  int prev = device;
  e = tcc_cuda_enter_device(device, &prev);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->order_event, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    tcc_cuda_leave_device(device, prev);
    free_state(c);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): setting up CUDA device %d failed: %s",
                       comm->name, comm->rank, device, cudaGetErrorString(e));
  }
  ncclResult_t nr = lib->CommInitRank(&c->nc, comm->size, id, comm->rank);
  tcc_cuda_leave_device(device, prev);
  if (nr != ncclSuccess) {
    free_state(c);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm '%s' (rank %d): ncclCommInitRank on CUDA device %d failed: %s",
                       comm->name, comm->rank, device, lib->GetErrorString(nr));
  }
  atomic_store(&nccl_comm_of(comm)->state, c); /* before the watchdog starts: it reads it */
  r = tcc_cuda_watch_start(comm, c, err);
  if (r != TCC_OK) {
    atomic_store(&nccl_comm_of(comm)->state, NULL);
    lib->CommDestroy(c->nc);
    free_state(c);
  }
  return r;
}

struct tcc_cuda *tcc_cuda_state_for(tcc_comm_t *comm, int device, const char *what, tcc_err_t *err) {
  struct tcc_cuda *c = nccl_state_of(comm);
  if (!c) {
    if (cuda_init_locked(comm, device, err) != TCC_OK) return NULL;
    c = nccl_state_of(comm);
  }
  if (c->device != device) {
    tcc__err_set(err, TCC_ERR_INVALID,
                "tccomm %s on '%s' (rank %d): the buffers are on CUDA device %d but this group uses device %d "
                "(one device per process and group)",
                what, comm->name, comm->rank, device, c->device);
    return NULL;
  }
  return c;
}

void tcc_cuda_state_free(tcc_comm_t *comm, struct tcc_cuda *c) {
  int prev = c->device;
  tcc_cuda_enter_device(c->device, &prev);
  if (c->nccl_aborted || atomic_load(&comm->aborted)) {
    if (!c->nccl_aborted) c->nccl->CommAbort(c->nc);
  } else {
    c->nccl->CommDestroy(c->nc);
  }
  const int device = c->device;
  cudaStreamSynchronize(c->stream);
  atomic_store(&nccl_comm_of(comm)->state, NULL);
  free_state(c);
  tcc_cuda_leave_device(device, prev);
}

/* ---- public calls ---------------------------------------------------------- */

tcc_result_t tcc_comm_cuda_init(tcc_comm_t *comm, int device) {
  tcc_err_t err = {TCC_OK, {0}};
  pthread_mutex_lock(&nccl_comm_of(comm)->lock);
  struct tcc_cuda *c = tcc_cuda_state_for(comm, device, "cuda_init", &err);
  pthread_mutex_unlock(&nccl_comm_of(comm)->lock);
  return c ? TCC_OK : tcc__fail_with(&err, err.code);
}

int tcc_comm_cuda_device(const tcc_comm_t *comm) {
  struct tcc_cuda *c = nccl_state_of((tcc_comm_t *)comm);
  return c ? c->device : -1;
}

void *tcc_comm_cuda_stream(const tcc_comm_t *comm) {
  struct tcc_cuda *c = nccl_state_of((tcc_comm_t *)comm);
  return c ? (void *)c->stream : NULL;
}
