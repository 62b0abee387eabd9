/*
 * window.h - private parts of RMA windows (window.c) that the checks of
 * peer-supplied data are written against.
 */
#ifndef TCC_WINDOW_H
#define TCC_WINDOW_H

#include "transport/transport.h"
#include "transport/shm/shm_segment.h"

#define WIN_HEADER_BYTES TCC_SEGMENT_HEAD_BYTES
/* Keeps the layout arithmetic far from overflow (64 TiB per rank). */
#define WIN_MAX_BYTES ((uint64_t)1 << 46)

/* The layout as rank 0 computed it. */
typedef struct win_header {
  tcc_segment_head_t seg; /* readiness, ranks attached, total size, secret */
  uint32_t size;
  uint64_t ctrl_stride;
  uint64_t data_off; /* of rank 0's buffer; the others follow from the sizes */
} win_header_t;

typedef struct win_ctrl {
  atomic_uint futex;  /* bumped by a signal when someone sleeps */
  atomic_int sleepers;
  atomic_ullong sig[]; /* sig[src]: signals received from src */
} win_ctrl_t;

/* What every rank contributes to creation: its size and (rank 0's is used)
 * the random segment token. */
typedef struct win_hello {
  uint64_t bytes;
  uint8_t token[TCC_TOKEN_BYTES];
} win_hello_t;

struct tcc_window {
  int rank;
  int size;
  char name[64];        /* the communicator's, for messages */
  int64_t timeout_ms;
  char *base;
  size_t total;
  size_t ctrl_stride;
  size_t *off;          /* size entries: data offset of each rank */
  size_t *bytes;        /* size entries: data bytes of each rank */
  uint64_t *consumed;   /* size entries: signals consumed from each peer */
};

/* Every rank, after the allgather: refuses the window when any rank
 * declined or asked for more than WIN_MAX_BYTES (so the layout below
 * cannot overflow). The same verdict on every rank. */
tcc_result_t tcc__window_check_hellos(const tcc_window_t *win, const win_hello_t *hellos, tcc_err_t *err);
/* Offsets of control blocks and data buffers from the allgathered sizes
 * (already checked); fills win->ctrl_stride, off, bytes and total. */
void tcc__window_layout(tcc_window_t *win, const win_hello_t *hellos);
/* Ranks other than 0: rank 0's header and the verified size of the
 * mapping against the layout this rank computed. TCC_ERR_INVALID names
 * the first field that differs. */
tcc_result_t tcc__window_check_header(const tcc_window_t *win, const win_header_t *h, size_t mapped, const char *who,
                                     tcc_err_t *err);

#endif /* TCC_WINDOW_H */
