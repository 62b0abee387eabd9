/*
 * fuzz_p2p_frame.c - the header of every point-to-point frame
 * (tcc__p2p_frame_check) and the reference after a reference frame's
 * (tcc__p2p_ref_check), as a peer's byte stream delivers them.
 *
 * Input: any number of 24-byte headers, each a reference's 24 bytes after
 * it, back to back. Each header must either be rejected with a message
 * that names the sending rank, or be exactly what tcc__p2p_frame_make
 * writes for its kind, tag and length (so nothing but a real frame gets
 * through); each reference likewise with tcc__p2p_ref_make. Each header's
 * tag and length, made into a frame of every kind that may carry them,
 * must also pass: the check never refuses what a sender writes.
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
    tcc_p2p_ref_t ref, ref_made;
    fuzz_take(&in, &got, sizeof got);
    fuzz_take(&in, &ref, sizeof ref);
    tcc_err_t err = {TCC_OK, {0}};
    if (tcc__p2p_frame_check(comm, 3, &got, &err) == TCC_OK) {
      tcc__p2p_frame_make(&made, tcc__p2p_frame_kind(&got), got.tag, got.bytes);
      assert(memcmp(&made, &got, sizeof got) == 0);
    } else {
      assert(err.code == TCC_ERR_REMOTE && strstr(err.msg, "from rank 3") && strstr(err.msg, "'fuzz' (rank 1)"));
    }
    err.code = TCC_OK;
    if (tcc__p2p_ref_check(comm, 3, &ref, &err) == TCC_OK) {
      tcc__p2p_ref_make(&ref_made, ref.addr, ref.token);
      assert(memcmp(&ref_made, &ref, sizeof ref) == 0);
    } else {
      assert(err.code == TCC_ERR_REMOTE && strstr(err.msg, "from rank 3") && strstr(err.msg, "'fuzz' (rank 1)"));
    }
    const uint64_t bytes = got.bytes % (TCC_P2P_FRAME_MAX_BYTES + 1);
    const struct {
      tcc_p2p_kind_t kind;
      uint64_t bytes;
    } sent[] = {{TCC_P2P_DATA, bytes}, {TCC_P2P_REF, bytes}, {TCC_P2P_DONE, 0}};
    for (size_t i = 0; i < sizeof sent / sizeof sent[0]; i++) {
      tcc__p2p_frame_make(&made, sent[i].kind, got.tag, sent[i].bytes);
      err.code = TCC_OK;
      assert(tcc__p2p_frame_check(comm, 3, &made, &err) == TCC_OK && tcc__p2p_frame_kind(&made) == sent[i].kind);
    }
    tcc__p2p_ref_make(&ref_made, ref.addr, ref.token);
    err.code = TCC_OK;
    assert(tcc__p2p_ref_check(comm, 3, &ref_made, &err) == TCC_OK);
  } while (in.left > 0);
  free(comm);
  return 0;
}
