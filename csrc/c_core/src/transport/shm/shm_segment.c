/*
 * shm_segment.c - see shm_segment.h.
 *
 * How the waiting ranks learn that rank 0 failed: they poll the segment's
 * name, so the signal lives under that name, in the object rank 0 already
 * holds exclusively (no second name to make unguessable and to clean up).
 * What can still be written depends on how full /dev/shm is:
 *  - Rank 0 reserves the first page before the rest. When the rest does not
 *    fit, or cannot be mapped, rank 0's reason goes into that page and the
 *    head's state becomes FAILED: any message, at no extra cost.
 *  - When not even that page fits, /dev/shm is full and no data can be
 *    written, but metadata still can (an inode takes no data pages): rank 0
 *    gives the object NO_ROOM_MODE, a mode no segment in use has, and sets
 *    its size, without pages, to the bytes it needed. The waiting ranks
 *    rebuild the reason from that size and the free space they see.
 * Rank 0 returns at once and leaves the signal in place. Each rank that saw
 * it leaves an empty "<name>.<rank>" (again an inode only); the one that
 * finds all n-1 of them removes the signal and them. A rank that never
 * comes leaves them behind, one page at most, until the long grace of the
 * reaper (shm_reap.c) is over.
 *
 * How they learn that rank 0 died: rank 0 takes an open-file-description
 * lock on byte 0 of the object right after the exclusive creation, before
 * the object has any size, and holds it while the name exists (until every
 * rank attached, and then as the shm transport's liveness lock). The
 * kernel drops it when the process ends, however it ends. So a waiting
 * rank that finds an object with a size but no lock on byte 0 (F_OFD_GETLK,
 * at most every 100 ms) knows rank 0 is gone, unless rank 0 left one of
 * the failure signals above, which it writes before letting go and which
 * the waiting rank reads after seeing the lock free. Such a rank fails at
 * once, naming the cause: the group cannot start. It removes the name
 * (the pages go with the last mapping) and leaves in its place a one-page
 * signal saying that rank 0 died, made as rank 0 makes its own (created
 * exclusively, locked while written) and acknowledged like it, so that
 * ranks that had not looked yet fail as promptly instead of waiting for a
 * name that will never come back.
 */
#include "transport/shm/shm_segment.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define STATE_READY 0x74636d73u  /* "tcms" */
#define STATE_FAILED 0x7463666cu /* "tcfl" */
#define STATE_ORPHANED 0x74636f72u /* "tcor": rank 0 died before every rank attached */
#define SEGMENT_MODE 0600
#define NO_ROOM_MODE 0400
#define POLL_NS (200 * 1000)
#define CHECK_EVERY_NS (100 * 1000000LL)

static void sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

/* ---- rank 0's lock ------------------------------------------------------ */

static struct flock byte0_lock(short type) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 1;
  return fl;
}

/* No other open file description holds byte 0: rank 0 is gone. A failing
 * query answers "held": unsure is not gone. */
static bool creator_gone(int fd) {
  struct flock fl = byte0_lock(F_WRLCK);
  return fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK;
}

void (*tcc__segment_lock_looked)(void);

/* ---- names and secrets ------------------------------------------------ */

/* SipHash-2-4 of one 64-bit word, keyed by the token: a keyed one-way
 * function, so neither the name nor the secret reveals the token (rank 0's
 * token also authenticates TCP connections) and the name does not reveal
 * the secret. */
#define ROTL64(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                     \
  do {                                                               \
    v0 += v1; v1 = ROTL64(v1, 13); v1 ^= v0; v0 = ROTL64(v0, 32);    \
    v2 += v3; v3 = ROTL64(v3, 16); v3 ^= v2;                         \
    v0 += v3; v3 = ROTL64(v3, 21); v3 ^= v0;                         \
    v2 += v1; v1 = ROTL64(v1, 17); v1 ^= v2; v2 = ROTL64(v2, 32);    \
  } while (0)

static uint64_t load_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static uint64_t siphash_word(const uint8_t key[16], uint64_t m) {
  const uint64_t k0 = load_le64(key), k1 = load_le64(key + 8);
  uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
  uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
  const uint64_t last = (uint64_t)8 << 56; /* the message length, no tail bytes */
  v3 ^= m;
  SIPROUND;
  SIPROUND;
  v0 ^= m;
  v3 ^= last;
  SIPROUND;
  SIPROUND;
  v0 ^= last;
  v2 ^= 0xff;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  return v0 ^ v1 ^ v2 ^ v3;
}

/* 16 bytes derived from the token; `label` keeps name and secret apart. */
static void derive(const uint8_t token[TCC_TOKEN_BYTES], uint64_t label, uint8_t out[16]) {
  for (int half = 0; half < 2; half++) {
    uint64_t h = siphash_word(token, label * 2 + (uint64_t)half);
    for (int i = 0; i < 8; i++) out[half * 8 + i] = (uint8_t)(h >> (8 * i));
  }
}

void tcc__segment_id(const char *kind, const uint8_t token[TCC_TOKEN_BYTES], tcc_segment_id_t *id) {
  _Static_assert(TCC_TOKEN_BYTES == 16, "SipHash takes a 16-byte key");
  uint8_t tag[16];
  derive(token, 1, tag);
  int len = snprintf(id->name, sizeof id->name, "/tccomm-%s", kind);
  for (int i = 0; i < 16; i++) len += snprintf(id->name + len, sizeof id->name - (size_t)len, "%02x", tag[i]);
  derive(token, 2, id->secret);
}

/* ---- rank 0: creation ----------------------------------------------------- */

/* Reserves the first `bytes` of the object (extending it). posix_fallocate
 * returns the error instead of setting errno; tmpfs undoes an interrupted
 * reservation, so a retry after EINTR starts clean. */
static int reserve(int fd, size_t bytes) {
  int e = EINTR;
  for (int tries = 0; tries < 100 && e == EINTR; tries++) e = posix_fallocate(fd, 0, (off_t)bytes);
  return e;
}

static unsigned long long free_bytes(int fd) {
  struct statvfs sv;
  if (fstatvfs(fd, &sv) != 0) return 0;
  return (unsigned long long)sv.f_bavail * sv.f_frsize;
}

/* The same words on rank 0 and on the ranks that rebuild them. */
static void no_room_reason(char *out, size_t len, size_t bytes, int fd, const char *cause) {
  snprintf(out, len,
           "cannot reserve %zu bytes of shared memory: /dev/shm has %llu bytes free (%s). Set "
           "TCCOMM_TRANSPORT=tcp to use TCP instead, or give /dev/shm more room (e.g. docker run --shm-size=1g)",
           bytes, free_bytes(fd), cause);
}

/* The first page is reserved: the reason goes there for the waiting ranks,
 * with the secret that makes it believable. */
static void publish_failure(int fd, const uint8_t *secret, unsigned state, const char *reason) {
  tcc_segment_head_t *h = mmap(NULL, TCC_SEGMENT_HEAD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (h == MAP_FAILED) return; /* the waiting ranks time out instead */
  memcpy(h->secret, secret, sizeof h->secret);
  snprintf(h->reason, sizeof h->reason, "%s", reason);
  atomic_store(&h->state, state); /* publishes the reason */
  munmap(h, TCC_SEGMENT_HEAD_BYTES);
}

/* Not even the first page fits: metadata only. The size goes first, so a
 * rank that sees the mode sees the size too. */
static int publish_no_room(int fd, size_t bytes) {
  return ftruncate(fd, (off_t)bytes) == 0 && fchmod(fd, NO_ROOM_MODE) == 0 ? 0 : -1;
}

/* A forked child (a DataLoader worker, say) must not inherit the mapping:
 * it would keep the pages alive and could scribble on a live group. */
static void no_fork(void *p, size_t bytes) { (void)madvise(p, bytes, MADV_DONTFORK); }

/* Everything after the exclusive creation; on failure the reason is left
 * for the waiting ranks and copied into `reason`. */
static void *reserve_and_map(int fd, const uint8_t *secret, size_t bytes, char *reason, size_t len, int *no_room) {
  int e = reserve(fd, TCC_SEGMENT_HEAD_BYTES);
  if (e != 0) {
    no_room_reason(reason, len, bytes, fd, strerror(e));
    *no_room = 1;
    return MAP_FAILED;
  }
  e = reserve(fd, bytes);
  void *p = MAP_FAILED;
  if (e != 0) {
    no_room_reason(reason, len, bytes, fd, strerror(e));
  } else {
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) snprintf(reason, len, "mapping %zu bytes of shared memory failed: %s", bytes, strerror(errno));
  }
  if (p == MAP_FAILED) {
    /* The signal needs the first page only; the rest (reserved when the
     * mapping failed) would sit in /dev/shm until the reaper's long grace
     * is over. Nobody maps a segment that was never ready. */
    if (ftruncate(fd, TCC_SEGMENT_HEAD_BYTES) != 0) {
      /* it keeps its pages: room lost for a while, nothing worse */
    }
    publish_failure(fd, secret, STATE_FAILED, reason);
  }
  return p;
}

tcc_result_t tcc__segment_create(const tcc_segment_id_t *id, size_t bytes, int n, const char *who, void **base,
                                int *fd_out, tcc_err_t *err) {
  if (bytes < TCC_SEGMENT_HEAD_BYTES || bytes > (size_t)INT64_MAX)
    return tcc__err_set(err, TCC_ERR_INVALID, "%s: a shared-memory segment of %zu bytes is out of range", who, bytes);
  /* Nothing under the name is ours when this fails: the waiting ranks can
   * only time out. */
  int fd = shm_open(id->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, SEGMENT_MODE);
  if (fd < 0) return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: shm_open(%s) failed: %s", who, id->name, strerror(errno));
  tcc__fd_close_on_fork(fd);
  /* First of all, while the object is still empty: from here on the other
   * ranks and the reaper can tell a live creator from a dead one. */
  struct flock fl = byte0_lock(F_WRLCK);
  if (fcntl(fd, F_OFD_SETLK, &fl) != 0) {
    int e = errno;
    shm_unlink(id->name);
    tcc__fd_close(fd);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: cannot lock the shared-memory segment %s: %s", who, id->name,
                       strerror(e));
  }
  /* The umask may have cleared bits of 0600; the other ranks insist on it. */
  if (fchmod(fd, SEGMENT_MODE) != 0) {
    int e = errno;
    shm_unlink(id->name);
    tcc__fd_close(fd);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: fchmod of the shared-memory segment failed: %s", who, strerror(e));
  }
  char reason[TCC_SEGMENT_REASON_BYTES];
  int no_room = 0;
  void *p = reserve_and_map(fd, id->secret, bytes, reason, sizeof reason, &no_room);
  if (p == MAP_FAILED) {
    /* With no other rank there is nobody to leave the signal for. */
    if ((no_room && publish_no_room(fd, bytes) != 0) || n == 1) shm_unlink(id->name);
    tcc__fd_close(fd); /* after the signal: a waiting rank that sees the lock go reads it */
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: %s", who, reason);
  }
  no_fork(p, bytes);
  /* Reserved tmpfs pages read as zero: the user's counters start at 0. */
  tcc_segment_head_t *h = p;
  h->total_bytes = bytes;
  memcpy(h->secret, id->secret, sizeof h->secret);
  *base = p;
  *fd_out = fd;
  return TCC_OK;
}

void tcc__segment_publish(void *base) {
  atomic_store(&((tcc_segment_head_t *)base)->state, STATE_READY); /* publishes the layout */
}

/* ---- the other ranks: verification ---------------------------------------- */

static void ack_name(char out[80], const char *name, int rank) { snprintf(out, 80, "%s.%d", name, rank); }

/* A rank that saw rank 0's failure says so; the one that finds every other
 * rank has removes the failure signal and all the acknowledgements. */
static void acknowledge_failure(const char *name, int rank, int n) {
  char ack[80];
  ack_name(ack, name, rank);
  int fd = shm_open(ack, O_CREAT | O_RDWR | O_CLOEXEC, SEGMENT_MODE);
  if (fd < 0) return; /* the signal stays: later ranks still see it */
  close(fd);
  for (int r = 1; r < n; r++) {
    ack_name(ack, name, r);
    fd = shm_open(ack, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return; /* rank r has not seen it yet */
    close(fd);
  }
  shm_unlink(name);
  for (int r = 1; r < n; r++) {
    ack_name(ack, name, r);
    shm_unlink(ack);
  }
}

static tcc_result_t rank0_failed(const tcc_segment_id_t *id, int rank, int n, const char *who, const char *reason,
                                 tcc_err_t *err) {
  acknowledge_failure(id->name, rank, n);
  return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: rank 0 could not create the shared-memory segment: %s", who, reason);
}

/* ---- the other ranks: rank 0 died ------------------------------------------ */

/* In place of the segment, a one-page signal for the ranks that have not
 * looked yet, made as rank 0 makes its own: created exclusively and locked
 * while it is written. When another rank was first, or not even a page
 * fits, this rank leaves none. */
static void leave_orphan_signal(const tcc_segment_id_t *id, const char *reason) {
  int fd = shm_open(id->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, SEGMENT_MODE);
  if (fd < 0) return;
  tcc__fd_close_on_fork(fd);
  struct flock fl = byte0_lock(F_WRLCK);
  if (fcntl(fd, F_OFD_SETLK, &fl) != 0 || fchmod(fd, SEGMENT_MODE) != 0 || reserve(fd, TCC_SEGMENT_HEAD_BYTES) != 0)
    shm_unlink(id->name);
  else
    publish_failure(fd, id->secret, STATE_ORPHANED, reason);
  tcc__fd_close(fd);
}

static tcc_result_t orphaned(const tcc_segment_id_t *id, int rank, int n, const char *who, const char *why,
                             tcc_err_t *err) {
  acknowledge_failure(id->name, rank, n);
  return tcc__err_set(err, TCC_ERR_REMOTE, "%s: rank 0 exited during shared-memory setup (%s)", who, why);
}

/* This rank found rank 0's lock gone: the group cannot start. The segment's
 * name goes (its pages with the last mapping), the signal takes its place. */
static tcc_result_t creator_exited(const tcc_segment_id_t *id, int rank, int n, const char *who, const char *when,
                                   tcc_err_t *err) {
  char why[TCC_SEGMENT_REASON_BYTES];
  snprintf(why, sizeof why, "its process ended after creating the segment %s, %s", id->name, when);
  shm_unlink(id->name);
  leave_orphan_signal(id, why);
  return orphaned(id, rank, n, who, why, err);
}

static tcc_result_t untrusted(const char *who, const char *name, const char *why, tcc_err_t *err) {
  return tcc__err_set(err, TCC_ERR_INVALID, "%s: the shared-memory object %s %s: not trusted", who, name, why);
}

/* Owner and mode, the first things to trust; the no-room signal is told
 * apart here. TCC_ERR_INPROGRESS: fine so far. */
static tcc_result_t check_owner_and_mode(int fd, const struct stat *sb, const tcc_segment_id_t *id, int rank,
                                         int n, const char *who, tcc_err_t *err) {
  char why[128];
  if (!S_ISREG(sb->st_mode)) return untrusted(who, id->name, "is not a regular file", err);
  if (sb->st_uid != geteuid()) {
    snprintf(why, sizeof why, "is owned by uid %u, not by this process's uid %u", (unsigned)sb->st_uid,
             (unsigned)geteuid());
    return untrusted(who, id->name, why, err);
  }
  const unsigned mode = (unsigned)sb->st_mode & 07777u;
  if (mode == NO_ROOM_MODE) {
    char reason[TCC_SEGMENT_REASON_BYTES];
    no_room_reason(reason, sizeof reason, (size_t)sb->st_size, fd, "not even its first page fit");
    return rank0_failed(id, rank, n, who, reason, err);
  }
  if (mode != SEGMENT_MODE) {
    snprintf(why, sizeof why, "has mode 0%o, not 0%o", mode, (unsigned)SEGMENT_MODE);
    return untrusted(who, id->name, why, err);
  }
  return TCC_ERR_INPROGRESS;
}

/* What the head says; read from a private look at the first page only. */
typedef struct head_copy {
  unsigned state;
  uint64_t total;
  uint8_t secret[TCC_SEGMENT_SECRET_BYTES];
  char reason[TCC_SEGMENT_REASON_BYTES + 1];
} head_copy_t;

static int read_head(int fd, head_copy_t *out) {
  tcc_segment_head_t *h = mmap(NULL, TCC_SEGMENT_HEAD_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  if (h == MAP_FAILED) return -1;
  out->state = atomic_load(&h->state); /* acquires what it publishes */
  out->total = h->total_bytes;
  memcpy(out->secret, h->secret, sizeof out->secret);
  memcpy(out->reason, h->reason, sizeof h->reason);
  out->reason[sizeof h->reason] = '\0';
  munmap(h, TCC_SEGMENT_HEAD_BYTES);
  return 0;
}

/* A head that says "ready": checks secret and size, then maps it whole. */
static tcc_result_t map_ready(int fd, const head_copy_t *hc, const tcc_segment_id_t *id, const char *who,
                              void **base, size_t *bytes, tcc_err_t *err) {
  char why[160];
  if (memcmp(hc->secret, id->secret, sizeof hc->secret) != 0)
    return untrusted(who, id->name, "was not created for this group (its secret does not match)", err);
  struct stat sb;
  if (fstat(fd, &sb) != 0)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: fstat of %s failed: %s", who, id->name, strerror(errno));
  if ((uint64_t)sb.st_size != hc->total) {
    snprintf(why, sizeof why, "has %lld bytes but its header says %llu", (long long)sb.st_size,
             (unsigned long long)hc->total);
    return untrusted(who, id->name, why, err);
  }
  if ((unsigned long long)sb.st_blocks * 512ULL < hc->total) {
    snprintf(why, sizeof why, "has only %llu of its %llu bytes reserved", (unsigned long long)sb.st_blocks * 512ULL,
             (unsigned long long)hc->total);
    return untrusted(who, id->name, why, err);
  }
  void *p = mmap(NULL, (size_t)hc->total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: mmap of %llu bytes of shared memory failed: %s", who,
                       (unsigned long long)hc->total, strerror(errno));
  no_fork(p, (size_t)hc->total);
  *base = p;
  *bytes = (size_t)hc->total;
  return TCC_OK;
}

/* One look at the object under the name: TCC_OK (mapped),
 * TCC_ERR_INPROGRESS (rank 0 is not done: look again) or a failure.
 * *checked_ns: when rank 0's lock was last looked at. */
static tcc_result_t inspect(int fd, const tcc_segment_id_t *id, int rank, int n, const char *who, void **base,
                            size_t *bytes, int64_t *checked_ns, tcc_err_t *err) {
  /* The lock means something only once the object has a size: rank 0 sets
   * none before it holds the lock, so a lock looked at before any size was
   * seen may just not be taken yet (a look that then found the object
   * grown took a live rank 0 for a dead one). Once it counts, the object
   * is looked at again after it: rank 0 writes any failure signal before
   * its lock goes, so a free lock and then no signal means death. */
  bool gone = false;
  struct stat sb;
  if (fstat(fd, &sb) != 0)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: fstat of %s failed: %s", who, id->name, strerror(errno));
  const int64_t now = tcc__now_ns();
  if (sb.st_size > 0 && now - *checked_ns >= CHECK_EVERY_NS) {
    *checked_ns = now;
    gone = creator_gone(fd);
    if (tcc__segment_lock_looked) tcc__segment_lock_looked();
    if (gone && fstat(fd, &sb) != 0)
      return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: fstat of %s failed: %s", who, id->name, strerror(errno));
  }
  static const char before_ready[] = "before it was ready";
  tcc_result_t r = check_owner_and_mode(fd, &sb, id, rank, n, who, err);
  if (r != TCC_ERR_INPROGRESS) return r;
  /* Rank 0 creates it empty, then reserves the first page, which sets the
   * size: any other size below one page is not ours. While it is empty,
   * rank 0 may not have taken its lock yet: no verdict on it. */
  if (sb.st_size == 0) return TCC_ERR_INPROGRESS;
  if (sb.st_size < TCC_SEGMENT_HEAD_BYTES) {
    char why[96];
    snprintf(why, sizeof why, "has %lld bytes, less than a segment header", (long long)sb.st_size);
    return untrusted(who, id->name, why, err);
  }
  /* Reading a page that is not reserved could SIGBUS on a full /dev/shm. */
  if ((unsigned long long)sb.st_blocks * 512ULL < TCC_SEGMENT_HEAD_BYTES)
    return gone ? creator_exited(id, rank, n, who, before_ready, err) : TCC_ERR_INPROGRESS;
  head_copy_t hc;
  if (read_head(fd, &hc) != 0)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: mmap of %s failed: %s", who, id->name, strerror(errno));
  if (hc.state == 0) return gone ? creator_exited(id, rank, n, who, before_ready, err) : TCC_ERR_INPROGRESS;
  if (hc.state == STATE_FAILED || hc.state == STATE_ORPHANED) {
    if (memcmp(hc.secret, id->secret, sizeof hc.secret) != 0)
      return untrusted(who, id->name, "was not created for this group (its secret does not match)", err);
    return hc.state == STATE_FAILED ? rank0_failed(id, rank, n, who, hc.reason, err)
                                    : orphaned(id, rank, n, who, hc.reason, err);
  }
  if (hc.state != STATE_READY) {
    char why[96];
    snprintf(why, sizeof why, "is not a tccomm segment (state word 0x%08x)", hc.state);
    return untrusted(who, id->name, why, err);
  }
  /* Ready, but the group can no longer start: rank 0 would have waited
   * for this rank. Only a segment that proves to be this group's goes. */
  if (gone && memcmp(hc.secret, id->secret, sizeof hc.secret) == 0)
    return creator_exited(id, rank, n, who, "before every rank attached", err);
  return map_ready(fd, &hc, id, who, base, bytes, err);
}

/* Rank 0's no-room signal (mode 0400) opens for reading only. */
static int open_existing(const char *name) {
  int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0 && errno == EACCES) fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
  return fd;
}

tcc_result_t tcc__segment_open(const tcc_segment_id_t *id, int rank, int n, int64_t deadline, const char *who,
                              void **base, size_t *bytes, int *fd_out, tcc_err_t *err) {
  int fd = -1;
  int64_t checked_ns = INT64_MIN / 2;
  for (;;) {
    if (fd < 0) {
      fd = open_existing(id->name);
      if (fd < 0 && errno != ENOENT)
        return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: shm_open(%s) failed: %s", who, id->name, strerror(errno));
      tcc__fd_close_on_fork(fd);
    }
    if (fd >= 0) {
      tcc_result_t r = inspect(fd, id, rank, n, who, base, bytes, &checked_ns, err);
      if (r == TCC_OK && fd_out) {
        *fd_out = fd;
        return r;
      }
      if (r != TCC_ERR_INPROGRESS) {
        tcc__fd_close(fd);
        return r;
      }
    }
    if (tcc__now_ns() > deadline) {
      const int seen = fd >= 0;
      if (fd >= 0) tcc__fd_close(fd);
      return tcc__err_set(err, TCC_ERR_TIMEOUT, "%s: timed out waiting for rank 0 to create the shared-memory segment%s",
                         who, seen ? " (an object under its name never became a complete segment)" : "");
    }
    sleep_ns(POLL_NS);
  }
}

tcc_result_t tcc__segment_attach(void *base, int fd, const tcc_segment_id_t *id, int rank, int n, int64_t deadline,
                                const char *who, int *attached, tcc_err_t *err) {
  tcc_segment_head_t *h = base;
  const char *name = id->name;
  if (atomic_fetch_add(&h->attached, 1) + 1 == n) shm_unlink(name);
  int64_t checked_ns = tcc__now_ns();
  for (int got; (got = atomic_load(&h->attached)) < n;) {
    const int64_t now = tcc__now_ns();
    if (rank != 0 && now - checked_ns >= CHECK_EVERY_NS) {
      checked_ns = now;
      /* Rank 0 lets go only after it saw every rank in, or after it gave
       * up: counted again once the lock is seen free. */
      if (creator_gone(fd) && (got = atomic_load(&h->attached)) < n) {
        char when[80];
        snprintf(when, sizeof when, "before all %d ranks attached: %d had", n, got);
        *attached = got;
        return creator_exited(id, rank, n, who, when, err);
      }
    }
    if (now > deadline) {
      *attached = atomic_load(&h->attached);
      shm_unlink(name);
      return TCC_ERR_TIMEOUT;
    }
    sleep_ns(50 * 1000);
  }
  /* The last rank in removed the name, perhaps not yet: rank 0 makes sure
   * before its caller may let go of the lock (a no-op almost always). */
  if (rank == 0) shm_unlink(name);
  *attached = n;
  return TCC_OK;
}

/* ---- reaping --------------------------------------------------------------- */

bool tcc__segment_is_signal(int fd, const struct stat *sb) {
  if (((unsigned)sb->st_mode & 07777u) == NO_ROOM_MODE) return true; /* its size lies; it has no pages */
  if ((unsigned long long)sb->st_blocks * 512ULL <= TCC_SEGMENT_HEAD_BYTES) return true;
  /* Read, not mapped: a page that is not there reads as zeros, no SIGBUS. */
  unsigned state = 0;
  _Static_assert(offsetof(tcc_segment_head_t, state) == 0, "the state word comes first");
  if (pread(fd, &state, sizeof state, 0) != (ssize_t)sizeof state) return true;
  return state == STATE_FAILED || state == STATE_ORPHANED;
}
