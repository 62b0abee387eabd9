/*
 * fuzz_coll_desc.c - the descriptors every rank publishes before a
 * collective (tcc__coll_desc_check), all-to-all split matrices included.
 *
 * Input: [n-1] [rank] [kind] then n descriptors of
 * tcc__coll_desc_bytes(kind, n) bytes each. Each descriptor gets a buffer of
 * exactly that size, which is what both transports guarantee (at least
 * this rank's descriptor length per peer), so reading beyond it is a bug.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz.h"
#include "core/internal.h"

#define MAX_RANKS 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  const int n = 1 + fuzz_u8(&in) % MAX_RANKS;
  const int rank = fuzz_u8(&in) % n;
  const tcc_coll_kind_t kind = (tcc_coll_kind_t)(TCC_COLL_BROADCAST + fuzz_u8(&in) % TCC_COLL_BARRIER);
  const size_t len = tcc__coll_desc_bytes(kind, n);
  void *descs[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    descs[r] = malloc(len);
    if (!descs[r]) abort();
    fuzz_take(&in, descs[r], len);
  }
  tcc_comm_t *comm = calloc(1, sizeof *comm);
  if (!comm) abort();
  comm->size = n;
  comm->rank = rank;
  snprintf(comm->name, sizeof comm->name, "fuzz");
  tcc_coll_t c = {.kind = kind};
  tcc_err_t err = {TCC_OK, {0}};
  tcc_result_t r = tcc__coll_desc_check(comm, &c, (const void *const *)descs, &err);
  assert(r == TCC_OK || (r == TCC_ERR_MISMATCH && err.msg[0]));
  free(comm);
  for (int j = 0; j < n; j++) free(descs[j]);
  return 0;
}
