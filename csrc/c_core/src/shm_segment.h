/*
 * shm_segment.h - a shared-memory segment mapped by every rank of a group.
 *
 * Rank 0 creates it under a name made from a random token (unguessable),
 * mode 0600, lays it out and publishes it; the other ranks wait for it and
 * map it whole. Then every rank counts itself in, and the last one removes
 * the name: from then on a crash of any rank cannot leak it. Used by the
 * shared-memory transport (shm.c) and by windows (window.c).
 */
#ifndef TCCOMM_SHM_SEGMENT_H
#define TCCOMM_SHM_SEGMENT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* Every segment starts with this; the user's layout follows it. */
typedef struct tcc_segment_head {
  atomic_uint ready;    /* set by tcc_segment_publish, after the layout */
  atomic_int attached;  /* ranks that have mapped the segment */
  uint64_t total_bytes; /* the size of the whole segment */
} tcc_segment_head_t;

/* "/tccomm-<kind><token in hex>". */
void tcc_segment_name(const char *kind, const uint8_t token[TCC_TOKEN_BYTES], char out[64]);

/* Rank 0: creates the segment (it must not exist), sizes it to `bytes`
 * (zero-filled) and maps it at *base. `who` starts every error message
 * ("tccomm 'name' (rank 0)"). On failure the name is removed again. */
tcc_result_t tcc_segment_create(const char *name, size_t bytes, const char *who, void **base, tcc_err_t *err);
/* Rank 0, once its layout is written: lets the other ranks map it. */
void tcc_segment_publish(void *base);
/* The other ranks: waits (until `deadline`, tcc_now_ns time) for rank 0 to
 * publish the segment, then maps it whole at *base (*bytes: its size). */
tcc_result_t tcc_segment_open(const char *name, int64_t deadline, const char *who, void **base, size_t *bytes,
                              tcc_err_t *err);
/* Every rank, once mapped: counts itself in and waits until all `n` ranks
 * have (the last one removes the name). TCC_ERR_TIMEOUT after `deadline`,
 * with the name removed and *attached the count reached; the caller unmaps. */
tcc_result_t tcc_segment_attach(void *base, const char *name, int n, int64_t deadline, int *attached);

#endif /* TCCOMM_SHM_SEGMENT_H */
