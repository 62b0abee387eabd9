/*
 * p2p_frame.h - the header in front of every point-to-point frame on a
 * peer's byte stream, and its check.
 *
 * The streams carry nothing but frames, back to back, so a header that
 * does not check out means the two ends are out of step (or memory was
 * corrupted): the stream cannot be trusted any more, and the receiver
 * fails every operation on it instead of reading a payload of whatever
 * length the garbage names. The check word covers the kind, the tag and
 * the length, so a damaged length is caught before anything is allocated
 * for it.
 *
 * Three kinds of frame (p2p_direct.c says when the last two are used):
 *  - data: a message, its `bytes` of payload following the header;
 *  - reference: a message of `bytes` that the receiver reads single-copy
 *    from the sender's memory; a tcc_p2p_ref_t follows the header;
 *  - done: the receiver has read the message whose reference carried the
 *    token `tag` (no payload): the sender's buffer is free again.
 */
#ifndef TCC_P2P_FRAME_H
#define TCC_P2P_FRAME_H

#include "core/internal.h"

#define TCC_P2P_FRAME_MAGIC 0x74637032u /* "tcp2": data */
#define TCC_P2P_REF_MAGIC 0x74637052u   /* "tcpR": reference */
#define TCC_P2P_DONE_MAGIC 0x74637044u  /* "tcpD": done */
/* No real message comes near this (256 TiB); anything above is garbage,
 * whatever the check word says, and size_t arithmetic on it stays safe. */
#define TCC_P2P_FRAME_MAX_BYTES (1ull << 48)

typedef enum tcc_p2p_kind {
  TCC_P2P_DATA,
  TCC_P2P_REF,
  TCC_P2P_DONE,
} tcc_p2p_kind_t;

typedef struct tcc_p2p_frame {
  uint32_t magic; /* the kind */
  uint32_t check; /* over the kind, the tag and the length */
  uint64_t tag;   /* a done frame: the token of the reference it answers */
  uint64_t bytes; /* the message's length (a done frame: 0) */
} tcc_p2p_frame_t;

/* What follows a reference frame's header: where the message lies in the
 * sender's memory and the token its done frame must carry. */
typedef struct tcc_p2p_ref {
  uint64_t addr;
  uint64_t token;
  uint64_t check; /* over addr and token */
} tcc_p2p_ref_t;

void tcc__p2p_frame_make(tcc_p2p_frame_t *f, tcc_p2p_kind_t kind, uint64_t tag, uint64_t bytes);

/* The kind of a frame tcc__p2p_frame_check accepted. */
tcc_p2p_kind_t tcc__p2p_frame_kind(const tcc_p2p_frame_t *f);

/* TCC_OK when f is a frame tcc__p2p_frame_make could have written, else
 * TCC_ERR_REMOTE with a message naming the group, this rank, the sending
 * peer and what is wrong. */
tcc_result_t tcc__p2p_frame_check(const tcc_comm_t *comm, int peer, const tcc_p2p_frame_t *f, tcc_err_t *err);

void tcc__p2p_ref_make(tcc_p2p_ref_t *r, uint64_t addr, uint64_t token);

/* As tcc__p2p_frame_check, for the reference after a reference frame. */
tcc_result_t tcc__p2p_ref_check(const tcc_comm_t *comm, int peer, const tcc_p2p_ref_t *r, tcc_err_t *err);

#endif /* TCC_P2P_FRAME_H */
