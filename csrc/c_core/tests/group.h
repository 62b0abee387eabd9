/*
 * group.h - runs a function on every rank of a real multi-process group
 * forked from the test process; ranks swap endpoint blobs through an
 * anonymous shared mapping made before the fork. Include check.h first.
 */
#ifndef TCC_TESTS_GROUP_H
#define TCC_TESTS_GROUP_H

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/internal.h" /* tcc_blob_t, to fake other hosts */
#include "tccomm.h"

/* The widest group a test forks. */
#define GROUP_MAX_RANKS 12

typedef struct rendezvous {
  atomic_int published;
  uint8_t blobs[GROUP_MAX_RANKS * TCC_ENDPOINT_BLOB_SIZE];
} rendezvous_t;

typedef void (*rank_fn)(tcc_comm_t *comm);

/* A flag the test process and every rank it forks later share (zero at
 * first); exits when it cannot be mapped. */
static __attribute__((unused)) atomic_int *group_shared_flag(void) {
  atomic_int *flag = mmap(NULL, sizeof *flag, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (flag == MAP_FAILED) {
    perror("mmap");
    exit(2);
  }
  return flag;
}

/* Why this machine does not let one process read another's memory at all
 * (seccomp may forbid the call), or NULL when it does: tests of
 * single-copy movement skip, with the reason, where it does not. */
static __attribute__((unused)) const char *group_cma_unavailable(void) {
  static uint64_t word = 0x5eed;
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  pid_t child = fork();
  if (child == 0) {
    uint64_t seen = 0;
    struct iovec local = {&seen, sizeof seen}, far = {&word, sizeof word};
    char ok = process_vm_readv(getppid(), &local, 1, &far, 1, 0) == (ssize_t)sizeof seen && seen == word;
    if (write(fds[1], &ok, 1) != 1) _exit(1);
    _exit(0);
  }
  char ok = 0;
  if (read(fds[0], &ok, 1) != 1) ok = 0;
  waitpid(child, NULL, 0);
  close(fds[0]);
  close(fds[1]);
  return ok ? NULL : "process_vm_readv is refused on this machine (ptrace policy or seccomp)";
}

/* A send (`sending`) or receive of n bytes, blocking (no op handle) or
 * with a handle waited for at once. */
static __attribute__((unused)) tcc_result_t group_move_bytes(tcc_comm_t *comm, bool sending, uint8_t *p, size_t n,
                                                             int peer, uint64_t tag, bool blocking) {
  const tcc_buf_t b = {p, n, TCC_UINT8, -1, NULL};
  tcc_op_t *op = NULL, **handle = blocking ? NULL : &op;
  tcc_result_t r = sending ? tcc_send(comm, b, peer, tag, NULL, handle) : tcc_recv(comm, b, peer, tag, NULL, handle);
  if (r == TCC_OK && op) {
    r = tcc_op_wait(op, -1);
    tcc_op_release(op);
  }
  return r;
}

/* Set by a rank function that destroyed the communicator itself. */
static int group_comm_destroyed;

/* When set, every forked rank calls it before creating its communicator
 * (its own environment, process attributes). */
static void (*group_rank_setup)(int rank);

/* The simulated host of rank r under a spec's "-hosts" (a host per
 * rank), "-pairs" (ranks 2h and 2h+1 on host h), "-interleaved" (even
 * ranks on one host, odd on another), "-uneven" (rank 0 alone, the
 * others together), "-halves" (ranks 0-2 on one host, the others on
 * another) or "-threes" (ranks 3h .. 3h+2 on host h); -1: the real host. */
static int group_fake_host(const char *spec, int r) {
  if (strstr(spec, "-hosts")) return r;
  if (strstr(spec, "-pairs")) return r / 2;
  if (strstr(spec, "-interleaved")) return r % 2;
  if (strstr(spec, "-uneven")) return r > 0;
  if (strstr(spec, "-halves")) return r >= 3;
  if (strstr(spec, "-threes")) return r / 3;
  return -1;
}

/* The transport auto must choose for n ranks under spec: shm on one host,
 * tcp with a host per rank, the hybrid in between. */
static const char *group_auto_transport(const char *spec, int n) {
  int hosts = 0;
  for (int r = 0; r < n; r++) {
    int h = group_fake_host(spec, r), seen = 0;
    for (int q = 0; q < r; q++) seen |= group_fake_host(spec, q) == h;
    hosts += !seen;
  }
  return hosts == 1 ? "shm" : hosts == n ? "tcp" : "shm+tcp";
}

/* How a group is set up:
 *   "shm", "tcp"     that transport, forced;
 *   "auto"           chosen from the endpoints (all on this host: shm);
 *   "auto-hosts"     chosen, with every rank claiming its own host name (tcp);
 *   "auto-pairs", "auto-interleaved", "auto-uneven", "auto-halves", "auto-threes"
 *                    chosen, with the ranks claiming hosts as group_fake_host
 *                    says (the hybrid transport where some share a host);
 *   "shm-hosts"      shm forced across "hosts": creation must fail;
 *   "auto-shmdirs"   one host, but each rank claims a /dev/shm of its own (tcp);
 *   "shm-shmdirs"    shm forced there: creation must fail. */
static int __attribute__((unused)) run_group(int n, const char *spec, int64_t timeout_ms, const char *name, rank_fn fn) {
  rendezvous_t *rv = mmap(NULL, sizeof *rv, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  const int fake_hosts = group_fake_host(spec, 0) >= 0;
  const int fake_shm = strstr(spec, "-shmdirs") != NULL; /* one host, a /dev/shm per rank */
  const tcc_transport_t transport = strncmp(spec, "auto", 4) == 0 ? TCC_TRANSPORT_AUTO
                                    : strncmp(spec, "tcp", 3) == 0 ? TCC_TRANSPORT_TCP
                                                                   : TCC_TRANSPORT_SHM;
  const char *expected = transport == TCC_TRANSPORT_TCP || fake_shm ? "tcp"
                         : fake_hosts && transport == TCC_TRANSPORT_AUTO ? group_auto_transport(spec, n)
                                                                         : "shm";
  if (n < 1 || n > GROUP_MAX_RANKS) {
    fprintf(stderr, "run_group: %d ranks, at most %d\n", n, GROUP_MAX_RANKS);
    return 1;
  }
  pid_t pids[GROUP_MAX_RANKS];
  /* A rank's exit flushes what it inherited: lines printed before the fork
   * would appear once per rank when stdout is a file or a pipe. */
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] != 0) continue;
    check_failures = 0; /* a rank reports its own failures, not the cases before it */
    if (group_rank_setup) group_rank_setup(r);
    tcc_endpoint_t *ep;
    uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
    if (tcc_endpoint_open("127.0.0.1", &ep, blob) != TCC_OK) {
      fprintf(stderr, "endpoint: %s\n", tcc_last_error());
      _exit(2);
    }
    if (fake_hosts || fake_shm) {
      tcc_blob_t b;
      memcpy(&b, blob, sizeof b);
      if (fake_hosts) snprintf(b.hostname, sizeof b.hostname, "test-host-%d", group_fake_host(spec, r));
      if (fake_shm) b.shm_ino += (uint64_t)r;
      memcpy(blob, &b, sizeof b);
    }
    memcpy(rv->blobs + (size_t)r * TCC_ENDPOINT_BLOB_SIZE, blob, sizeof blob);
    atomic_fetch_add(&rv->published, 1);
    while (atomic_load(&rv->published) < n) usleep(1000);
    tcc_comm_config_t cfg = {r, n, timeout_ms, name, transport};
    tcc_comm_t *comm;
    tcc_result_t created = tcc_comm_create(&cfg, ep, rv->blobs, &comm);
    if (strcmp(spec, "shm-hosts") == 0 || strcmp(spec, "shm-shmdirs") == 0) {
      const char *why = fake_hosts ? "different hosts" : "do not share /dev/shm";
      CHECK(created == TCC_ERR_INVALID && strstr(tcc_last_error(), why), "%s: %s", spec, tcc_last_error());
      rank_exit(check_failures ? 1 : 0);
    }
    if (created != TCC_OK) {
      fprintf(stderr, "rank %d create: %s\n", r, tcc_last_error());
      _exit(2);
    }
    CHECK(strcmp(tcc_comm_transport_name(comm), expected) == 0, "%s: transport %s, expected %s", spec,
          tcc_comm_transport_name(comm), expected);
    if (fn) fn(comm);
    if (!group_comm_destroyed) tcc_comm_destroy(comm);
    rank_exit(check_failures ? 1 : 0);
  }
  int failed = 0;
  for (int r = 0; r < n; r++) {
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

#endif /* TCC_TESTS_GROUP_H */
