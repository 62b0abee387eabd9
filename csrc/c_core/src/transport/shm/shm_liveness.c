/*
 * shm_liveness.c - noticing that a rank of a shared-memory group is gone.
 *
 * Shared memory says nothing when a process dies: a SIGKILLed peer leaves
 * its counters as they were and the others would wait for their timeout.
 * So every rank holds an open-file-description lock (F_OFD_SETLK) on byte
 * `rank` of the segment's file. The kernel drops such a lock when the last
 * descriptor of it closes, which happens at exit however the process ends
 * (a forked child closes its copy, see forksafe.c). A waiter that sees no
 * progress asks F_OFD_GETLK whether the lock of a rank it waits for is
 * still held: no lock, no rank. The check is a system call, so waiters
 * make it at most every CHECK_EVERY_NS per peer, well inside the second
 * in which a death must be noticed.
 *
 * A rank that destroys its communicator sets `destroyed` in its control
 * block before letting go of the lock, so the others can say which it was.
 * Locks live on the file, which is unlinked once everyone has mapped it:
 * nothing is left in /dev/shm whatever happens afterwards.
 *
 * The locks are taken on the descriptors segment setup already has: rank
 * 0's creating descriptor, whose lock on byte 0 was taken right after the
 * exclusive creation (so the waiting ranks and the reaper of abandoned
 * segments can tell it lives, shm_segment.c), and each other rank's
 * verified one. Nothing is opened by name again.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/mutation.h"
#include "transport/shm/shm.h"

#define CHECK_EVERY_NS (100 * 1000000LL)

static struct flock byte_lock(int rank, short type) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = rank;
  fl.l_len = 1;
  return fl;
}

tcc_result_t tcc__shm_liveness_start(tcc_comm_t *comm, shm_state_t *st, int fd, tcc_err_t *err) {
  /* Owned from here on, whatever happens: stop closes it. */
  st->lock_fd = fd;
  st->peer_checked_ns = calloc((size_t)comm->size, sizeof *st->peer_checked_ns);
  if (!st->peer_checked_ns) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  /* Rank 0 holds its byte already; taking it again changes nothing. */
  struct flock fl = byte_lock(comm->rank, F_WRLCK);
  if (fcntl(fd, F_OFD_SETLK, &fl) != 0)
    return tcc__err_set(err, TCC_ERR_SYSTEM,
                       "tccomm '%s' (rank %d): cannot take the liveness lock on the shared-memory segment: %s",
                       comm->name, tcc__self_label(comm), strerror(errno));
  return TCC_OK;
}

void tcc__shm_liveness_stop(tcc_comm_t *comm, shm_state_t *st) {
  if (st->lock_fd >= 0) {
    atomic_store(&shm_ctrl(st, comm->rank)->destroyed, 1);
    tcc__fd_close(st->lock_fd);
    st->lock_fd = -1;
  }
  free(st->peer_checked_ns);
  st->peer_checked_ns = NULL;
}

void tcc__shm_failed(tcc_comm_t *comm, bool announce) {
  shm_state_t *st = shm_of(comm);
  if (!announce || !st || st->lock_fd < 0) return;
  shm_rank_ctrl_t *me = shm_ctrl(st, comm->rank);
  char cause[TCC_ERRLEN];
  tcc__comm_failure(comm, cause, sizeof cause);
  snprintf(me->fail_reason, sizeof me->fail_reason, "%.*s", (int)sizeof me->fail_reason - 1, cause);
  atomic_store_explicit(&me->failed, 1, memory_order_release);
}

tcc_result_t tcc__shm_peer_check(tcc_comm_t *comm, shm_state_t *st, int peer, bool now, const char *what,
                                tcc_err_t *err) {
  if (peer == comm->rank || st->lock_fd < 0) return TCC_OK;
  const shm_rank_ctrl_t *pc = shm_ctrl(st, peer);
  /* One load, cheap enough for every check: a failed peer is known within
   * one wait slice. The reason is the peer's own text, bounded here
   * whatever it holds. */
  if (atomic_load_explicit(&pc->failed, memory_order_acquire))
    return tcc__err_set(err, TCC_ERR_REMOTE, "tccomm %s on '%s' (rank %d): rank %d failed and will not take part: %.*s",
                        what, comm->name, tcc__self_label(comm), tcc__rank_label(comm, peer),
                        (int)sizeof pc->fail_reason, pc->fail_reason);
  if (TCC_MUTANT(DEAD_PEER_UNREPORTED)) return TCC_OK; /* MUTATION SITE */
  /* The coarse clock: a polling reader checks on every empty look, and a
   * tick more or less does not matter against CHECK_EVERY_NS. The
   * collective runner and the p2p thread both check: relaxed atomics, a
   * check more or less does not matter either. */
  int64_t t = tcc__coarse_now_ns();
  if (!now && t - atomic_load_explicit(&st->peer_checked_ns[peer], memory_order_relaxed) < CHECK_EVERY_NS)
    return TCC_OK;
  atomic_store_explicit(&st->peer_checked_ns[peer], t, memory_order_relaxed);
  struct flock fl = byte_lock(peer, F_WRLCK);
  if (fcntl(st->lock_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK) return TCC_OK;
  if (atomic_load(&shm_ctrl(st, peer)->destroyed))
    return tcc__err_set(err, TCC_ERR_REMOTE,
                       "tccomm %s on '%s' (rank %d): rank %d destroyed its communicator and will not take part",
                       what, comm->name, tcc__self_label(comm), tcc__rank_label(comm, peer));
  return tcc__err_set(err, TCC_ERR_REMOTE,
                     "tccomm %s on '%s' (rank %d): rank %d exited (its process ended, killed or crashed, "
                     "without destroying the communicator)",
                     what, comm->name, tcc__self_label(comm), tcc__rank_label(comm, peer));
}
