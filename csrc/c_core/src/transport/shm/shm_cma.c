/*
 * shm_cma.c - single-copy reads from a peer's memory: cross-memory attach
 * (process_vm_readv), as Open MPI's vader uses it.
 *
 * Moving a large buffer through the staging windows copies every byte
 * twice (into the writer's window, out into the reader's buffer); reading
 * the writer's buffer in place copies it once. The kernel allows it when
 * the reader may ptrace the writer: same user, and, under the Yama LSM's
 * ptrace_scope 1, only if the writer named it as a tracer, which is why a
 * rank that offers reads declares any process a permitted tracer
 * (PR_SET_PTRACER_ANY, as Open MPI does; TCCOMM_CMA=0 leaves that alone).
 * Containers often forbid the system call itself (seccomp), and ranks may
 * live in different pid namespaces while sharing /dev/shm. So nothing is
 * assumed: every rank reads a random word from every peer at setup and
 * compares it with the value the peer published. A rank that cannot read
 * every peer says so in each op's descriptor, and the algorithms then
 * stage through the windows for the whole group.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/copy.h"
#include "core/log.h"
#include "transport/shm/shm.h"

/* One process_vm_readv/writev moves at most about 2 GiB (MAX_RW_COUNT). */
#define MOVE_CHUNK ((size_t)1 << 30)

static bool cma_wanted(void) {
  const char *s = getenv("TCCOMM_CMA");
  return !(s && strcmp(s, "0") == 0);
}

void tcc__shm_cma_publish(tcc_comm_t *comm, shm_state_t *st) {
  shm_rank_ctrl_t *me = shm_ctrl(st, comm->rank);
  st->direct_bytes = SIZE_MAX;
  if (!cma_wanted() || tcc__random_bytes(&st->probe, sizeof st->probe) != TCC_OK) return;
#ifdef PR_SET_PTRACER
  /* Fails harmlessly (EINVAL) where Yama is not built in. */
  (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
  me->probe_addr = (uint64_t)(uintptr_t)&st->probe;
  me->probe_value = st->probe;
  me->pid = (int32_t)getpid();
}

/* One system call: `len` bytes between `local` here and `remote` in pid. */
static ssize_t move_once(pid_t pid, void *local, uint64_t remote, size_t len, bool write) {
  struct iovec here = {local, len};
  struct iovec there = {(void *)(uintptr_t)remote, len};
  return write ? process_vm_writev(pid, &here, 1, &there, 1, 0) : process_vm_readv(pid, &here, 1, &there, 1, 0);
}

void tcc__shm_cma_probe(tcc_comm_t *comm, shm_state_t *st) {
  if (shm_ctrl(st, comm->rank)->pid == 0) {
    TCC_LOG_INFO(comm->rank, "communicator '%s' moves data through shared memory only: TCCOMM_CMA=0 on this rank", comm->name);
    return;
  }
  for (int j = 0; j < comm->size; j++) {
    if (j == comm->rank) continue;
    const shm_rank_ctrl_t *peer = shm_ctrl(st, j);
    uint64_t seen = 0;
    const char *why = NULL;
    int code = 0;
    if (peer->pid == 0) {
      why = "it offers none (TCCOMM_CMA=0 there)";
    } else if (move_once(peer->pid, &seen, peer->probe_addr, sizeof seen, false) != (ssize_t)sizeof seen) {
      code = errno;
      why = code == EPERM ? "not permitted (ptrace policy)" : code == ENOSYS ? "the kernel or a seccomp filter refuses it"
                                                                             : "the read failed";
    } else if (seen != peer->probe_value) {
      why = "its process id names another process here (another pid namespace)";
    }
    if (why) {
      TCC_LOG_INFO(comm->rank, "communicator '%s' moves data through shared memory only: rank %d cannot be read: %s%s%s",
                   comm->name, tcc__rank_label(comm, j), why, code ? ": " : "", code ? strerror(code) : "");
      return;
    }
  }
  st->direct_bytes = st->hdr->direct_bytes;
  atomic_store_explicit(&shm_ctrl(st, comm->rank)->reads_peers, 1, memory_order_release);
  if (st->direct_bytes == SIZE_MAX)
    TCC_LOG_INFO(comm->rank,
                 "communicator '%s' moves collectives' data through shared memory, its ranks sharing CPUs "
                 "(TCCOMM_SHM_DIRECT_BYTES sets a size from which it goes single-copy); point-to-point messages "
                 "can go by reference",
                 comm->name);
  else
    TCC_LOG_INFO(comm->rank,
                 "communicator '%s' moves data from %zu bytes single-copy, straight between the ranks' buffers "
                 "(TCCOMM_SHM_DIRECT_BYTES; TCCOMM_CMA=0 turns it off)",
                 comm->name, st->direct_bytes);
}

/* The kernel copies with rep movsb as glibc does, and as slowly where the
 * destination lies a few bytes after the source modulo 4096 (core/copy.h):
 * a 1 MiB all_gather into a view 4 or 16 bytes past a page boundary took
 * 3x as long. Such a move goes through a bounce buffer at the remote
 * address's page offset, so that the kernel copies at distance 0 and the
 * copy between it and `local` runs in tcc__copy's vector loop. One buffer
 * per thread that moves, freed when the thread ends. */
#define BOUNCE_BYTES ((size_t)256 << 10)

static pthread_key_t bounce_key;
static bool bounce_key_made;
static pthread_once_t bounce_once = PTHREAD_ONCE_INIT;

static void make_bounce_key(void) { bounce_key_made = pthread_key_create(&bounce_key, free) == 0; }

/* This thread's bounce buffer (a page more than BOUNCE_BYTES, page-aligned),
 * or NULL where there is none to be had: the move then goes direct. */
static char *bounce_buffer(void) {
  pthread_once(&bounce_once, make_bounce_key);
  if (!bounce_key_made) return NULL;
  char *b = pthread_getspecific(bounce_key);
  if (b) return b;
  void *p = NULL;
  if (posix_memalign(&p, 4096, BOUNCE_BYTES + 4096) != 0) return NULL;
  if (pthread_setspecific(bounce_key, p) != 0) {
    free(p);
    return NULL;
  }
  return p;
}

/* One move of up to `len` bytes (at most BOUNCE_BYTES through `bounce`). */
static ssize_t move_piece(pid_t pid, char *local, uint64_t remote, size_t len, bool write, char *bounce) {
  if (!bounce) return move_once(pid, local, remote, len, write);
  char *at = bounce + (remote & 4095u);
  if (len > BOUNCE_BYTES) len = BOUNCE_BYTES;
  if (write) tcc__copy(at, local, len);
  const ssize_t got = move_once(pid, at, remote, len, write);
  if (!write && got > 0) tcc__copy(local, at, (size_t)got);
  return got;
}

static tcc_result_t peer_move(tcc_comm_t *comm, int rank, char *local, uint64_t remote, size_t len, bool write,
                              const char *what, uint64_t seq, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  const pid_t pid = shm_ctrl(st, rank)->pid;
  const void *remote_at = (const void *)(uintptr_t)remote; /* for its address's arithmetic only */
  char *bounce = tcc__copy_aliased(write ? remote_at : local, write ? local : remote_at, len) ? bounce_buffer() : NULL;
  size_t done = 0;
  while (done < len) {
    size_t want = len - done < MOVE_CHUNK ? len - done : MOVE_CHUNK;
    ssize_t got = move_piece(pid, local + done, remote + done, want, write, bounce);
    if (got > 0) {
      done += (size_t)got;
      continue;
    }
    const int code = got < 0 ? errno : EIO;
    /* A peer that is gone is reported as every wait reports it. */
    tcc_result_t gone = tcc__shm_peer_check(comm, st, rank, true, what, err);
    if (gone != TCC_OK) return gone;
    /* Exiting: its memory is gone before its lock is. */
    if (code == ESRCH)
      return tcc__err_set(err, TCC_ERR_REMOTE,
                          "tccomm %s #%llu on '%s' (rank %d): rank %d exited (its process is gone: a single-copy %s "
                          "of %zu bytes failed after %zu bytes)",
                          what, (unsigned long long)seq, comm->name, tcc__self_label(comm),
                          tcc__rank_label(comm, rank), write ? "write" : "read", len, done);
    return tcc__err_set(err, TCC_ERR_REMOTE,
                        "tccomm %s #%llu on '%s' (rank %d): single-copy %s of %zu bytes %s rank %d failed after "
                        "%zu bytes: %s",
                        what, (unsigned long long)seq, comm->name, tcc__self_label(comm), write ? "write" : "read",
                        len, write ? "to" : "from", tcc__rank_label(comm, rank), done, strerror(code));
  }
  return TCC_OK;
}

tcc_result_t tcc__shm_peer_read(tcc_comm_t *comm, int rank, void *local, uint64_t remote, size_t len,
                                const char *what, uint64_t seq, tcc_err_t *err) {
  return peer_move(comm, rank, local, remote, len, false, what, seq, err);
}

tcc_result_t tcc__shm_peer_write(tcc_comm_t *comm, int rank, const void *local, uint64_t remote, size_t len,
                                 const char *what, uint64_t seq, tcc_err_t *err) {
  /* process_vm_writev only reads `local`. */
  return peer_move(comm, rank, (char *)(uintptr_t)local, remote, len, true, what, seq, err);
}

bool tcc__shm_p2p_direct(tcc_comm_t *comm, int peer, size_t bytes, bool to_peer) {
  shm_state_t *st = shm_of(comm);
  const int receiver = to_peer ? peer : comm->rank;
  return bytes >= st->hdr->p2p_direct_bytes &&
         atomic_load_explicit(&shm_ctrl(st, receiver)->reads_peers, memory_order_acquire);
}

tcc_result_t tcc__shm_p2p_peer_read(tcc_comm_t *comm, int peer, void *dst, uint64_t remote, size_t len, uint64_t seq,
                                    tcc_err_t *err) {
  return peer_move(comm, peer, dst, remote, len, false, "recv", seq, err);
}
