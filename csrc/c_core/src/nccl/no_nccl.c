/*
 * no_nccl.c - the device executor of a build without CUDA: the build
 * links this file instead of the rest of nccl/. Every CUDA buffer is
 * rejected with a message saying so, and the public CUDA calls report that
 * CUDA is missing, so no caller needs an #ifdef.
 */
#include <stdio.h>

#include "core/executor.h"

int tcc_cuda_built(void) { return 0; }
int tcc_nccl_header_version(void) { return 0; }

tcc_result_t tcc_nccl_runtime_version(int *version) {
  *version = 0;
  return tcc__fail(TCC_ERR_UNSUPPORTED, "tccomm was built without CUDA");
}

tcc_result_t tcc_comm_cuda_init(tcc_comm_t *comm, int device) {
  return tcc__fail(TCC_ERR_UNSUPPORTED, "tccomm '%s': cannot use CUDA device %d: tccomm was built without CUDA",
                   comm->name, device);
}

int tcc_comm_cuda_device(const tcc_comm_t *comm) {
  (void)comm;
  return -1;
}

void *tcc_comm_cuda_stream(const tcc_comm_t *comm) {
  (void)comm;
  return NULL;
}

tcc_result_t tcc_comm_cuda_synchronize(tcc_comm_t *comm, int64_t timeout_ms) {
  (void)comm;
  (void)timeout_ms;
  return TCC_OK; /* no CUDA op can have been issued */
}

tcc_result_t tcc_comm_cuda_split(tcc_comm_t *parent, int color, tcc_comm_t *child, int *split_done) {
  (void)parent;
  (void)color;
  (void)child;
  if (split_done) *split_done = 0;
  return TCC_OK; /* no NCCL communicator to split: nothing to share */
}

/* A CUDA buffer is refused by none_accepts when the op is validated, so
 * nothing reaches the rest; they fail safely if it does. */
static tcc_result_t none_attach(tcc_comm_t *comm, tcc_err_t *err) {
  (void)comm;
  (void)err;
  return TCC_OK;
}

static tcc_result_t none_accepts(tcc_comm_t *comm, const char *what, const char *role, int device) {
  return tcc__fail(TCC_ERR_UNSUPPORTED,
                   "tccomm %s on '%s': %s buffer is on CUDA device %d, but tccomm was built without CUDA", what,
                   comm->name, role, device);
}

static tcc_result_t none_submit(tcc_comm_t *comm, tcc_op_t *op, void *stream, tcc_err_t *err) {
  (void)stream;
  return tcc__err_set(err, TCC_ERR_UNSUPPORTED,
                     "tccomm %s on '%s': buffers on CUDA device %d, but tccomm was built without CUDA",
                     tcc__op_name(op), comm->name, op->device);
}

static int none_test(tcc_op_t *op) { return atomic_load(&op->finished); }

static tcc_result_t none_wait(tcc_op_t *op, int64_t timeout_ms) {
  return tcc__op_await(op, timeout_ms);
}

static void none_start(tcc_op_t *op) { (void)op; }

static tcc_result_t none_stream_wait(tcc_op_t *op, void *stream) {
  (void)op;
  (void)stream;
  return TCC_OK;
}

static void none_op_free(tcc_op_t *op) { (void)op; }
static void none_comm(tcc_comm_t *comm) { (void)comm; }

static tcc_result_t none_group_end(tcc_comm_t *comm, tcc_err_t *err) {
  (void)comm;
  (void)err;
  return TCC_OK;
}

const tcc__executor_t tcc__device_executor = {
    .name = "none",
    .memory_name = "CUDA device",
    .accepts = none_accepts,
    .attach = none_attach,
    .submit = none_submit,
    .test = none_test,
    .wait = none_wait,
    .start = none_start,
    .stream_wait = none_stream_wait,
    .op_free = none_op_free,
    .wake = none_comm,
    .group_end = none_group_end,
    .stop = none_comm,
    .release = none_comm,
};
