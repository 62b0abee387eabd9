/*
 * test_direct.c - single-copy data movement (coll/coll_direct.c over
 * transport/shm/shm_cma.c) in real shared-memory groups of forked ranks.
 *
 * Every movement op (broadcast from each root, allgather in and out of
 * place, gather, scatter, all-to-all-v, in place too) is checked element
 * for element against values computed here, at sizes below, at and above
 * the single-copy threshold and across several windows. Which path ran is
 * proved by the number of stage barriers the op took, read from the
 * segment's state: 2 for single-copy reads, one per window otherwise, one
 * more when the group fell back after a rank had skipped staging its first
 * window. Groups:
 *   direct   every rank can read its peers;
 *   one-off  one rank runs with TCCOMM_CMA=0: nobody reads directly;
 *   refused  the kernel refuses one direction (rank 0 is not dumpable and
 *            rank 1 drops CAP_SYS_PTRACE): rank 0 can read rank 1 but not
 *            the other way round, so the group falls back, and restages
 *            the first window where rank 0 had skipped it.
 * Each group runs with a threshold of 16 KiB, the direct group also with 4
 * bytes: then the smallest streams, which otherwise travel in the
 * descriptor's cache line, move directly too (or are staged again).
 * Then the default threshold, without TCCOMM_SHM_DIRECT_BYTES: 16 KiB when
 * rank 0 may use a CPU per rank, none (SIZE_MAX: every collective staged)
 * when it is bound to fewer CPUs than the group has ranks (rank 0's choice
 * holds for every rank).
 */
#include <sched.h>
#include <linux/capability.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "check.h"
#include "group.h"
#include "transport/shm/shm.h"

#define WINDOW 65536u       /* TCCOMM_SHM_WINDOW_BYTES */
static size_t direct_threshold; /* TCCOMM_SHM_DIRECT_BYTES of the group running */
#define MAX_N 4

typedef enum { GROUP_DIRECT, GROUP_ONE_OFF, GROUP_REFUSED, GROUP_OWN_CPUS, GROUP_BOUND_APART, GROUP_SHARED_CPUS } group_kind_t;
static group_kind_t kind;
static size_t *verdicts; /* [MAX_N], shared by the forked ranks: each one's direct_bytes */

static tcc_buf_t host_buf(void *p, size_t count) { return (tcc_buf_t){p, count, TCC_INT32, -1, NULL}; }

static uint32_t value(int source, size_t i) { return (uint32_t)source * 2654435761u + (uint32_t)i * 40503u + 17u; }

static tcc_result_t finish(tcc_result_t r, tcc_op_t *op) {
  if (r != TCC_OK) return r;
  r = tcc_op_wait(op, -1);
  if (r != TCC_OK) fprintf(stderr, "op failed: %s\n", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}
#define RUN(call) ({ tcc_op_t *op = NULL; tcc_result_t r_ = (call); finish(r_, op); })

/* The stages an op whose ranks' streams are streams[] must take. */
static uint64_t expected_stages(int n, const size_t *streams) {
  size_t longest = 0;
  for (int j = 0; j < n; j++) longest = streams[j] > longest ? streams[j] : longest;
  bool every_rank_reads = true, skipped = false;
  for (int j = 0; j < n; j++) {
    every_rank_reads &= longest >= verdicts[j];
    skipped |= streams[j] > 0 && streams[j] >= verdicts[j];
  }
  if (every_rank_reads) return 2;
  uint64_t windows = (longest + WINDOW - 1) / WINDOW;
  return (windows ? windows : 1) + skipped;
}

static uint64_t stage_now(tcc_comm_t *comm) { return shm_of(comm)->stage; }

#define CHECK_STAGES(comm, before, streams, what, count)                                                  \
  do {                                                                                                    \
    uint64_t took_ = stage_now(comm) - (before), want_ = expected_stages(tcc_comm_size(comm), streams);   \
    CHECK(took_ == want_, "%s of %zu: %llu stages, expected %llu", what, count, (unsigned long long)took_, \
          (unsigned long long)want_);                                                                     \
  } while (0)

static size_t mismatches(const uint32_t *got, int source, size_t count, size_t *first) {
  size_t bad = 0;
  for (size_t i = 0; i < count; i++)
    if (got[i] != value(source, i) && bad++ == 0) *first = i;
  return bad;
}

#define CHECK_DATA(got, source, count, what)                                                     \
  do {                                                                                           \
    size_t first_ = 0, bad_ = mismatches(got, source, count, &first_);                           \
    CHECK(bad_ == 0, "%s of %zu from %d: %zu wrong, first at %zu", what, count, source, bad_, first_); \
  } while (0)

static void test_broadcast(tcc_comm_t *comm, size_t count) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  uint32_t *buf = malloc(count * 4 + 4);
  for (int root = 0; root < n; root++) {
    for (size_t i = 0; i < count; i++) buf[i] = me == root ? value(root, i) : 0xdeadbeef;
    size_t streams[MAX_N] = {0};
    streams[root] = count * 4;
    uint64_t before = stage_now(comm);
    CHECK(RUN(tcc_broadcast(comm, host_buf(buf, count), root, NULL, &op)) == TCC_OK, "broadcast");
    CHECK_STAGES(comm, before, streams, "broadcast", count);
    CHECK_DATA(buf, root, count, "broadcast");
  }
  free(buf);
}

static void test_allgather(tcc_comm_t *comm, size_t count, bool in_place) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  uint32_t *all = malloc((size_t)n * count * 4 + 4), *mine = malloc(count * 4 + 4);
  tcc_buf_t recvs[MAX_N];
  for (int j = 0; j < n; j++) recvs[j] = host_buf(all + (size_t)j * count, count);
  memset(all, 0xee, (size_t)n * count * 4);
  uint32_t *send = in_place ? all + (size_t)me * count : mine;
  for (size_t i = 0; i < count; i++) send[i] = value(me, i);
  size_t streams[MAX_N];
  for (int j = 0; j < n; j++) streams[j] = count * 4;
  uint64_t before = stage_now(comm);
  CHECK(RUN(tcc_allgather(comm, host_buf(send, count), recvs, NULL, &op)) == TCC_OK, "allgather");
  CHECK_STAGES(comm, before, streams, in_place ? "allgather in place" : "allgather", count);
  for (int j = 0; j < n; j++) CHECK_DATA(all + (size_t)j * count, j, count, "allgather");
  free(all);
  free(mine);
}

static void test_gather_scatter(tcc_comm_t *comm, size_t count) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm), root = n - 1;
  uint32_t *all = malloc((size_t)n * count * 4 + 4), *one = malloc(count * 4 + 4);
  tcc_buf_t bufs[MAX_N];
  for (int j = 0; j < n; j++) bufs[j] = host_buf(all + (size_t)j * count, count);
  size_t streams[MAX_N];

  for (size_t i = 0; i < count; i++) one[i] = value(me, i);
  memset(all, 0xee, (size_t)n * count * 4);
  for (int j = 0; j < n; j++) streams[j] = j == root ? 0 : count * 4;
  uint64_t before = stage_now(comm);
  CHECK(RUN(tcc_gather(comm, host_buf(one, count), me == root ? bufs : NULL, root, NULL, &op)) == TCC_OK, "gather");
  CHECK_STAGES(comm, before, streams, "gather", count);
  if (me == root)
    for (int j = 0; j < n; j++) CHECK_DATA(all + (size_t)j * count, j, count, "gather");

  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < count; i++) all[(size_t)j * count + i] = value(j, i);
  memset(one, 0xee, count * 4);
  for (int j = 0; j < n; j++) streams[j] = j == root ? (size_t)(n - 1) * count * 4 : 0;
  before = stage_now(comm);
  CHECK(RUN(tcc_scatter(comm, me == root ? bufs : NULL, host_buf(one, count), root, NULL, &op)) == TCC_OK, "scatter");
  CHECK_STAGES(comm, before, streams, "scatter", count);
  CHECK_DATA(one, me, count, "scatter");
  free(all);
  free(one);
}

/* Rank j sends count * (j + 1) elements to every peer (all-to-all-v with
 * unequal streams: the largest decides), or count to each in place. */
static size_t a2a_count(int from, size_t count, bool uneven) { return uneven ? count * (size_t)(from + 1) : count; }

static void test_alltoall(tcc_comm_t *comm, size_t count, bool uneven, bool in_place) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  uint32_t *sendbuf[MAX_N], *recvbuf[MAX_N];
  tcc_buf_t sends[MAX_N], recvs[MAX_N];
  size_t streams[MAX_N] = {0};
  for (int j = 0; j < n; j++) {
    const size_t out = a2a_count(me, count, uneven), in = a2a_count(j, count, uneven);
    recvbuf[j] = malloc((in > out ? in : out) * 4 + 4);
    sendbuf[j] = in_place ? recvbuf[j] : malloc(out * 4 + 4);
    for (size_t i = 0; i < out; i++) sendbuf[j][i] = value(me * MAX_N + j, i);
    if (!in_place) memset(recvbuf[j], 0xee, in * 4);
    sends[j] = host_buf(sendbuf[j], out);
    recvs[j] = host_buf(recvbuf[j], in);
    for (int k = 0; k < n; k++)
      if (k != j) streams[j] += a2a_count(j, count, uneven) * 4;
  }
  uint64_t before = stage_now(comm);
  CHECK(RUN(tcc_alltoall(comm, sends, recvs, NULL, &op)) == TCC_OK, "alltoall");
  CHECK_STAGES(comm, before, streams, in_place ? "alltoall in place" : uneven ? "alltoallv" : "alltoall", count);
  for (int j = 0; j < n; j++) {
    CHECK_DATA(recvbuf[j], j * MAX_N + me, a2a_count(j, count, uneven), "alltoall");
    if (!in_place) free(sendbuf[j]);
    free(recvbuf[j]);
  }
}

static void exchange_verdicts(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  verdicts[me] = shm_of(comm)->direct_bytes;
  CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier");
  for (int j = 0; j < n; j++) {
    const size_t v = verdicts[j];
    switch (kind) {
      case GROUP_DIRECT: CHECK(v == direct_threshold, "direct group: rank %d cannot read its peers", j); break;
      case GROUP_ONE_OFF: CHECK(v == SIZE_MAX, "one rank offers no reads, yet rank %d reads", j); break;
      case GROUP_REFUSED:
        CHECK(v == (j == 0 ? direct_threshold : SIZE_MAX), "refused group: rank %d's verdict is %zu", j, v);
        break;
      default: break;
    }
  }
}

/* A buffer of `bytes` starting `offset` bytes past a page boundary;
 * *base is what to free. */
static uint32_t *at_page_offset(size_t bytes, size_t offset, void **base) {
  char *p = aligned_alloc(4096, (bytes + offset + 4096) / 4096 * 4096);
  *base = p;
  return p ? (uint32_t *)(p + offset) : NULL;
}

/* Single-copy reads and writes whose destination lies a few bytes after
 * their source modulo 4096, where the kernel's rep movsb is slow and the
 * move goes through a bounce buffer (shm_cma.c), over more than one
 * bounce-buffer's worth (256 KiB): receiving buffers `offset` bytes past a
 * page boundary, sending ones on it, and the other way round. */
static void test_page_offsets(tcc_comm_t *comm, size_t recv_offset, size_t send_offset) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm), root = n - 1;
  const size_t count = 66560; /* 260 KiB: a whole number of pages, so every block keeps its page offset */
  const size_t bytes = count * 4;
  void *recv_base, *send_base;
  uint32_t *all = at_page_offset((size_t)n * bytes, recv_offset, &recv_base);
  uint32_t *one = at_page_offset(bytes, send_offset, &send_base);
  tcc_buf_t bufs[MAX_N];
  for (int j = 0; j < n; j++) bufs[j] = host_buf(all + (size_t)j * count, count);

  for (size_t i = 0; i < count; i++) one[i] = value(me, i);
  memset(all, 0xee, (size_t)n * bytes);
  CHECK(RUN(tcc_allgather(comm, host_buf(one, count), bufs, NULL, &op)) == TCC_OK, "allgather at page offsets");
  for (int j = 0; j < n; j++) CHECK_DATA(all + (size_t)j * count, j, count, "allgather at page offsets");

  /* The root's blocks on one side, every receiver's buffer on the other. */
  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < count; i++) all[(size_t)j * count + i] = value(j, i);
  memset(one, 0xee, bytes);
  CHECK(RUN(tcc_scatter(comm, me == root ? bufs : NULL, host_buf(one, count), root, NULL, &op)) == TCC_OK,
        "scatter at page offsets");
  CHECK_DATA(one, me, count, "scatter at page offsets");

  uint32_t *b = me == root ? one : all; /* the root's at send_offset, the others' at recv_offset */
  for (size_t i = 0; i < count; i++) b[i] = me == root ? value(root, i) : 0xdeadbeef;
  CHECK(RUN(tcc_broadcast(comm, host_buf(b, count), root, NULL, &op)) == TCC_OK, "broadcast at page offsets");
  CHECK_DATA(b, root, count, "broadcast at page offsets");
  free(recv_base);
  free(send_base);
}

static void all_ops(tcc_comm_t *comm) {
  exchange_verdicts(comm);
  /* Below, at and above the threshold, within one window and across many. */
  const size_t counts[] = {0,    1,    6,    7, direct_threshold / 4 - 1, direct_threshold / 4, 1000, 5000,
                           WINDOW / 4 + 3, 100003};
  for (size_t k = 0; k < sizeof counts / sizeof *counts; k++) {
    const size_t count = counts[k];
    test_broadcast(comm, count);
    test_allgather(comm, count, false);
    test_allgather(comm, count, true);
    test_gather_scatter(comm, count);
    test_alltoall(comm, count, false, false);
    test_alltoall(comm, count, true, false);
    test_alltoall(comm, count, false, true);
  }
  test_page_offsets(comm, 16, 0);
  test_page_offsets(comm, 4, 4080);
  test_page_offsets(comm, 0, 40);
}

static const char *default_name(group_kind_t k) {
  return k == GROUP_OWN_CPUS ? "a CPU per rank" : k == GROUP_BOUND_APART ? "each rank bound to a CPU of its own"
                                                                        : "both ranks bound to one CPU";
}

/* The group's threshold when nobody sets it: rank 0's, from the CPUs the
 * ranks may use between them. */
static void default_threshold(tcc_comm_t *comm) {
  const uint64_t want = kind == GROUP_SHARED_CPUS ? SIZE_MAX : 16384, got = shm_of(comm)->hdr->direct_bytes;
  CHECK(got == want, "%s: rank %d sees a threshold of %llu bytes, expected %llu", default_name(kind),
        tcc_comm_rank(comm), (unsigned long long)got, (unsigned long long)want);
}

/* Binds this process to the nth CPU it may use. */
static void bind_to_allowed_cpu(int nth) {
  cpu_set_t allowed, one;
  CPU_ZERO(&one);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &allowed) && nth-- == 0) CPU_SET(c, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) perror("sched_setaffinity");
}

/* CPUs this process may use. */
static int allowed_cpus(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}

/* Drops CAP_SYS_PTRACE from this process: reading a non-dumpable peer is
 * then refused by the kernel. */
static void drop_ptrace_capability(void) {
  struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  if (syscall(SYS_capget, &head, data) != 0) return;
  data[CAP_SYS_PTRACE / 32].effective &= ~(1u << (CAP_SYS_PTRACE % 32));
  data[CAP_SYS_PTRACE / 32].permitted &= ~(1u << (CAP_SYS_PTRACE % 32));
  if (syscall(SYS_capset, &head, data) != 0) perror("capset");
}

static void rank_setup(int rank) {
  switch (kind) {
    case GROUP_DIRECT: break;
    case GROUP_ONE_OFF:
      if (rank == 1) setenv("TCCOMM_CMA", "0", 1);
      break;
    case GROUP_REFUSED:
      if (rank == 0) prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
      if (rank == 1) drop_ptrace_capability();
      break;
    case GROUP_OWN_CPUS: break;
    case GROUP_BOUND_APART: bind_to_allowed_cpu(rank); break;
    case GROUP_SHARED_CPUS: bind_to_allowed_cpu(0); break;
  }
}

int main(void) {
  alarm(600); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  unsetenv("TCCOMM_CMA");
  /* Every op over the windows or single-copy, as the stages counted here
   * assume: small rooted ops would take the slot rings (test_slots.c). */
  setenv("TCCOMM_SHM_SLOT_BYTES", "0", 1);
  char window[32];
  snprintf(window, sizeof window, "%u", WINDOW);
  setenv("TCCOMM_SHM_WINDOW_BYTES", window, 1);
  verdicts = mmap(NULL, MAX_N * sizeof *verdicts, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  group_rank_setup = rank_setup;
  const char *unavailable = group_cma_unavailable();
  const struct { const char *name; group_kind_t kind; int n; size_t threshold; } groups[] = {
      {"direct", GROUP_DIRECT, 2, 16384},   {"direct", GROUP_DIRECT, 3, 16384},   {"direct", GROUP_DIRECT, 4, 16384},
      {"one-off", GROUP_ONE_OFF, 3, 16384}, {"refused", GROUP_REFUSED, 2, 16384}, {"direct", GROUP_DIRECT, 3, 4},
      {"one-off", GROUP_ONE_OFF, 3, 4},     {"refused", GROUP_REFUSED, 2, 4},
  };
  int passed = 0, failed = 0;
  for (size_t g = 0; g < sizeof groups / sizeof *groups; g++) {
    kind = groups[g].kind;
    direct_threshold = groups[g].threshold;
    if (kind != GROUP_ONE_OFF && unavailable) {
      printf("skip %s n=%d: %s\n", groups[g].name, groups[g].n, unavailable);
      continue;
    }
    char direct[32];
    snprintf(direct, sizeof direct, "%zu", direct_threshold);
    setenv("TCCOMM_SHM_DIRECT_BYTES", direct, 1);
    int bad = run_group(groups[g].n, "shm", 60000, "direct-group", all_ops);
    printf("%s %s n=%d, threshold %zu\n", bad ? "FAIL" : "ok  ", groups[g].name, groups[g].n, direct_threshold);
    bad ? failed++ : passed++;
  }
  unsetenv("TCCOMM_SHM_DIRECT_BYTES");
  const group_kind_t defaults[] = {GROUP_OWN_CPUS, GROUP_BOUND_APART, GROUP_SHARED_CPUS};
  for (size_t g = 0; g < 3; g++) {
    kind = defaults[g];
    const char *name = default_name(kind);
    if (kind != GROUP_SHARED_CPUS && allowed_cpus() < 2) {
      printf("skip default threshold, %s: this process may use only one CPU\n", name);
      continue;
    }
    int bad = run_group(2, "shm", 60000, "direct-default", default_threshold);
    printf("%s default threshold, %s n=2\n", bad ? "FAIL" : "ok  ", name);
    bad ? failed++ : passed++;
  }
  printf("test_direct: %d groups passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
