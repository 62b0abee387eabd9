/*
 * fake_ring.h - a shared-memory transport of two ranks in one process's
 * memory, enough for its point-to-point rings (transport/shm/shm_p2p.c):
 * the header, the ranks' control lines and the rings, no liveness lock
 * (no peer ever counts as gone). For the ring's fuzz target and its seeds.
 */
#ifndef TCC_FUZZ_FAKE_RING_H
#define TCC_FUZZ_FAKE_RING_H

#include <stdlib.h>

#include "transport/shm/shm.h"

#define FAKE_RING_BYTES 4096u

typedef struct fake_ring {
  tcc_comm_t comm;
  shm_state_t st;
  uint64_t tail_seen[2];
  size_t rec_read[2];
  void *memory;
} fake_ring_t;

/* Sets up rank `rank` of the pair; NULL when out of memory. */
static inline fake_ring_t *fake_ring_new(int rank) {
  fake_ring_t *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  const size_t ctrl_off = 4096, ring_off = 8192;
  shm_header_t h = {.size = 2, .ring_bytes = FAKE_RING_BYTES, .ctrl_off = ctrl_off, .ring_off = ring_off};
  const size_t bytes = ring_off + 4 * shm_ring_stride(&h);
  if (posix_memalign(&f->memory, 4096, bytes) != 0) {
    free(f);
    return NULL;
  }
  memset(f->memory, 0, bytes);
  memcpy(f->memory, &h, sizeof h);
  f->st.base = f->memory;
  f->st.bytes = bytes;
  f->st.hdr = f->memory;
  f->st.lock_fd = -1;
  f->st.tail_seen = f->tail_seen;
  f->st.rec_read = f->rec_read;
  f->comm.size = 2;
  f->comm.rank = rank;
  snprintf(f->comm.name, sizeof f->comm.name, "fuzz");
  f->comm.transport_state = &f->st;
  return f;
}

static inline void fake_ring_free(fake_ring_t *f) {
  free(f->memory);
  free(f);
}

#endif /* TCC_FUZZ_FAKE_RING_H */
