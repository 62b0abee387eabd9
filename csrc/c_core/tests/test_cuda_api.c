/*
 * test_cuda_api.c - the CUDA part of the public API in a core built
 * without CUDA (the default `make`): every CUDA entry point answers
 * clearly, CUDA buffers are refused before anything is queued, and the
 * communicator stays usable. (The CUDA path itself is compiled by
 * `make cuda-check` and exercised on a GPU by tests/test_cuda.py.)
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "tccomm.h"
#include "one_rank.h"

static void host_allreduce_works(tcc_comm_t *comm, const char *when) {
  float x[3] = {1, 2, 3};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allreduce(comm, buf(x, 3, -1), buf(x, 3, -1), TCC_SUM, NULL, &op);
  CHECK(r == TCC_OK, "%s: host allreduce refused: %s", when, tcc_last_error());
  if (r != TCC_OK) return;
  CHECK(tcc_op_wait(op, -1) == TCC_OK, "%s: host allreduce failed: %s", when, tcc_op_error(op));
  CHECK(!tcc_op_is_cuda(op), "a host op reports CUDA");
  CHECK(tcc_op_stream_wait(op, NULL) == TCC_OK, "stream wait on a host op must be a no-op");
  CHECK(x[0] == 1 && x[2] == 3, "%s: 1-rank allreduce changed the data", when);
  tcc_op_release(op);
}

static void cuda_buffers_refused(tcc_comm_t *comm) {
  float x[4] = {0};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allreduce(comm, buf(x, 4, 0), buf(x, 4, 0), TCC_SUM, NULL, &op);
  CHECK(r == TCC_ERR_UNSUPPORTED, "CUDA allreduce: got %s", tcc_result_string(r));
  const char *msg = tcc_last_error();
  CHECK(strstr(msg, "allreduce") && strstr(msg, "built without CUDA"), "message: %s", msg);

  r = tcc_broadcast(comm, buf(x, 4, 0), 0, NULL, &op);
  CHECK(r == TCC_ERR_UNSUPPORTED && strstr(tcc_last_error(), "broadcast"), "broadcast: %s",
        tcc_last_error());
  /* Output on CUDA, input on the host: refused at the output. */
  r = tcc_allreduce(comm, buf(x, 4, -1), buf(x, 4, 0), TCC_SUM, NULL, &op);
  CHECK(r == TCC_ERR_UNSUPPORTED, "mixed allreduce: got %s", tcc_result_string(r));
  r = tcc_allreduce(comm, buf(x, 4, -2), buf(x, 4, -2), TCC_SUM, NULL, &op);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "invalid device"), "device -2: %s",
        tcc_last_error());
}

static void cuda_calls_answer(tcc_comm_t *comm) {
  CHECK(tcc_cuda_built() == 0, "the default make builds the host-only core");
  CHECK(tcc_nccl_header_version() == 0, "no nccl.h in a host-only build");
  int v = -1;
  CHECK(tcc_nccl_runtime_version(&v) == TCC_ERR_UNSUPPORTED && v == 0, "runtime version");
  CHECK(strstr(tcc_last_error(), "without CUDA") != NULL, "runtime version message: %s", tcc_last_error());
  CHECK(tcc_comm_cuda_init(comm, 0) == TCC_ERR_UNSUPPORTED, "cuda_init must refuse");
  CHECK(strstr(tcc_last_error(), "without CUDA"), "cuda_init message: %s", tcc_last_error());
  CHECK(tcc_comm_cuda_device(comm) == -1 && tcc_comm_cuda_stream(comm) == NULL, "no CUDA state");
}

static void groups(tcc_comm_t *comm) {
  CHECK(tcc_comm_group_end(comm) == TCC_ERR_INVALID, "group end without start must fail");
  CHECK(strstr(tcc_last_error(), "without a group start"), "message: %s", tcc_last_error());
  CHECK(tcc_comm_group_start(comm) == TCC_OK, "group start");
  CHECK(tcc_comm_group_start(comm) == TCC_OK, "nested group start");
  host_allreduce_works(comm, "inside a group"); /* host ops are not deferred */
  CHECK(tcc_comm_group_end(comm) == TCC_OK, "inner group end");
  CHECK(tcc_comm_group_end(comm) == TCC_OK, "outer group end");
  CHECK(tcc_comm_group_end(comm) == TCC_ERR_INVALID, "groups are balanced again");
}

int main(void) {
  alarm(120);
  unsetenv("TCCOMM_TRANSPORT");
  tcc_comm_t *comm = one_rank_comm("cuda-api");
  CHECK(comm != NULL, "cannot create a 1-rank communicator");
  if (!comm) CHECK_DONE();
  cuda_calls_answer(comm);
  cuda_buffers_refused(comm);
  host_allreduce_works(comm, "after refused CUDA ops");
  groups(comm);
  CHECK(tcc_comm_status(comm) == TCC_OK, "refusals must not fail the communicator");
  tcc_comm_destroy(comm);
  printf("ok   cuda api (host-only build)\n");
  CHECK_DONE();
}
