/*
 * fuzz_shm_header.c - the shared-memory transport's header, written by
 * rank 0 and checked by every other rank before use (tcc__shm_check_header).
 *
 * Input: [group size (2 bytes, taken modulo TCC_MAX_RANKS)] [mapped size
 * (8 bytes)] [shm_header_t]. The header sits in a buffer of exactly its size.
 */
#include <assert.h>
#include <stdlib.h>

#include "fuzz.h"
#include "transport/shm/shm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  uint16_t n16;
  fuzz_take(&in, &n16, sizeof n16);
  const int n = 1 + n16 % TCC_MAX_RANKS;
  const size_t bytes = (size_t)fuzz_u64(&in);
  shm_header_t *h = aligned_alloc(TCC_CACHELINE, sizeof *h);
  if (!h) abort();
  fuzz_take(&in, h, sizeof *h);
  tcc_err_t err = {TCC_OK, {0}};
  if (tcc__shm_check_header(h, n, bytes, "fuzz", &err) == TCC_OK) {
    /* Accepted: everything the transport later derives from it fits. */
    assert(h->size == (uint32_t)n && h->small_bytes <= h->window);
    assert(h->ring_off <= h->slots_off && h->slots_off <= h->seg.total_bytes && h->seg.total_bytes == bytes);
    /* The slot rings, when there are any, lie inside the segment. */
    assert(h->slot_bytes == 0 || h->slots_off + (uint64_t)n * shm_slots_stride(h) <= h->seg.total_bytes);
  } else {
    assert(err.code == TCC_ERR_INVALID);
  }
  free(h);
  return 0;
}
