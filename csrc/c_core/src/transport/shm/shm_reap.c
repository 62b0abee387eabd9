/*
 * shm_reap.c - removing what processes killed during setup left in /dev/shm.
 *
 * A segment's name exists from rank 0's exclusive creation until every rank
 * has attached (shm_segment.h). When the processes are killed in between
 * (torchrun kills every rank once one crashes during init), the object
 * stays, possibly hundreds of MB of /dev/shm, for good. So the first
 * shared-memory setup of each process looks through /dev/shm for objects
 * named as tccomm names them ("tccomm-<kind><32 hex digits>", and that plus
 * ".<rank>": the acknowledgements of a failure signal), regular files of
 * its own effective uid, and removes those that are provably abandoned:
 *  - no lock is held on any byte of them (F_OFD_GETLK over the whole file
 *    sees every lock, whoever holds it, this process included), and
 *  - they were last modified (mtime) longer ago than a grace period.
 *
 * Why this never removes a segment that a live group still needs: whoever
 * creates one (rank 0, of a group or of a window) locks it right after the
 * exclusive creation, before it has any size, and holds the lock for as
 * long as the name exists (shm_segment.c). The one unlocked moment of a
 * live segment, those microseconds between creating and locking, is
 * covered many times over by the grace of a minute. Removing a name never
 * disturbs the processes that mapped or opened the object: only the name
 * goes, the pages stay until the last mapping does. And a removed name is
 * never created again: names come from a fresh random token per group and
 * are created exclusively.
 *
 * Failure signals are unlocked on purpose: rank 0 could not create the
 * segment, or a waiting rank found rank 0 dead, and went on; the signal
 * tells ranks that come later why. Signals, and those ranks'
 * acknowledgements, keep the long grace, the default group timeout, during
 * which such a rank may still come; each holds a page at most. They are
 * told apart by st_blocks and the state word (tcc__segment_is_signal),
 * never by st_size, which the no-room signal sets to the bytes it needed
 * without having any.
 *
 * mtime, not ctime: both are set at creation and when the size changes, but
 * only mtime can be set (utimensat), which is how the tests age objects. An
 * owner who sets it forward keeps their own object longer, nothing more.
 *
 * Cost: one pass over /dev/shm, and an open, fstat and fcntl for each name
 * of tccomm's form in it, once per process.
 */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "transport/shm/shm_segment.h"

#define PREFIX "tccomm-"
#define PREFIX_LEN (sizeof PREFIX - 1)
#define HEX_DIGITS 32
#define MAX_KIND 16

/* "tccomm-<kind><32 hex>", optionally followed by ".<rank>" (*ack); kind is
 * "" or lowercase letters ending in a dash ("win-"), as tcc__segment_id
 * writes them. */
static bool tccomm_name(const char *name, bool *ack) {
  size_t len = strlen(name);
  const char *dot = strchr(name, '.');
  *ack = dot != NULL;
  if (dot) {
    const size_t digits = len - (size_t)(dot + 1 - name);
    if (digits == 0 || digits > 7 || strspn(dot + 1, "0123456789") != digits) return false;
    len = (size_t)(dot - name);
  }
  if (len < PREFIX_LEN + HEX_DIGITS || strncmp(name, PREFIX, PREFIX_LEN) != 0) return false;
  if (strspn(name + len - HEX_DIGITS, "0123456789abcdef") != HEX_DIGITS) return false;
  const size_t kind = len - PREFIX_LEN - HEX_DIGITS;
  if (kind == 0) return true;
  if (kind > MAX_KIND || name[PREFIX_LEN + kind - 1] != '-') return false;
  return strspn(name + PREFIX_LEN, "abcdefghijklmnopqrstuvwxyz") == kind - 1;
}

/* Some lock is held on some byte of the object, by anyone. A failing
 * query answers "locked": unsure is not abandoned. */
static bool locked(int fd) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 0; /* to the end of any file */
  return fcntl(fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK;
}

/* Removes `name` from `dirfd` when it is abandoned; true when it did. */
static bool reap_one(int dirfd, const char *name, bool ack, time_t now) {
  /* Read-only is enough to ask for locks and to read the state word. */
  int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) return false;
  bool removed = false;
  struct stat sb, by_name;
  if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_uid == geteuid() && !locked(fd)) {
    const time_t grace =
        ack || tcc__segment_is_signal(fd, &sb) ? TCC_SEGMENT_SIGNAL_GRACE_S : TCC_SEGMENT_REAP_GRACE_S;
    /* The name must still be the object judged. */
    if (now - sb.st_mtim.tv_sec >= grace && fstatat(dirfd, name, &by_name, AT_SYMLINK_NOFOLLOW) == 0 &&
        by_name.st_ino == sb.st_ino && by_name.st_dev == sb.st_dev)
      removed = unlinkat(dirfd, name, 0) == 0;
  }
  close(fd);
  return removed;
}

int tcc__shm_reap(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  const time_t now = time(NULL);
  int removed = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    bool ack;
    if (tccomm_name(e->d_name, &ack) && reap_one(dirfd(d), e->d_name, ack, now)) removed++;
  }
  closedir(d);
  return removed;
}

static pthread_once_t reaped = PTHREAD_ONCE_INIT;

static void reap_dev_shm(void) { (void)tcc__shm_reap("/dev/shm"); }

void tcc__shm_reap_once(void) { pthread_once(&reaped, reap_dev_shm); }
