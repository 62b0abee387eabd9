/*
 * fuzz_p2p_frame.c - the header of every point-to-point message
 * (tcc__p2p_frame_check), as a peer's byte stream delivers it.
 *
 * Input: any number of 24-byte headers, back to back. Each one must either
 * be rejected with a message that names the sending rank, or be exactly
 * what tcc__p2p_frame_make writes for its tag and length (so nothing but a
 * real frame gets through). Each header's tag and length, made into a
 * frame, must also pass: the check never refuses what a sender writes.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "host/p2p_frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  tcc_comm_t *comm = calloc(1, sizeof *comm);
  if (!comm) abort();
  comm->size = 4;
  comm->rank = 1;
  snprintf(comm->name, sizeof comm->name, "fuzz");
  fuzz_in_t in = {data, size};
  do {
    tcc_p2p_frame_t got, made;
    fuzz_take(&in, &got, sizeof got);
    tcc_err_t err = {TCC_OK, {0}};
    if (tcc__p2p_frame_check(comm, 3, &got, &err) == TCC_OK) {
      tcc__p2p_frame_make(&made, got.tag, got.bytes);
      assert(memcmp(&made, &got, sizeof got) == 0);
    } else {
      assert(err.code == TCC_ERR_REMOTE && strstr(err.msg, "from rank 3") && strstr(err.msg, "'fuzz' (rank 1)"));
    }
    tcc__p2p_frame_make(&made, got.tag, got.bytes % (TCC_P2P_FRAME_MAX_BYTES + 1));
    err.code = TCC_OK;
    assert(tcc__p2p_frame_check(comm, 3, &made, &err) == TCC_OK);
  } while (in.left > 0);
  free(comm);
  return 0;
}
