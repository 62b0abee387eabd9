/*
 * p2p_frame.c - see p2p_frame.h.
 */
#include "host/p2p_frame.h"

/* A 64-bit finaliser (splitmix64's) folded to 32 bits: every bit of the tag
 * and the length changes about half the bits of the word. */
static uint32_t check_word(uint64_t tag, uint64_t bytes) {
  uint64_t z = tag ^ (bytes * 0x9e3779b97f4a7c15ull) ^ TCC_P2P_FRAME_MAGIC;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (uint32_t)(z ^ (z >> 32));
}

void tcc__p2p_frame_make(tcc_p2p_frame_t *f, uint64_t tag, uint64_t bytes) {
  f->magic = TCC_P2P_FRAME_MAGIC;
  f->check = check_word(tag, bytes);
  f->tag = tag;
  f->bytes = bytes;
}

tcc_result_t tcc__p2p_frame_check(const tcc_comm_t *comm, int peer, const tcc_p2p_frame_t *f, tcc_err_t *err) {
  const char *what = NULL;
  if (f->magic != TCC_P2P_FRAME_MAGIC)
    what = "no frame header where one must start";
  else if (f->check != check_word(f->tag, f->bytes))
    what = "a frame header whose check word does not match its tag and length";
  else if (f->bytes > TCC_P2P_FRAME_MAX_BYTES)
    what = "a frame header with an impossible length";
  if (!what) return TCC_OK;
  return tcc__err_set(err, TCC_ERR_REMOTE,
                     "tccomm p2p on '%s' (rank %d): corrupt stream from rank %d: %s (magic 0x%08x, tag %llu, "
                     "%llu bytes); the byte streams are out of step, so no further message from rank %d "
                     "can be trusted",
                     comm->name, comm->rank, peer, what, f->magic, (unsigned long long)f->tag,
                     (unsigned long long)f->bytes, peer);
}
