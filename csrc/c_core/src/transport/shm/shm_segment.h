/*
 * shm_segment.h - a shared-memory segment mapped by every rank of a group.
 *
 * Rank 0 creates it exclusively (mode 0600) under a name derived from a
 * random token that every rank learned from the endpoint exchange, takes
 * an open-file-description lock on its byte 0 at once (held for as long as
 * the name exists, see "reaping" below), reserves every page up front (a
 * /dev/shm too small fails here, with a message, not later with SIGBUS),
 * lays it out and publishes it. The other ranks wait for it, trust it only
 * after checking owner, mode, size and a secret derived from the same
 * token, and map it whole. Then every rank counts itself in, and the last
 * one removes the name: from then on a crash of any rank cannot leak it.
 * When rank 0 cannot create it, the others fail promptly with rank 0's
 * reason; when rank 0 dies before every rank counted itself in, they see
 * its lock gone and fail within a fraction of a second (shm_segment.c).
 * Used by the shared-memory transport (shm_setup.c) and by windows (window.c).
 *
 * Reaping (shm_reap.c): a process killed during setup leaves the name
 * behind. The first shared-memory setup of every process removes such
 * leftovers of its own user: objects under tccomm's names that no one
 * holds a lock on and that are older than a grace period.
 */
#ifndef TCCOMM_SHM_SEGMENT_H
#define TCCOMM_SHM_SEGMENT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "core/internal.h"

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
typedef struct tcc__segment_id {
  char name[64]; /* "/tccomm-<kind><32 hex digits>" */
  uint8_t secret[TCC_SEGMENT_SECRET_BYTES];
} tcc_segment_id_t;

void tcc__segment_id(const char *kind, const uint8_t token[TCC_TOKEN_BYTES], tcc_segment_id_t *id);

/* Rank 0 of `n` ranks: creates the segment (it must not exist), reserves
 * `bytes` (zero-filled) and maps it at *base. *fd: the creating
 * descriptor, which holds the creator's lock on byte 0 (rank 0's liveness
 * byte) and is closed in forked children; the caller keeps it open at
 * least until tcc__segment_attach has returned (the name is gone by then)
 * and closes it with tcc__fd_close. `who` starts every error message
 * ("tccomm 'name' (rank 0)"). On failure the other ranks, waiting in
 * tcc__segment_open, fail with the same reason. */
tcc_result_t tcc__segment_create(const tcc_segment_id_t *id, size_t bytes, int n, const char *who, void **base,
                                int *fd, tcc_err_t *err);
/* Rank 0, once its layout is written: lets the other ranks map it. */
void tcc__segment_publish(void *base);
/* Rank `rank` (> 0) of `n`: waits (until `deadline`, tcc__now_ns time) for
 * rank 0 to publish the segment, verifies it and maps it whole at *base
 * (*bytes: its size). Only the segment head is verified here: the caller
 * checks its own header before using it. *fd (when fd is not NULL): the
 * verified descriptor, read-write, closed in forked children; the caller
 * closes it with tcc__fd_close. Fails with TCC_ERR_REMOTE when rank 0
 * exited after creating the segment, saying so. */
tcc_result_t tcc__segment_open(const tcc_segment_id_t *id, int rank, int n, int64_t deadline, const char *who,
                              void **base, size_t *bytes, int *fd, tcc_err_t *err);
/* Every rank, once mapped: counts itself in and waits until all `n` ranks
 * have (the last one removes the name, id->name; rank 0 makes sure of it
 * before it returns, so it never lets go of its lock while the name exists).
 * `fd`: the descriptor from create or open; ranks other than 0 use it to
 * check rank 0's lock at most every 100 ms. On failure the segment's name
 * is removed, *attached is the count reached and the caller unmaps:
 * TCC_ERR_TIMEOUT after `deadline` (err untouched: the caller words it),
 * or TCC_ERR_REMOTE when rank 0 exited meanwhile (err says so, naming
 * `who`). */
tcc_result_t tcc__segment_attach(void *base, int fd, const tcc_segment_id_t *id, int rank, int n, int64_t deadline,
                                const char *who, int *attached, tcc_err_t *err);

/* Test switch: when set, tcc__segment_open calls it right after each look
 * at rank 0's lock, so a test can act at that moment as rank 0 would. */
extern void (*tcc__segment_lock_looked)(void);

/* ---- reaping (shm_reap.c) ---------------------------------------------- */

/* How old (by mtime) an unlocked object must be before it is removed.
 * Creators lock within microseconds of creating, so a minute is ample for
 * segments; failure signals, left unlocked on purpose (by rank 0, or by a
 * rank that found rank 0 dead), and the acknowledgements of them stay for
 * the default group timeout, during which a late rank may still come to
 * read them (a page each at most). */
#define TCC_SEGMENT_REAP_GRACE_S 60
#define TCC_SEGMENT_SIGNAL_GRACE_S (30 * 60)

/* Whether a tccomm object (open as `fd`, stat `sb`) is a failure signal,
 * or too small to be anything else: the long grace. */
bool tcc__segment_is_signal(int fd, const struct stat *sb);
/* Removes the abandoned tccomm objects of this effective uid from `dir`
 * (/dev/shm); returns how many. */
int tcc__shm_reap(const char *dir);
/* tcc__shm_reap("/dev/shm"), the first time it is called in a process. */
void tcc__shm_reap_once(void);

#endif /* TCCOMM_SHM_SEGMENT_H */
