/*
 * test_shm_reap.c - a group whose processes die during shared-memory setup
 * leaves nothing in /dev/shm for long, and its surviving ranks fail fast:
 *   - at a process's first group setup, objects under tccomm's names that
 *     are provably abandoned are removed: real segments whose creator
 *     exited (group and window kinds) once older than the grace, failure
 *     signals and acknowledgements only once older than the long grace.
 *     Kept: a segment whose creator lives (however old), a young one,
 *     signals younger than the long grace, other names, directories,
 *     symbolic links, another user's objects (as root only). Objects are
 *     aged by setting their mtime, which is what the reaper reads.
 *   - rank 0 killed (SIGKILL) after creating the segment, before the others
 *     attached (before it published the segment, after it, and in a real
 *     group being created): every waiting rank fails within about a
 *     second with an error naming the group, itself and the cause; so does
 *     a rank that comes only after they failed (the segment's name is gone
 *     by then); nothing is left in /dev/shm once they have exited.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "transport/shm/shm_segment.h"
#include "tccomm.h"

#define DAY_S (24 * 60 * 60)
/* Far below the 60 s the waiting ranks are given: a failure after this long
 * means they waited instead of noticing. */
#define FAST_S 5.0

static void fresh_id(const char *kind, tcc_segment_id_t *id) {
  uint8_t token[TCC_TOKEN_BYTES];
  CHECK(tcc__random_bytes(token, sizeof token) == TCC_OK, "random token");
  tcc__segment_id(kind, token, id);
}

static int name_exists(const char *name) {
  struct stat sb;
  char path[128];
  snprintf(path, sizeof path, "/dev/shm%.96s", name);
  return lstat(path, &sb) == 0;
}

/* Sets the object's mtime `age_s` seconds into the past (ctime cannot be
 * set; the reaper goes by mtime). */
static void age(const char *name, long age_s) {
  char path[128];
  snprintf(path, sizeof path, "/dev/shm%.96s", name);
  struct timespec times[2];
  clock_gettime(CLOCK_REALTIME, &times[0]);
  times[1] = times[0];
  times[1].tv_sec -= age_s;
  CHECK(utimensat(AT_FDCWD, path, times, AT_SYMLINK_NOFOLLOW) == 0, "age %s: %s", path, strerror(errno));
}

/* A real segment of `pages`, created and published by a child as rank 0 of
 * 2. With `stay` the child lives (holding the creator's lock) until its
 * pid is killed, else it exits at once, as a killed rank 0 would. */
static pid_t child_creates(const tcc_segment_id_t *id, size_t pages, int stay) {
  int ready[2];
  CHECK(pipe(ready) == 0, "pipe");
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    tcc_err_t err = {TCC_OK, ""};
    void *base = NULL;
    int fd = -1;
    if (tcc__segment_create(id, pages * 4096, 2, "tccomm 'reap-test' (rank 0)", &base, &fd, &err) != TCC_OK) {
      fprintf(stderr, "create: %s\n", err.msg);
      _exit(2);
    }
    tcc__segment_publish(base);
    char c = 1;
    if (write(ready[1], &c, 1) != 1) _exit(2);
    if (stay) pause();
    _exit(0);
  }
  close(ready[1]);
  char c = 0;
  CHECK(read(ready[0], &c, 1) == 1, "the creating child failed");
  close(ready[0]);
  if (!stay) waitpid(pid, NULL, 0);
  return pid;
}

/* An object planted under `name`: `pages` reserved, `size` bytes long,
 * then `mode`. */
static void plant(const char *name, size_t pages, off_t size, mode_t mode) {
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(fd >= 0, "plant %s: %s", name, strerror(errno));
  if (fd < 0) return;
  if (pages) CHECK(posix_fallocate(fd, 0, (off_t)(pages * 4096)) == 0, "plant: reserve");
  CHECK(ftruncate(fd, size) == 0, "plant: size");
  CHECK(fchmod(fd, mode) == 0, "plant: mode");
  close(fd);
}

typedef struct expectation {
  char name[96]; /* as shm_open names it, "/..." */
  const char *what;
  int removed;
} expectation_t;

#define MAX_CASES 24
static expectation_t cases[MAX_CASES];
static int ncases;

static expectation_t *expect(const char *name, const char *what, int removed) {
  expectation_t *e = &cases[ncases++];
  snprintf(e->name, sizeof e->name, "%s", name);
  e->what = what;
  e->removed = removed;
  return e;
}

/* A process's first group setup: a one-rank group on shared memory. */
static int first_setup_in_child(void) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    tcc_endpoint_t *ep;
    uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
    if (tcc_endpoint_open("127.0.0.1", &ep, blob) != TCC_OK) _exit(2);
    tcc_comm_config_t cfg = {0, 1, 10000, "reap-test", TCC_TRANSPORT_SHM};
    tcc_comm_t *comm = NULL;
    if (tcc_comm_create(&cfg, ep, blob, &comm) != TCC_OK) {
      fprintf(stderr, "create: %s\n", tcc_last_error());
      _exit(2);
    }
    tcc_comm_destroy(comm);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static void test_reaping(void) {
  printf("reaping at a process's first group setup:\n");
  tcc_segment_id_t id;
  char name[96];

  fresh_id("", &id);
  child_creates(&id, 8, 0);
  age(id.name, TCC_SEGMENT_REAP_GRACE_S + 5);
  expect(id.name, "segment, creator exited, past the grace", 1);

  fresh_id("win-", &id);
  child_creates(&id, 4, 0);
  age(id.name, TCC_SEGMENT_REAP_GRACE_S + 5);
  expect(id.name, "window segment, creator exited, past the grace", 1);

  fresh_id("", &id);
  pid_t live = child_creates(&id, 8, 1);
  age(id.name, DAY_S);
  expect(id.name, "segment, creator alive, a day old", 0);

  fresh_id("", &id);
  child_creates(&id, 8, 0);
  expect(id.name, "segment, creator exited, young", 0);

  /* Rank 0's failure signals: its first page only, or no page at all with
   * mode 0400 and the size it needed (far more than a page). */
  fresh_id("", &id);
  plant(id.name, 1, 4096, 0600);
  age(id.name, TCC_SEGMENT_SIGNAL_GRACE_S / 3);
  expect(id.name, "failure signal, younger than the long grace", 0);
  fresh_id("", &id);
  plant(id.name, 1, 4096, 0600);
  age(id.name, TCC_SEGMENT_SIGNAL_GRACE_S + 5);
  expect(id.name, "failure signal, past the long grace", 1);
  fresh_id("", &id);
  plant(id.name, 0, 512 << 20, 0400);
  age(id.name, TCC_SEGMENT_SIGNAL_GRACE_S / 3);
  expect(id.name, "no-room signal, younger than the long grace", 0);
  fresh_id("", &id);
  plant(id.name, 0, 512 << 20, 0400);
  age(id.name, TCC_SEGMENT_SIGNAL_GRACE_S + 5);
  expect(id.name, "no-room signal, past the long grace", 1);

  /* Acknowledgements of a signal: empty. */
  fresh_id("", &id);
  snprintf(name, sizeof name, "%s.3", id.name);
  plant(name, 0, 0, 0600);
  age(name, TCC_SEGMENT_SIGNAL_GRACE_S / 3);
  expect(name, "acknowledgement, younger than the long grace", 0);
  fresh_id("win-", &id);
  snprintf(name, sizeof name, "%s.12", id.name);
  plant(name, 0, 0, 0600);
  age(name, TCC_SEGMENT_SIGNAL_GRACE_S + 5);
  expect(name, "acknowledgement, past the long grace", 1);

  /* Not tccomm's names, though close to them; old and unlocked. */
  fresh_id("", &id);
  static const char *const forms[] = {"%.39s", "%sx", "%s.", "%s.1x"};
  for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
    snprintf(name, sizeof name, forms[i], id.name);
    plant(name, 8, 8 * 4096, 0600);
    age(name, DAY_S);
    expect(name, "a name not of tccomm's form", 0);
  }
  snprintf(name, sizeof name, "/tccomm-WIN-%s", id.name + 8);
  plant(name, 8, 8 * 4096, 0600);
  age(name, DAY_S);
  expect(name, "a name not of tccomm's form", 0);

  /* Not regular files. */
  fresh_id("", &id);
  char path[128];
  snprintf(path, sizeof path, "/dev/shm%.96s", id.name);
  CHECK(mkdir(path, 0700) == 0, "mkdir %s: %s", path, strerror(errno));
  age(id.name, DAY_S);
  expect(id.name, "a directory", 0);
  fresh_id("", &id);
  snprintf(path, sizeof path, "/dev/shm%.96s", id.name);
  CHECK(symlink("/nonexistent", path) == 0, "symlink: %s", strerror(errno));
  age(id.name, DAY_S);
  expect(id.name, "a symbolic link", 0);

  if (geteuid() == 0) {
    fresh_id("", &id);
    plant(id.name, 8, 8 * 4096, 0600);
    snprintf(path, sizeof path, "/dev/shm%.96s", id.name);
    CHECK(chown(path, 4242, 4242) == 0, "chown: %s", strerror(errno));
    age(id.name, DAY_S);
    expect(id.name, "another user's, old and unlocked", 0);
  } else {
    printf("  SKIP another user's object: making one needs root\n");
  }

  for (int i = 0; i < ncases; i++)
    CHECK(name_exists(cases[i].name), "%s: %s is gone before the setup", cases[i].what, cases[i].name);
  CHECK(first_setup_in_child(), "the one-rank group failed");
  for (int i = 0; i < ncases; i++) {
    const int gone = !name_exists(cases[i].name);
    CHECK(gone == cases[i].removed, "%s: %s was %s", cases[i].what, cases[i].name, gone ? "removed" : "kept");
    printf("  %-46s %s\n", cases[i].what, gone ? "removed" : "kept");
  }

  kill(live, SIGKILL);
  waitpid(live, NULL, 0);
  for (int i = 0; i < ncases; i++) {
    snprintf(path, sizeof path, "/dev/shm%.96s", cases[i].name);
    if (unlink(path) != 0) rmdir(path);
  }
}

/* ---- rank 0 dies during setup ---------------------------------------------- */

typedef struct outcome {
  atomic_int waiting; /* ranks that have started to wait */
  struct {
    int64_t since_ns; /* rank 0's death, or the rank's start when later (set by the parent) */
    tcc_result_t r;
    int64_t done_ns;
    char msg[TCC_ERRLEN];
  } rank[4];
} outcome_t;

static outcome_t *shared_outcome(void) {
  outcome_t *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(o != MAP_FAILED, "mmap");
  memset(o, 0, sizeof *o);
  return o;
}

/* A waiting rank of the segment functions: opens, then attaches. */
static void waiting_rank(const tcc_segment_id_t *id, int rank, int n, outcome_t *o) {
  char who[64];
  snprintf(who, sizeof who, "tccomm 'reap-test' (rank %d)", rank);
  tcc_err_t err = {TCC_OK, ""};
  void *base = NULL;
  size_t bytes = 0;
  int fd = -1, got = 0;
  const int64_t deadline = tcc__deadline_after_ms(60000);
  atomic_fetch_add(&o->waiting, 1);
  tcc_result_t r = tcc__segment_open(id, rank, n, deadline, who, &base, &bytes, &fd, &err);
  if (r == TCC_OK) {
    r = tcc__segment_attach(base, fd, id, rank, n, deadline, who, &got, &err);
    munmap(base, bytes);
    tcc__fd_close(fd);
  }
  o->rank[rank].done_ns = tcc__now_ns();
  o->rank[rank].r = r;
  snprintf(o->rank[rank].msg, sizeof o->rank[rank].msg, "%s", err.msg);
}

/* Every rank but 0 failed fast, naming the group, itself and the cause. */
static void check_waiters(const char *what, const outcome_t *o, int n) {
  for (int r = 1; r < n; r++) {
    const double secs = (double)(o->rank[r].done_ns - o->rank[r].since_ns) * 1e-9;
    char me[48];
    snprintf(me, sizeof me, "'reap-test' (rank %d)", r);
    CHECK(o->rank[r].r == TCC_ERR_REMOTE && strstr(o->rank[r].msg, "rank 0 exited during shared-memory setup") &&
              strstr(o->rank[r].msg, me),
          "%s: rank %d: %s: %s", what, r, tcc_result_string(o->rank[r].r), o->rank[r].msg);
    CHECK(secs < FAST_S, "%s: rank %d failed only after %.2f s", what, r, secs);
    printf("  rank %d after %.2f s: %s\n", r, secs, o->rank[r].msg);
  }
}

/* Nothing under the segment's name, nor acknowledgements of ranks < n. */
static void check_nothing_left(const char *what, const tcc_segment_id_t *id, int n) {
  CHECK(!name_exists(id->name), "%s: %s is left in /dev/shm", what, id->name);
  for (int r = 0; r < n; r++) {
    char ack[96];
    snprintf(ack, sizeof ack, "%s.%d", id->name, r);
    CHECK(!name_exists(ack), "%s: %s is left in /dev/shm", what, ack);
  }
}

static void kill_rank0(pid_t pid, outcome_t *o, int waiting) {
  const int64_t now = tcc__now_ns();
  for (int r = 1; r <= waiting; r++) o->rank[r].since_ns = now;
  kill(pid, SIGKILL);
}

/* Rank 0 (a child) creates a 4-rank segment, publishing it or not, and
 * never attaches; ranks 1 and 2 wait; then rank 0 is killed; once they
 * failed, rank 3 comes. */
static void rank0_killed(int published) {
  const char *what = published ? "killed after publishing" : "killed before publishing";
  printf("rank 0 %s:\n", what);
  tcc_segment_id_t id;
  fresh_id("", &id);
  outcome_t *o = shared_outcome();
  int ready[2];
  CHECK(pipe(ready) == 0, "pipe");
  fflush(stdout);
  pid_t pids[4];
  pids[0] = fork();
  if (pids[0] == 0) {
    tcc_err_t err = {TCC_OK, ""};
    void *base = NULL;
    int fd = -1;
    if (tcc__segment_create(&id, 64 * 4096, 4, "tccomm 'reap-test' (rank 0)", &base, &fd, &err) != TCC_OK) _exit(2);
    if (published) tcc__segment_publish(base);
    char c = 1;
    if (write(ready[1], &c, 1) != 1) _exit(2);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char c = 0;
  CHECK(read(ready[0], &c, 1) == 1, "%s: rank 0 could not create the segment", what);
  close(ready[0]);
  for (int r = 1; r < 4; r++) {
    if (r == 3) { /* the late one */
      for (int w = 0; w < 3; w++) waitpid(pids[w], NULL, 0);
      o->rank[r].since_ns = tcc__now_ns();
    }
    pids[r] = fork();
    if (pids[r] == 0) {
      waiting_rank(&id, r, 4, o);
      _exit(0);
    }
    if (r == 2) {
      while (atomic_load(&o->waiting) < 2) usleep(1000);
      usleep(200 * 1000); /* well into their waits */
      kill_rank0(pids[0], o, 2);
    }
  }
  waitpid(pids[3], NULL, 0);
  check_waiters(what, o, 4);
  check_nothing_left(what, &id, 4);
  munmap(o, sizeof *o);
}

/* A real 3-rank group: ranks 0 and 1 create their communicators; rank 0
 * is killed once its segment exists; rank 2 comes after rank 1 failed. */
static void rank0_killed_in_group(void) {
  printf("rank 0 killed while creating a 3-rank group:\n");
  uint8_t blobs[3 * TCC_ENDPOINT_BLOB_SIZE];
  tcc_endpoint_t *ep[3];
  for (int r = 0; r < 3; r++)
    CHECK(tcc_endpoint_open("127.0.0.1", &ep[r], blobs + r * TCC_ENDPOINT_BLOB_SIZE) == TCC_OK,
          "endpoint: %s", tcc_last_error());
  tcc_blob_t b0;
  memcpy(&b0, blobs, sizeof b0);
  tcc_segment_id_t id;
  tcc__segment_id("", b0.token, &id);
  outcome_t *o = shared_outcome();
  fflush(stdout);
  pid_t pids[3];
  for (int r = 0; r < 3; r++) {
    if (r == 1) {
      while (!name_exists(id.name)) usleep(1000);
    } else if (r == 2) { /* the late one */
      usleep(200 * 1000); /* rank 1 is waiting by now, in open or attach */
      kill_rank0(pids[0], o, 1);
      waitpid(pids[0], NULL, 0);
      waitpid(pids[1], NULL, 0);
      o->rank[r].since_ns = tcc__now_ns();
    }
    pids[r] = fork();
    if (pids[r] != 0) continue;
    tcc_comm_config_t cfg = {r, 3, 60000, "reap-test", TCC_TRANSPORT_SHM};
    tcc_comm_t *comm = NULL;
    atomic_fetch_add(&o->waiting, 1);
    tcc_result_t res = tcc_comm_create(&cfg, ep[r], blobs, &comm);
    snprintf(o->rank[r].msg, sizeof o->rank[r].msg, "%s", tcc_last_error());
    o->rank[r].done_ns = tcc__now_ns();
    o->rank[r].r = res;
    _exit(0);
  }
  for (int r = 0; r < 3; r++) tcc_endpoint_close(ep[r]);
  waitpid(pids[2], NULL, 0);
  check_waiters("in a group", o, 3);
  check_nothing_left("in a group", &id, 3);
  munmap(o, sizeof *o);
}

int main(void) {
  alarm(300); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  test_reaping();
  rank0_killed(0);
  rank0_killed(1);
  rank0_killed_in_group();
  printf("test_shm_reap: %s\n", check_failures ? "FAILED" : "ok");
  CHECK_DONE();
}
