/*
 * p2p_frame.c - see p2p_frame.h.
 */
#include "host/p2p_frame.h"

/* A 64-bit finaliser (splitmix64's) folded to 32 bits: every bit of the
 * inputs changes about half the bits of the word. */
static uint64_t mix(uint64_t a, uint64_t b, uint64_t salt) {
  uint64_t z = a ^ (b * 0x9e3779b97f4a7c15ull) ^ salt;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint32_t check_word(uint32_t magic, uint64_t tag, uint64_t bytes) {
  const uint64_t z = mix(tag, bytes, magic);
  return (uint32_t)(z ^ (z >> 32));
}

static const uint32_t kind_magic[] = {
    [TCC_P2P_DATA] = TCC_P2P_FRAME_MAGIC,
    [TCC_P2P_REF] = TCC_P2P_REF_MAGIC,
    [TCC_P2P_DONE] = TCC_P2P_DONE_MAGIC,
};

void tcc__p2p_frame_make(tcc_p2p_frame_t *f, tcc_p2p_kind_t kind, uint64_t tag, uint64_t bytes) {
  f->magic = kind_magic[kind];
  f->check = check_word(f->magic, tag, bytes);
  f->tag = tag;
  f->bytes = bytes;
}

tcc_p2p_kind_t tcc__p2p_frame_kind(const tcc_p2p_frame_t *f) {
  return f->magic == TCC_P2P_REF_MAGIC ? TCC_P2P_REF : f->magic == TCC_P2P_DONE_MAGIC ? TCC_P2P_DONE : TCC_P2P_DATA;
}

static bool known_magic(uint32_t magic) {
  return magic == TCC_P2P_FRAME_MAGIC || magic == TCC_P2P_REF_MAGIC || magic == TCC_P2P_DONE_MAGIC;
}

tcc_result_t tcc__p2p_frame_check(const tcc_comm_t *comm, int peer, const tcc_p2p_frame_t *f, tcc_err_t *err) {
  const char *what = NULL;
  if (!known_magic(f->magic))
    what = "no frame header where one must start";
  else if (f->check != check_word(f->magic, f->tag, f->bytes))
    what = "a frame header whose check word does not match its kind, tag and length";
  else if (f->bytes > TCC_P2P_FRAME_MAX_BYTES)
    what = "a frame header with an impossible length";
  else if (f->magic == TCC_P2P_DONE_MAGIC && f->bytes != 0)
    what = "a done frame with a length";
  if (!what) return TCC_OK;
  return tcc__err_set(err, TCC_ERR_REMOTE,
                     "tccomm p2p on '%s' (rank %d): corrupt stream from rank %d: %s (magic 0x%08x, tag %llu, "
                     "%llu bytes); the byte streams are out of step, so no further message from rank %d "
                     "can be trusted",
                     comm->name, comm->rank, peer, what, f->magic, (unsigned long long)f->tag,
                     (unsigned long long)f->bytes, peer);
}

void tcc__p2p_ref_make(tcc_p2p_ref_t *r, uint64_t addr, uint64_t token) {
  r->addr = addr;
  r->token = token;
  r->check = mix(addr, token, TCC_P2P_REF_MAGIC);
}

tcc_result_t tcc__p2p_ref_check(const tcc_comm_t *comm, int peer, const tcc_p2p_ref_t *r, tcc_err_t *err) {
  if (r->check == mix(r->addr, r->token, TCC_P2P_REF_MAGIC)) return TCC_OK;
  return tcc__err_set(err, TCC_ERR_REMOTE,
                     "tccomm p2p on '%s' (rank %d): corrupt stream from rank %d: a reference whose check word does "
                     "not match its address and token (address %#llx, token %llu); no further message from rank %d "
                     "can be trusted",
                     comm->name, comm->rank, peer, (unsigned long long)r->addr, (unsigned long long)r->token, peer);
}
