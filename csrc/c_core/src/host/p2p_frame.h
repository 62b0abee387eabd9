/*
 * p2p_frame.h - the header in front of every point-to-point message on a
 * peer's byte stream, and its check.
 *
 * The streams carry nothing but frames, back to back, so a header that
 * does not check out means the two ends are out of step (or memory was
 * corrupted): the stream cannot be trusted any more, and the receiver
 * fails every operation on it instead of reading a payload of whatever
 * length the garbage names. The check word covers the tag and the length,
 * so a damaged length is caught before anything is allocated for it.
 */
#ifndef TCC_P2P_FRAME_H
#define TCC_P2P_FRAME_H

#include "core/internal.h"

#define TCC_P2P_FRAME_MAGIC 0x74637032u /* "tcp2" */
/* No real message comes near this (256 TiB); anything above is garbage,
 * whatever the check word says, and size_t arithmetic on it stays safe. */
#define TCC_P2P_FRAME_MAX_BYTES (1ull << 48)

typedef struct tcc_p2p_frame {
  uint32_t magic;
  uint32_t check; /* tcc_p2p_frame_check_word(tag, bytes) */
  uint64_t tag;
  uint64_t bytes; /* payload length that follows the header */
} tcc_p2p_frame_t;

void tcc__p2p_frame_make(tcc_p2p_frame_t *f, uint64_t tag, uint64_t bytes);

/* TCC_OK when f is a frame tcc__p2p_frame_make could have written, else
 * TCC_ERR_REMOTE with a message naming the group, this rank, the sending
 * peer and what is wrong. */
tcc_result_t tcc__p2p_frame_check(const tcc_comm_t *comm, int peer, const tcc_p2p_frame_t *f, tcc_err_t *err);

#endif /* TCC_P2P_FRAME_H */
