/*
 * shm_segment.h - a shared-memory segment mapped by every rank of a group.
 *
 * Rank 0 creates it exclusively (mode 0600) under a name derived from a
 * random token that every rank learned from the endpoint exchange, reserves
 * every page up front (a /dev/shm too small fails here, with a message, not
 * later with SIGBUS), lays it out and publishes it. The other ranks wait
 * for it, trust it only after checking owner, mode, size and a secret
 * derived from the same token, and map it whole. Then every rank counts
 * itself in, and the last one removes the name: from then on a crash of any
 * rank cannot leak it. When rank 0 cannot create it, the others fail
 * promptly with rank 0's reason (see shm_segment.c). Used by the
 * shared-memory transport (shm.c) and by windows (window.c).
 */
#ifndef TCCOMM_SHM_SEGMENT_H
#define TCCOMM_SHM_SEGMENT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* The first page of every segment: the head below, then the user's own
 * header. Rank 0 reserves it before anything else, so it can always carry
 * a failure reason, and the other ranks read nothing beyond it until the
 * whole segment is verified. */
#define TCC_SEGMENT_HEAD_BYTES 4096
#define TCC_SEGMENT_SECRET_BYTES 16
#define TCC_SEGMENT_REASON_BYTES 320

/* Every segment starts with this; the user's layout follows it. */
typedef struct tcc_segment_head {
  atomic_uint state;    /* 0 while rank 0 lays it out, then ready or failed */
  atomic_int attached;  /* ranks that have mapped the segment */
  uint64_t total_bytes; /* the size of the whole segment */
  uint8_t secret[TCC_SEGMENT_SECRET_BYTES]; /* proves it was made for this group */
  char reason[TCC_SEGMENT_REASON_BYTES];    /* failed: why, from rank 0 */
} tcc_segment_head_t;

/* What names a segment and proves it genuine, both derived from a token
 * every rank knows; the name (visible to anyone listing /dev/shm) reveals
 * neither the token nor the secret. */
typedef struct tcc_segment_id {
  char name[64]; /* "/tccomm-<kind><32 hex digits>" */
  uint8_t secret[TCC_SEGMENT_SECRET_BYTES];
} tcc_segment_id_t;

void tcc_segment_id(const char *kind, const uint8_t token[TCC_TOKEN_BYTES], tcc_segment_id_t *id);

/* Rank 0 of `n` ranks: creates the segment (it must not exist), reserves
 * `bytes` (zero-filled) and maps it at *base. `who` starts every error
 * message ("tccomm 'name' (rank 0)"). On failure the other ranks, waiting
 * in tcc_segment_open, fail with the same reason. */
tcc_result_t tcc_segment_create(const tcc_segment_id_t *id, size_t bytes, int n, const char *who, void **base,
                                tcc_err_t *err);
/* Rank 0, once its layout is written: lets the other ranks map it. */
void tcc_segment_publish(void *base);
/* Rank `rank` (> 0) of `n`: waits (until `deadline`, tcc_now_ns time) for
 * rank 0 to publish the segment, verifies it and maps it whole at *base
 * (*bytes: its size). Only the segment head is verified here: the caller
 * checks its own header before using it. */
tcc_result_t tcc_segment_open(const tcc_segment_id_t *id, int rank, int n, int64_t deadline, const char *who,
                              void **base, size_t *bytes, tcc_err_t *err);
/* Every rank, once mapped: counts itself in and waits until all `n` ranks
 * have (the last one removes the name). TCC_ERR_TIMEOUT after `deadline`,
 * with the name removed and *attached the count reached; the caller unmaps. */
tcc_result_t tcc_segment_attach(void *base, const char *name, int n, int64_t deadline, int *attached);

#endif /* TCCOMM_SHM_SEGMENT_H */
