/*
 * test_cuda_nogpu.c - the core built WITH its CUDA path, on a machine
 * without a usable GPU (make cuda-test). NCCL is loaded for real (by
 * soname) and the CUDA runtime answers "no device": CUDA ops must fail
 * with a clear message naming the op and the cause, the host path must be
 * unaffected, and nothing may crash or hang. With a GPU present it only
 * checks what holds everywhere (the GPU behaviour is tests/test_cuda.py's).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "../check.h"
#include "tccomm.h"
#include "../one_rank.h"

int main(void) {
  alarm(120);
  unsetenv("TCCOMM_TRANSPORT");
  CHECK(tcc_cuda_built() == 1, "built with the NCCL executor");
  CHECK(tcc_nccl_header_version() >= 20700, "header version %d", tcc_nccl_header_version());
  int v = 0;
  tcc_result_t r = tcc_nccl_runtime_version(&v);
  CHECK(r == TCC_OK && v >= 20700, "loading NCCL: %s (version %d)", tcc_last_error(), v);
  printf("NCCL %d (header %d)\n", v, tcc_nccl_header_version());

  tcc_comm_t *comm = one_rank_comm("cuda-nogpu");
  CHECK(comm != NULL, "cannot create a 1-rank communicator");
  if (!comm) CHECK_DONE();
  float host[4] = {1, 2, 3, 4};
  tcc_op_t *op = NULL;
  /* Mixing host and CUDA buffers is refused before anything else. */
  r = tcc_allreduce(comm, buf(host, 4, -1), buf(host, 4, 0), TCC_SUM, NULL, &op);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "mixes host memory and CUDA device 0"),
        "mixed: %s", tcc_last_error());
  r = tcc_allreduce(comm, buf(host, 4, 0), buf(host, 4, 1), TCC_SUM, NULL, &op);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "CUDA device 0 and CUDA device 1"),
        "two devices: %s", tcc_last_error());

  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    /* No GPU: the first CUDA op (which would create the NCCL communicator) says so. */
    r = tcc_allreduce(comm, buf(host, 4, 0), buf(host, 4, 0), TCC_SUM, NULL, &op);
    const char *msg = tcc_last_error();
    CHECK(r == TCC_ERR_UNSUPPORTED && strstr(msg, "no usable CUDA device") && strstr(msg, "cuda-nogpu"),
          "CUDA op without a GPU: %s (%s)", msg, tcc_result_string(r));
    CHECK(tcc_comm_cuda_init(comm, 0) == TCC_ERR_UNSUPPORTED, "eager init without a GPU must fail");
    CHECK(strstr(tcc_last_error(), "no usable CUDA device"), "%s", tcc_last_error());
    CHECK(tcc_comm_cuda_device(comm) == -1, "no CUDA state after a failed init");
  } else {
    printf("a GPU is present: the no-GPU checks are skipped\n");
  }
  /* The host path is unaffected. */
  r = tcc_allreduce(comm, buf(host, 4, -1), buf(host, 4, -1), TCC_SUM, NULL, &op);
  CHECK(r == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "host allreduce after CUDA refusals: %s",
        tcc_last_error());
  if (r == TCC_OK) tcc_op_release(op);
  CHECK(tcc_comm_status(comm) == TCC_OK, "refusals must not fail the communicator");
  tcc_comm_destroy(comm);
  printf("ok   cuda path without a GPU\n");
  CHECK_DONE();
}
