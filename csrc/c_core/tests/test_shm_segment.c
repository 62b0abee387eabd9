/*
 * test_shm_segment.c - shared-memory segments are trusted only once
 * verified, and fail at setup, never at first touch:
 *   - objects planted under a segment's name (garbage, a truncated header,
 *     a wrong mode, owner or secret, a size the header does not state,
 *     pages not reserved, an object never completed) are refused with a
 *     clear error, promptly, without a crash;
 *   - rank 0's lock is judged only once the object has a size: a rank 0
 *     that locks and grows it just after a waiting rank looked is not taken
 *     for dead, one that dies just after the look is, within a poll;
 *   - the shm transport's header is checked field by field against the
 *     layout recomputed from rank 0's published tunables, which win over
 *     this rank's own environment;
 *   - mappings are not inherited by forked children;
 *   - in a private mount namespace with a small /dev/shm: rank 0 fails at
 *     creation naming needed and free bytes and the way out, the waiting
 *     ranks fail promptly with rank 0's reason (also when /dev/shm is so
 *     full that not even a page fits), for groups and for windows, and
 *     nothing is left behind. Skipped, saying why, without root.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "transport/shm/shm.h"
#include "transport/shm/shm_segment.h"
#include "tccomm.h"

#define SKIP_EXIT 77

static const char *WHO = "tccomm 'seg-test' (rank 1)";

static double now_s(void) { return (double)tcc__now_ns() * 1e-9; }

static void fresh_id(const char *kind, tcc_segment_id_t *id) {
  uint8_t token[TCC_TOKEN_BYTES];
  CHECK(tcc__random_bytes(token, sizeof token) == TCC_OK, "random token");
  tcc__segment_id(kind, token, id);
}

static int name_exists(const char *name) {
  int fd = shm_open(name, O_RDONLY, 0);
  if (fd < 0) return 0;
  close(fd);
  return 1;
}

/* An object under `name` with `len` bytes of `data`, then `mode`. */
static void plant(const char *name, mode_t mode, const void *data, size_t len) {
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(fd >= 0, "plant %s: %s", name, strerror(errno));
  if (fd < 0) return;
  CHECK(len == 0 || write(fd, data, len) == (ssize_t)len, "plant: write");
  CHECK(fchmod(fd, mode) == 0, "plant: fchmod");
  close(fd);
}

/* Opens `id` as rank 1 of 2 with `budget_ms`; returns the result and
 * reports the message and the time it took. Unmaps on success. */
static tcc_result_t open_rank1(const tcc_segment_id_t *id, int64_t budget_ms, char *msg, double *secs) {
  tcc_err_t err = {TCC_OK, ""};
  void *base = NULL;
  size_t bytes = 0;
  double t0 = now_s();
  tcc_result_t r = tcc__segment_open(id, 1, 2, tcc__deadline_after_ms(budget_ms), WHO, &base, &bytes, NULL, &err);
  *secs = now_s() - t0;
  snprintf(msg, TCC_ERRLEN, "%s", err.msg);
  if (r == TCC_OK) munmap(base, bytes);
  return r;
}

/* A refusal: code, a phrase of the message, no waiting, and the message
 * names the caller. */
static void expect_refusal(const char *what, const tcc_segment_id_t *id, tcc_result_t code, const char *phrase) {
  char msg[TCC_ERRLEN];
  double secs;
  tcc_result_t r = open_rank1(id, 5000, msg, &secs);
  CHECK(r == code, "%s: got %s, expected %s: %s", what, tcc_result_string(r), tcc_result_string(code), msg);
  CHECK(strstr(msg, phrase) && strstr(msg, WHO), "%s: message lacks '%s': %s", what, phrase, msg);
  CHECK(secs < 1.0, "%s: took %.2f s instead of failing at once", what, secs);
  printf("  %-22s %s\n", what, msg);
}

/* A real segment of `bytes`, created and published as rank 0 of 2.
 * *creator: the creating descriptor, whose lock tells the other ranks that
 * rank 0 lives; close it (tcc__fd_close) when done. */
static void *real_segment(const tcc_segment_id_t *id, size_t bytes, int *creator) {
  tcc_err_t err = {TCC_OK, ""};
  void *base = NULL;
  *creator = -1;
  tcc_result_t r = tcc__segment_create(id, bytes, 2, "tccomm 'seg-test' (rank 0)", &base, creator, &err);
  CHECK(r == TCC_OK, "create: %s", err.msg);
  if (r != TCC_OK) return NULL;
  tcc__segment_publish(base);
  return base;
}

/* A stage barrier's arrival word keeps a stage's low 32 bits: a rank has
 * reached a stage when its word is at most 2^31 - 1 stages past it, so a
 * job's 2^32nd stage reads as the next one, not as stage 0. */
static void test_stage_wrap(void) {
  const uint64_t around[] = {1, 2, 1000, (1ull << 31) - 1, 1ull << 31, (1ull << 32) - 2, (1ull << 32) - 1,
                             1ull << 32, (1ull << 32) + 1, (5ull << 32) + 7};
  for (size_t i = 0; i < sizeof around / sizeof *around; i++) {
    const uint64_t s = around[i];
    CHECK(shm_stage_reached((uint32_t)s, s), "stage %llu: its own arrival", (unsigned long long)s);
    CHECK(shm_stage_reached((uint32_t)(s + 2), s), "stage %llu: the next of its parity", (unsigned long long)s);
    CHECK(!shm_stage_reached((uint32_t)(s - 2), s), "stage %llu: the last of its parity", (unsigned long long)s);
    CHECK(!shm_stage_reached((uint32_t)(s - 1), s), "stage %llu: the one before", (unsigned long long)s);
  }
  CHECK(!shm_stage_reached(0, 1), "a fresh word reached stage 1");
}

static void test_names(void) {
  uint8_t token[TCC_TOKEN_BYTES] = {0xde, 0xad, 0xbe, 0xef};
  tcc_segment_id_t a, b, c;
  tcc__segment_id("", token, &a);
  tcc__segment_id("", token, &b);
  tcc__segment_id("win-", token, &c);
  CHECK(strcmp(a.name, b.name) == 0 && memcmp(a.secret, b.secret, sizeof a.secret) == 0, "deterministic");
  CHECK(strncmp(a.name, "/tccomm-", 8) == 0 && strlen(a.name) == 8 + 32, "name %s", a.name);
  CHECK(strncmp(c.name, "/tccomm-win-", 12) == 0, "window name %s", c.name);
  /* The name shows neither the token nor the secret. */
  CHECK(strstr(a.name, "deadbeef") == NULL, "token visible in %s", a.name);
  char secret_hex[40] = "";
  for (int i = 0; i < 4; i++) snprintf(secret_hex + 2 * i, 3, "%02x", a.secret[i]);
  CHECK(strstr(a.name, secret_hex) == NULL, "secret visible in %s", a.name);
}

static void test_round_trip(void) {
  tcc_segment_id_t id;
  fresh_id("", &id);
  int creator;
  char *base = real_segment(&id, 3 * 4096, &creator);
  if (!base) return;
  strcpy(base + 5000, "hello");
  tcc_err_t err = {TCC_OK, ""};
  char *peer = NULL;
  size_t bytes = 0;
  tcc_result_t r =
      tcc__segment_open(&id, 1, 2, tcc__deadline_after_ms(5000), WHO, (void **)&peer, &bytes, NULL, &err);
  CHECK(r == TCC_OK && bytes == 3 * 4096 && strcmp(peer + 5000, "hello") == 0, "open: %s", err.msg);
  /* A forked child (a DataLoader worker, say) does not inherit either
   * mapping: msync reports the range as unmapped there. */
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) _exit(msync(base, 4096, MS_ASYNC) == 0 || (peer && msync(peer, 4096, MS_ASYNC) == 0) ? 1 : 0);
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "a forked child still maps the segment");
  if (r == TCC_OK) munmap(peer, bytes);
  munmap(base, 3 * 4096);
  shm_unlink(id.name);
  tcc__fd_close(creator);
}

static void test_planted_objects(void) {
  static char junk[3 * 4096];
  memset(junk, 0xab, sizeof junk);
  tcc_segment_id_t id;
  printf("objects planted under a segment's name:\n");

  fresh_id("", &id);
  plant(id.name, 0600, junk, sizeof junk);
  expect_refusal("garbage", &id, TCC_ERR_INVALID, "not a tccomm segment");
  shm_unlink(id.name);

  fresh_id("", &id);
  plant(id.name, 0600, junk, 100);
  expect_refusal("truncated header", &id, TCC_ERR_INVALID, "less than a segment header");
  shm_unlink(id.name);

  fresh_id("", &id);
  plant(id.name, 0640, junk, sizeof junk);
  expect_refusal("wrong mode", &id, TCC_ERR_INVALID, "mode 0640");
  shm_unlink(id.name);

  /* Genuine segments, then altered. */
  fresh_id("", &id);
  int creator;
  void *base = real_segment(&id, 2 * 4096, &creator);
  tcc_segment_id_t other = id;
  other.secret[0] ^= 1;
  expect_refusal("wrong secret", &other, TCC_ERR_INVALID, "secret does not match");
  if (base) ((tcc_segment_head_t *)base)->total_bytes = 4 * 4096;
  expect_refusal("size not the stated", &id, TCC_ERR_INVALID, "header says 16384");
  if (base) ((tcc_segment_head_t *)base)->total_bytes = 2 * 4096;
  int fd = shm_open(id.name, O_RDWR, 0);
  CHECK(fd >= 0 && fchmod(fd, 0644) == 0, "chmod");
  expect_refusal("mode widened", &id, TCC_ERR_INVALID, "mode 0644");
  if (geteuid() == 0) {
    CHECK(fchmod(fd, 0600) == 0 && fchown(fd, 4242, (gid_t)-1) == 0, "chown");
    expect_refusal("foreign owner", &id, TCC_ERR_INVALID, "owned by uid 4242");
  }
  /* Grown past what was reserved: touching the tail could SIGBUS. */
  CHECK(fchown(fd, geteuid(), (gid_t)-1) == 0 && fchmod(fd, 0600) == 0 && ftruncate(fd, 64 * 4096) == 0, "grow");
  if (base) ((tcc_segment_head_t *)base)->total_bytes = 64 * 4096;
  expect_refusal("pages not reserved", &id, TCC_ERR_INVALID, "reserved");
  if (fd >= 0) close(fd);
  if (base) munmap(base, 2 * 4096);
  shm_unlink(id.name);
  tcc__fd_close(creator);

  /* An empty object that never becomes a segment: a timeout, on time. */
  fresh_id("", &id);
  plant(id.name, 0600, junk, 0);
  char msg[TCC_ERRLEN];
  double secs;
  tcc_result_t r = open_rank1(&id, 300, msg, &secs);
  CHECK(r == TCC_ERR_TIMEOUT && strstr(msg, "never became a complete segment"), "never completed: %s", msg);
  CHECK(secs >= 0.25 && secs < 3, "never completed: %.2f s for a 300 ms budget", secs);
  printf("  %-22s %s\n", "never completed", msg);
  shm_unlink(id.name);

  /* Rank 0's "no room at all" signal: mode 0400, the needed size. The one
   * other rank acknowledges it and, being the last, removes everything. */
  fresh_id("", &id);
  plant(id.name, 0400, junk, 0);
  fd = shm_open(id.name, O_RDWR, 0);
  CHECK(fd >= 0 && ftruncate(fd, 123456) == 0, "size the signal");
  if (fd >= 0) close(fd);
  expect_refusal("rank 0 had no room", &id, TCC_ERR_SYSTEM, "rank 0 could not create the shared-memory segment");
  char ack[80];
  snprintf(ack, sizeof ack, "%s.1", id.name);
  CHECK(!name_exists(id.name) && !name_exists(ack), "the signal and its acknowledgement are left behind");
}

/* ---- rank 0's lock, at the moment it is looked at ------------------------- */

/* The test plays rank 0 through its own descriptor: an open-file-description
 * lock taken on it conflicts with the waiting rank's descriptor even within
 * one process. */
static int slow_creator = -1;
static int lock_looks;

static void lock_byte0(int fd) {
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
  CHECK(fcntl(fd, F_OFD_SETLK, &fl) == 0, "lock byte 0: %s", strerror(errno));
}

/* Rank 0 between its exclusive creation and its lock, then done with both
 * (locked, first page reserved, not ready) the moment the lock is looked
 * at: a look at the lock taken before the object had a size would now find
 * the object grown and rank 0 seemingly gone. */
static void lock_and_grow_at_look(void) {
  if (lock_looks++ > 0) return;
  lock_byte0(slow_creator);
  CHECK(posix_fallocate(slow_creator, 0, TCC_SEGMENT_HEAD_BYTES) == 0, "reserve the head");
}

/* Rank 0 dies right after a look found it alive. */
static void die_at_look(void) {
  if (lock_looks++ == 0) tcc__fd_close(slow_creator);
}

static void test_lock_looks(void) {
  printf("rank 0's lock, at the moment it is looked at:\n");
  tcc_segment_id_t id;
  char msg[TCC_ERRLEN];
  double secs;

  /* Created, not yet locked: rank 0 is alive, and slow. Rank 1 waits for
   * it and times out; it never calls it dead. */
  fresh_id("", &id);
  slow_creator = shm_open(id.name, O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(slow_creator >= 0, "create: %s", strerror(errno));
  lock_looks = 0;
  tcc__segment_lock_looked = lock_and_grow_at_look;
  tcc_result_t r = open_rank1(&id, 300, msg, &secs);
  CHECK(r == TCC_ERR_TIMEOUT && strstr(msg, "never became a complete segment"),
        "a slow rank 0 taken for dead: %s", msg);
  printf("  %-22s %s\n", "slow to lock", msg);
  /* Where no look came while the object was empty, rank 0 gets there now:
   * locked and sized, it is waited for as well. */
  if (lock_looks == 0) {
    lock_and_grow_at_look();
    r = open_rank1(&id, 300, msg, &secs);
    CHECK(r == TCC_ERR_TIMEOUT && strstr(msg, "never became a complete segment"),
          "a locked rank 0 taken for dead: %s", msg);
  }
  shm_unlink(id.name);
  close(slow_creator);

  /* Locked and sized, not ready; it dies after the first look. */
  fresh_id("", &id);
  slow_creator = shm_open(id.name, O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(slow_creator >= 0, "create: %s", strerror(errno));
  lock_byte0(slow_creator);
  CHECK(posix_fallocate(slow_creator, 0, TCC_SEGMENT_HEAD_BYTES) == 0, "reserve the head");
  lock_looks = 0;
  tcc__segment_lock_looked = die_at_look;
  r = open_rank1(&id, 5000, msg, &secs);
  CHECK(r == TCC_ERR_REMOTE && strstr(msg, "rank 0 exited during shared-memory setup") && strstr(msg, "before it was ready"),
        "rank 0 died after a look: %s", msg);
  CHECK(lock_looks >= 2 && secs < 1.0, "rank 0 died after a look: found after %d looks, %.2f s", lock_looks, secs);
  printf("  %-22s %s\n", "dies after a look", msg);
  tcc__segment_lock_looked = NULL;
  /* The finder left its orphan signal, which rank 1 acknowledged as the
   * last rank: nothing stays. */
  char ack[80];
  snprintf(ack, sizeof ack, "%s.1", id.name);
  CHECK(!name_exists(id.name) && !name_exists(ack), "the orphan signal and its acknowledgement are left behind");
}

/* ---- the transport's header ----------------------------------------------- */

typedef void (*corrupt_fn)(shm_header_t *h);

static void no_change(shm_header_t *h) { (void)h; }
static void data_off_out_of_bounds(shm_header_t *h) { h->data_off = h->seg.total_bytes + 4096; }
static void ring_off_huge(shm_header_t *h) { h->ring_off = 1ULL << 62; }
static void other_window(shm_header_t *h) { h->window += 4096; }
static void odd_window(shm_header_t *h) { h->window = 100; }
static void small_over_window(shm_header_t *h) { h->small_bytes = h->window + 1; }
static void span_past_ring(shm_header_t *h) {
  h->slot_span_bytes = tcc__coll_slot_span_capacity(SHM_SLOTS, h->slot_bytes) + 1;
}
static void other_size(shm_header_t *h) { h->size = 3; }

/* Rank 0 is a forked child creating a real 2-rank group with its own
 * tunables; this process alters the published header as `corrupt` says,
 * then creates rank 1 with other tunables in its environment. */
static void transport_case(const char *what, corrupt_fn corrupt, const char *phrase) {
  uint8_t blobs[2 * TCC_ENDPOINT_BLOB_SIZE];
  tcc_endpoint_t *ep[2];
  for (int r = 0; r < 2; r++)
    CHECK(tcc_endpoint_open("127.0.0.1", &ep[r], blobs + r * TCC_ENDPOINT_BLOB_SIZE) == TCC_OK,
          "endpoint: %s", tcc_last_error());
  tcc_blob_t b0;
  memcpy(&b0, blobs, sizeof b0);
  tcc_segment_id_t id;
  tcc__segment_id("", b0.token, &id);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("TCCOMM_SHM_WINDOW_BYTES", "65536", 1);
    setenv("TCCOMM_SHM_SMALL_BYTES", "0", 1);
    tcc_comm_config_t cfg = {0, 2, 20000, "seg-test", TCC_TRANSPORT_SHM};
    tcc_comm_t *comm;
    if (tcc_comm_create(&cfg, ep[0], blobs, &comm) == TCC_OK) tcc_comm_destroy(comm);
    _exit(0);
  }
  tcc_endpoint_close(ep[0]);
  /* The published header, through a verified mapping of our own. */
  tcc_err_t e = {TCC_OK, ""};
  shm_header_t *h = NULL;
  size_t bytes = 0;
  tcc_result_t r = tcc__segment_open(&id, 1, 2, tcc__deadline_after_ms(10000), WHO, (void **)&h, &bytes, NULL, &e);
  CHECK(r == TCC_OK, "%s: rank 0's segment: %s", what, e.msg);
  if (r == TCC_OK) corrupt(h);
  setenv("TCCOMM_SHM_WINDOW_BYTES", "1048576", 1);
  setenv("TCCOMM_SHM_SMALL_BYTES", "4096", 1);
  tcc_comm_config_t cfg = {1, 2, 20000, "seg-test", TCC_TRANSPORT_SHM};
  tcc_comm_t *comm = NULL;
  double t0 = now_s();
  r = tcc_comm_create(&cfg, ep[1], blobs, &comm);
  double secs = now_s() - t0;
  unsetenv("TCCOMM_SHM_WINDOW_BYTES");
  unsetenv("TCCOMM_SHM_SMALL_BYTES");
  if (!phrase) {
    CHECK(r == TCC_OK, "%s: %s", what, tcc_last_error());
    /* Rank 0's tunables, not this rank's environment. */
    shm_state_t *st = comm ? shm_of(comm) : NULL;
    CHECK(st && st->window == 65536 && st->small_bytes == 0, "%s: window %zu, small %zu", what,
          st ? st->window : 0, st ? st->small_bytes : 0);
    if (comm) tcc_comm_destroy(comm);
  } else {
    CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), phrase) && strstr(tcc_last_error(), "'seg-test' (rank 1)") &&
              strstr(tcc_last_error(), "not trusted"),
          "%s: %s: %s", what, tcc_result_string(r), tcc_last_error());
    CHECK(secs < 2.0, "%s: took %.2f s", what, secs);
    printf("  %-22s %s\n", what, tcc_last_error());
    kill(pid, SIGKILL); /* it would wait for rank 1 until its timeout */
  }
  int status;
  waitpid(pid, &status, 0);
  if (h) munmap(h, bytes);
  shm_unlink(id.name);
}

/* A shared-memory size in the environment that is not a byte count in its
 * range fails the rank that reads it at once (each rank reads its own,
 * before the segment: rank 1 does not wait for a rank 0 that never
 * comes), with TCC_ERR_INVALID naming the variable and the value. */
static void test_bad_tunables(void) {
  static const struct {
    const char *name, *value;
  } cases[] = {
      {"TCCOMM_SHM_SLOT_BYTES", "262144"},           /* past the largest slot */
      {"TCCOMM_SHM_SLOT_SPAN_BYTES", "4194304"},     /* past what the default ring holds */
      {"TCCOMM_SHM_WINDOW_BYTES", "12ab"},           /* not a number */
      {"TCCOMM_SHM_WINDOW_BYTES", "1024"},           /* below a page */
      {"TCCOMM_SHM_SMALL_BYTES", "-1"},              /* negative */
      {"TCCOMM_SHM_SMALL_BYTES", "1048576"},         /* past the window */
      {"TCCOMM_SHM_DIRECT_BYTES", "99999999999999999999999"}, /* overflows */
      {"TCCOMM_P2P_DIRECT_BYTES", "64k"},            /* no suffixes */
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int rank = 0; rank < 2; rank++) {
      uint8_t blobs[2 * TCC_ENDPOINT_BLOB_SIZE];
      tcc_endpoint_t *ep[2];
      for (int r = 0; r < 2; r++)
        CHECK(tcc_endpoint_open("127.0.0.1", &ep[r], blobs + r * TCC_ENDPOINT_BLOB_SIZE) == TCC_OK,
              "endpoint: %s", tcc_last_error());
      setenv(cases[i].name, cases[i].value, 1);
      tcc_comm_config_t cfg = {rank, 2, 20000, "bad-tunable", TCC_TRANSPORT_SHM};
      tcc_comm_t *comm = NULL;
      const double t0 = now_s();
      const tcc_result_t r = tcc_comm_create(&cfg, ep[rank], blobs, &comm);
      const double secs = now_s() - t0;
      unsetenv(cases[i].name);
      char want[128];
      snprintf(want, sizeof want, "%s='%s' is not a byte count", cases[i].name, cases[i].value);
      CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), want) && strstr(tcc_last_error(), "bad-tunable") &&
                secs < 10,
            "%s=%s on rank %d: %s after %.1f s: %s", cases[i].name, cases[i].value, rank, tcc_result_string(r), secs,
            tcc_last_error());
      if (r == TCC_OK) tcc_comm_destroy(comm);
      tcc_endpoint_close(ep[1 - rank]); /* tcc_comm_create took ep[rank], failing or not */
    }
}

static void test_transport_header(void) {
  printf("the shm transport's header, as rank 1 sees it:\n");
  transport_case("published tunables", no_change, NULL);
  transport_case("data_off out of bounds", data_off_out_of_bounds, "data_off is");
  transport_case("ring_off huge", ring_off_huge, "ring_off is");
  transport_case("another window", other_window, "ring_off is");
  transport_case("window not 4K-aligned", odd_window, "window of 100 bytes");
  transport_case("small > window", small_over_window, "small-message threshold");
  transport_case("parts over more slots than the ring has", span_past_ring, "exceed the");
  transport_case("other group size", other_size, "laid out for 3 ranks");
}

/* ---- a small /dev/shm ------------------------------------------------------ */

typedef struct rendezvous {
  atomic_int published;
  uint8_t blobs[2 * TCC_ENDPOINT_BLOB_SIZE];
} rendezvous_t;

/* What a rank sees: creation's result, message and duration; `comm` when
 * it succeeded (the rank function then owns it). */
typedef void (*rank_fn)(int rank, tcc_result_t r, const char *err, double secs, tcc_comm_t *comm);

static int run_pair(int64_t timeout_ms, rank_fn fn) {
  rendezvous_t *rv = mmap(NULL, sizeof *rv, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pid_t pids[2];
  fflush(stdout); /* or the children print it again */
  for (int r = 0; r < 2; r++) {
    pids[r] = fork();
    if (pids[r] != 0) continue;
    tcc_endpoint_t *ep;
    uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
    if (tcc_endpoint_open("127.0.0.1", &ep, blob) != TCC_OK) _exit(2);
    memcpy(rv->blobs + (size_t)r * TCC_ENDPOINT_BLOB_SIZE, blob, sizeof blob);
    atomic_fetch_add(&rv->published, 1);
    while (atomic_load(&rv->published) < 2) usleep(1000);
    tcc_comm_config_t cfg = {r, 2, timeout_ms, "small-shm", TCC_TRANSPORT_SHM};
    tcc_comm_t *comm = NULL;
    double t0 = now_s();
    tcc_result_t res = tcc_comm_create(&cfg, ep, rv->blobs, &comm);
    fn(r, res, tcc_last_error(), now_s() - t0, res == TCC_OK ? comm : NULL);
    fflush(stdout);
    _exit(check_failures ? 1 : 0);
  }
  int failed = 0;
  for (int r = 0; r < 2; r++) {
    int status;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = 1;
      if (WIFSIGNALED(status)) fprintf(stderr, "rank %d died of signal %d\n", r, WTERMSIG(status));
    }
  }
  munmap(rv, sizeof *rv);
  return failed;
}

/* Rank 0 names needed and free bytes and the way out; rank 1 says that
 * rank 0 failed and why, promptly, although its timeout is a minute. */
static void check_no_room(int rank, tcc_result_t r, const char *err, double secs, const char *cause) {
  CHECK(r == TCC_ERR_SYSTEM, "rank %d: %s: %s", rank, tcc_result_string(r), err);
  CHECK(strstr(err, "cannot reserve") && strstr(err, "bytes free") && strstr(err, "TCCOMM_TRANSPORT=tcp") &&
            strstr(err, "--shm-size") && strstr(err, cause),
        "rank %d: %s", rank, err);
  char me[32];
  snprintf(me, sizeof me, "(rank %d)", rank);
  CHECK(strstr(err, "'small-shm'") && strstr(err, me), "rank %d: names no group or rank: %s", rank, err);
  if (rank == 1) CHECK(strstr(err, "rank 0 could not create the shared-memory segment"), "rank 1: %s", err);
  CHECK(secs < 5, "rank %d: failed after %.2f s", rank, secs);
  printf("  rank %d after %.2f s: %s\n", rank, secs, err);
}

static void too_small(int rank, tcc_result_t r, const char *err, double secs, tcc_comm_t *comm) {
  if (comm) tcc_comm_destroy(comm);
  check_no_room(rank, r, err, secs, "No space left on device");
}

static void full(int rank, tcc_result_t r, const char *err, double secs, tcc_comm_t *comm) {
  if (comm) tcc_comm_destroy(comm);
  check_no_room(rank, r, err, secs, rank == 0 ? "No space left on device" : "not even its first page fit");
}

/* The group fits; a window of 4 MiB per rank does not. */
static void window_too_big(int rank, tcc_result_t r, const char *err, double secs, tcc_comm_t *comm) {
  (void)secs;
  CHECK(r == TCC_OK, "rank %d: the group should fit: %s", rank, err);
  if (!comm) return;
  tcc_window_t *win = NULL;
  double t0 = now_s();
  tcc_result_t wr = tcc_window_create(comm, 4u << 20, 60000, &win);
  double wsecs = now_s() - t0;
  CHECK(wr == TCC_ERR_SYSTEM && strstr(tcc_last_error(), "tccomm window on 'small-shm'") && strstr(tcc_last_error(), "bytes free") &&
            strstr(tcc_last_error(), "TCCOMM_TRANSPORT=tcp"),
        "rank %d window: %s: %s", rank, tcc_result_string(wr), tcc_last_error());
  if (rank == 1) CHECK(strstr(tcc_last_error(), "rank 0 could not create"), "rank 1 window: %s", tcc_last_error());
  CHECK(wsecs < 5, "rank %d window failed after %.2f s", rank, wsecs);
  printf("  rank %d window after %.2f s: %s\n", rank, wsecs, tcc_last_error());
  if (win) tcc_window_destroy(win);
  /* The group itself is still fine. */
  tcc_op_t *op = NULL;
  CHECK(tcc_barrier(comm, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "rank %d: barrier after", rank);
  if (op) tcc_op_release(op);
  tcc_comm_destroy(comm);
}

static int leftovers(void) {
  DIR *d = opendir("/dev/shm");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (strncmp(e->d_name, "tccomm-", 7) == 0) {
      fprintf(stderr, "left behind: /dev/shm/%s\n", e->d_name);
      n++;
    }
  }
  closedir(d);
  return n;
}

static int mount_shm(const char *size) {
  umount2("/dev/shm", MNT_DETACH); /* the previous case's */
  char opts[32];
  snprintf(opts, sizeof opts, "size=%s", size);
  return mount("tmpfs", "/dev/shm", "tmpfs", 0, opts);
}

/* Fills /dev/shm until not one more page fits. */
static void fill_shm(void) {
  int fd = open("/dev/shm/filler", O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  CHECK(fd >= 0, "filler: %s", strerror(errno));
  static char page[4096];
  while (fd >= 0 && write(fd, page, sizeof page) == (ssize_t)sizeof page) {
  }
  if (fd >= 0) close(fd);
}

/* Runs in a child of its own, which moves into a private mount namespace. */
static int small_shm_cases(void) {
  if (unshare(CLONE_NEWNS) != 0) {
    printf("SKIP small /dev/shm cases: unshare(CLONE_NEWNS) failed: %s (needs root or CAP_SYS_ADMIN)\n",
           strerror(errno));
    return SKIP_EXIT;
  }
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 || mount_shm("1m") != 0) {
    printf("SKIP small /dev/shm cases: cannot mount a private tmpfs on /dev/shm: %s\n", strerror(errno));
    return SKIP_EXIT;
  }
  int failed = 0;
  printf("a 2-rank group on a 1 MiB /dev/shm:\n");
  failed |= run_pair(60000, too_small);
  CHECK(leftovers() == 0, "objects left in /dev/shm");

  printf("a 2-rank group on a full /dev/shm:\n");
  CHECK(mount_shm("1m") == 0, "remount");
  fill_shm();
  failed |= run_pair(60000, full);
  unlink("/dev/shm/filler");
  CHECK(leftovers() == 0, "objects left in /dev/shm");

  printf("a 4 MiB window on a 16 MiB /dev/shm:\n");
  CHECK(mount_shm("16m") == 0, "remount");
  failed |= run_pair(60000, window_too_big);
  CHECK(leftovers() == 0, "objects left in /dev/shm");
  return failed || check_failures ? 1 : 0;
}

static int test_small_shm(void) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    int rc = small_shm_cases();
    fflush(stdout);
    _exit(rc);
  }
  int status;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == SKIP_EXIT) return 0;
  return !WIFEXITED(status) || WEXITSTATUS(status) != 0;
}

int main(void) {
  alarm(300); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  unsetenv("TCCOMM_SHM_WINDOW_BYTES");
  unsetenv("TCCOMM_SHM_SMALL_BYTES");
  test_stage_wrap();
  test_names();
  test_round_trip();
  test_planted_objects();
  test_lock_looks();
  test_transport_header();
  test_bad_tunables();
  int failed = test_small_shm();
  printf("test_shm_segment: %s\n", failed || check_failures ? "FAILED" : "ok");
  if (failed) return 1;
  CHECK_DONE();
}
