/*
 * test_p2p_direct.c - point-to-point messages by reference: the receiver
 * reads them once from the sender's memory and answers with a done frame
 * (src/host/p2p_direct.c over transport/shm/shm_cma.c), in real groups
 * of forked ranks; every payload checked byte for byte against values
 * computed here. The threshold is set to 16 KiB (TCCOMM_P2P_DIRECT_BYTES),
 * and which path a message took is read from the sender's count of bytes
 * sent by reference.
 *
 *  - Sizes around the threshold and past the ring's capacity, both
 *    directions, blocking calls and handles, over shm and over a hybrid
 *    group's ring (and its TCP, which never goes by reference).
 *  - Receives posted late (messages taken into buffers, the sends
 *    complete before any receive is posted), both ranks sending before
 *    they receive, an any-source receive, a receive of the wrong size
 *    (it fails naming the op, the sender completes, the stream goes on).
 *  - A receive posted and not waited on: the engine's thread reads the
 *    reference, so the send completes while its receiver does nothing.
 *  - TCCOMM_CMA=0 on one rank: nothing goes by reference, all arrives.
 *  - A receiver that exits without receiving: the send fails naming it;
 *    a sender that exits once its reference went out: the receive fails
 *    naming it.
 *    A send that times out waiting for its answer fails the communicator.
 *  - Garbage on the stream: a reference whose check word is wrong, a
 *    reference to memory that is not there, a done frame no send awaits:
 *    each fails with a message naming the sender and the cause.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "check.h"
#include "group.h"

#include "host/host.h"

#define THRESHOLD 16384

static tcc_buf_t bytes_of(void *p, size_t n) { return (tcc_buf_t){p, n, TCC_UINT8, -1, NULL}; }

static uint8_t byte_of(int from, int m, size_t i) { return (uint8_t)(from * 89 + m * 31 + (int)(i % 253) * 5 + 3); }

static void fill(uint8_t *p, size_t n, int from, int m) {
  for (size_t i = 0; i < n; i++) p[i] = byte_of(from, m, i);
}

static size_t wrong_bytes(const uint8_t *p, size_t n, int from, int m) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += p[i] != byte_of(from, m, i);
  return bad;
}

/* Bytes this rank has sent to `peer` by reference so far. */
static uint64_t by_ref_to(tcc_comm_t *comm, int peer) {
  pthread_mutex_lock(&comm->engine->p2p_progress);
  const uint64_t b = comm->engine->peers[peer].ref_bytes_sent;
  pthread_mutex_unlock(&comm->engine->p2p_progress);
  return b;
}


static const size_t sizes[] = {THRESHOLD - 1, THRESHOLD, THRESHOLD + 1, 300000, 3u << 20};
#define SIZES (sizeof sizes / sizeof *sizes)

/* Whether messages from this rank to `peer` may go by reference here. */
static bool refs_expected(tcc_comm_t *comm, int peer) {
  const char *t = tcc_comm_transport_name(comm);
  if (strcmp(t, "shm") == 0) return true;
  return comm->topo && comm->topo->host_of[peer] == comm->topo->host; /* a hybrid's ring */
}

/* Ranks 0 and 1 send each size to each other, blocking or not by turns;
 * a message goes by reference exactly when it is at least THRESHOLD
 * (and the ranks share memory). */
static void every_size(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  const int peer = 1 - me;
  uint8_t *buf = malloc(sizes[SIZES - 1]);
  for (int rep = 0; rep < 4; rep++)
    for (size_t k = 0; k < SIZES; k++) {
      const int m = rep * (int)SIZES + (int)k;
      for (int dir = 0; dir < 2; dir++) {
        const bool sending = (me == 0) == (dir == 0);
        const bool blocking = sending ? rep % 2 == 0 : rep < 2;
        if (sending) {
          const uint64_t before = by_ref_to(comm, peer);
          fill(buf, sizes[k], me, m);
          CHECK(group_move_bytes(comm, true, buf, sizes[k], peer, (uint64_t)m, blocking) == TCC_OK, "send of %zu B: %s",
                sizes[k], tcc_last_error());
          const uint64_t want = sizes[k] >= THRESHOLD && refs_expected(comm, peer) ? sizes[k] : 0;
          CHECK(by_ref_to(comm, peer) - before == want, "%s: a send of %zu B went %s by reference",
                tcc_comm_transport_name(comm), sizes[k], want ? "not" : "");
        } else {
          memset(buf, 0, sizes[k]);
          CHECK(group_move_bytes(comm, false, buf, sizes[k], peer, (uint64_t)m, blocking) == TCC_OK, "recv of %zu B: %s",
                sizes[k], tcc_last_error());
          const size_t bad = wrong_bytes(buf, sizes[k], peer, m);
          CHECK(bad == 0, "%zu of %zu bytes wrong (%s)", bad, sizes[k], tcc_comm_transport_name(comm));
        }
      }
    }
  free(buf);
}

enum { BIG = 1 << 20 };

/* Rank 0 sends tags 1..3 (handles) before rank 1 posts anything: rank 1
 * takes them when it receives tag 3, so all three sends complete before
 * it receives tags 1 and 2. Then both ranks send before they receive
 * (blocking), an any-source receive takes a reference, and a receive of
 * the wrong size fails while the sender completes. */
static void receive_late(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  const int peer = 1 - me;
  uint8_t *a = malloc(3 * (size_t)BIG), *b = malloc(BIG);
  if (me == 0) {
    tcc_op_t *ops[3];
    for (int t = 1; t <= 3; t++) {
      fill(a + (size_t)(t - 1) * BIG, BIG, 0, t);
      CHECK(tcc_send(comm, bytes_of(a + (size_t)(t - 1) * BIG, BIG), 1, (uint64_t)t, NULL, &ops[t - 1]) == TCC_OK,
            "send tag %d: %s", t, tcc_last_error());
    }
    for (int t = 0; t < 3; t++) {
      CHECK(tcc_op_wait(ops[t], -1) == TCC_OK, "send %d: %s", t + 1, tcc_op_error(ops[t]));
      tcc_op_release(ops[t]);
    }
    /* Rank 1 has taken all three; it receives tags 1 and 2 only now. */
    memset(a, 0, BIG);
    CHECK(group_move_bytes(comm, true, a, 1, 1, 9, true) == TCC_OK, "sends done: %s", tcc_last_error());
  } else {
    usleep(100 * 1000);
    CHECK(group_move_bytes(comm, false, b, BIG, 0, 3, true) == TCC_OK && wrong_bytes(b, BIG, 0, 3) == 0, "tag 3: %s",
          tcc_last_error());
    uint8_t one;
    CHECK(group_move_bytes(comm, false, &one, 1, 0, 9, true) == TCC_OK, "sends done: %s", tcc_last_error());
    for (int t = 1; t <= 2; t++)
      CHECK(group_move_bytes(comm, false, b, BIG, 0, (uint64_t)t, true) == TCC_OK && wrong_bytes(b, BIG, 0, t) == 0,
            "tag %d, taken before it was posted: %s", t, tcc_last_error());
  }
  /* Both send first. */
  fill(a, BIG, me, 20);
  CHECK(group_move_bytes(comm, true, a, BIG, peer, 20, true) == TCC_OK, "send before receive: %s", tcc_last_error());
  CHECK(group_move_bytes(comm, false, b, BIG, peer, 20, true) == TCC_OK && wrong_bytes(b, BIG, peer, 20) == 0,
        "receive after send: %s", tcc_last_error());
  /* Any source, then the wrong size, then the stream again. */
  if (me == 0) {
    for (int m = 30; m < 33; m++) {
      fill(a, BIG, 0, m);
      CHECK(group_move_bytes(comm, true, a, BIG, 1, 30, true) == TCC_OK, "send %d: %s", m, tcc_last_error());
    }
  } else {
    tcc_op_t *any;
    CHECK(tcc_recv(comm, bytes_of(b, BIG), TCC_ANY_SOURCE, 30, NULL, &any) == TCC_OK, "any-source: %s",
          tcc_last_error());
    CHECK(tcc_op_wait(any, -1) == TCC_OK && tcc_op_peer(any) == 0 && wrong_bytes(b, BIG, 0, 30) == 0,
          "any-source receive of a reference: %s", tcc_op_error(any));
    tcc_op_release(any);
    const tcc_result_t r = group_move_bytes(comm, false, b, BIG / 2, 0, 30, true);
    CHECK(r == TCC_ERR_MISMATCH && strstr(tcc_last_error(), "recv") && strstr(tcc_last_error(), "rank 0") &&
              strstr(tcc_last_error(), "tag 30") && strstr(tcc_last_error(), "size mismatch"),
          "a receive of half a reference: %s: %s", tcc_result_string(r), tcc_last_error());
    CHECK(group_move_bytes(comm, false, b, BIG, 0, 30, true) == TCC_OK && wrong_bytes(b, BIG, 0, 32) == 0,
          "the stream after a size mismatch: %s", tcc_last_error());
  }
  free(a);
  free(b);
}

/* Rank 1 posts a receive of a reference and leaves it for as long as it
 * takes rank 0's send to complete (up to 20 s, then the case fails): no
 * thread of rank 1 waits on it or polls it, so the engine's p2p thread
 * must read the message and answer. Only then does rank 1 wait on it. */
static atomic_int *send_completed;

static void posted_not_waited(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  uint8_t *p = malloc(BIG);
  for (int m = 40; m < 43; m++) {
    if (me == 0) {
      fill(p, BIG, 0, m);
      usleep(20 * 1000); /* after rank 1 posted, mostly */
      CHECK(group_move_bytes(comm, true, p, BIG, 1, (uint64_t)m, true) == TCC_OK, "send %d: %s", m,
            tcc_last_error());
      atomic_store(send_completed, m);
    } else {
      tcc_op_t *op;
      CHECK(tcc_recv(comm, bytes_of(p, BIG), 0, (uint64_t)m, NULL, &op) == TCC_OK, "recv %d: %s", m,
            tcc_last_error());
      for (int waited_ms = 0; atomic_load(send_completed) != m && waited_ms < 20000; waited_ms++) usleep(1000);
      CHECK(atomic_load(send_completed) == m, "send %d never completed while its receive was posted, not waited on",
            m);
      CHECK(tcc_op_wait(op, -1) == TCC_OK && wrong_bytes(p, BIG, 0, m) == 0, "recv %d: %s", m, tcc_op_error(op));
      tcc_op_release(op);
    }
  }
  CHECK(by_ref_to(comm, 1 - me) == (me == 0 ? 3u * BIG : 0), "rank %d: %llu bytes by reference", me,
        (unsigned long long)by_ref_to(comm, 1 - me));
  free(p);
}

/* Rank 1 runs with TCCOMM_CMA=0: it offers no reads and makes none. */
static void no_cma_on_rank1(int rank) {
  if (rank == 1) setenv("TCCOMM_CMA", "0", 1);
}

static void without_cma(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  const int peer = 1 - me;
  uint8_t *buf = malloc(BIG);
  for (int m = 0; m < 4; m++) {
    if ((me == 0) == (m % 2 == 0)) {
      fill(buf, BIG, me, m);
      CHECK(group_move_bytes(comm, true, buf, BIG, peer, (uint64_t)m, m < 2) == TCC_OK, "send: %s", tcc_last_error());
    } else {
      CHECK(group_move_bytes(comm, false, buf, BIG, peer, (uint64_t)m, m < 2) == TCC_OK && wrong_bytes(buf, BIG, peer, m) == 0,
            "recv: %s", tcc_last_error());
    }
  }
  CHECK(by_ref_to(comm, peer) == 0, "rank %d sent %llu bytes by reference with TCCOMM_CMA=0 on rank 1", me,
        (unsigned long long)by_ref_to(comm, peer));
  free(buf);
}

/* Rank 0 puts a reference on the stream and exits. Rank 1's engine may
 * have read the message while rank 0 still ran (it takes references into
 * a buffer at once, when no receive is posted): then the receive gets it
 * whole. Otherwise the receive cannot read it (the process is gone) and
 * fails naming the op and the sender. Never a hang, never other bytes. */
static void sender_exits(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  uint8_t *buf = malloc(BIG);
  if (me == 0) {
    fill(buf, BIG, 0, 6);
    tcc_op_t *op;
    CHECK(tcc_send(comm, bytes_of(buf, BIG), 1, 6, NULL, &op) == TCC_OK, "send: %s", tcc_last_error());
    CHECK(by_ref_to(comm, 1) == BIG, "the reference went out in the send's own round");
    _exit(0);
  }
  if (me == 1) {
    usleep(200 * 1000);
    memset(buf, 0, BIG);
    const tcc_result_t r = group_move_bytes(comm, false, buf, BIG, 0, 6, true);
    if (r == TCC_OK)
      CHECK(wrong_bytes(buf, BIG, 0, 6) == 0, "a message read before its sender exited arrived damaged");
    else
      CHECK(r == TCC_ERR_REMOTE && strstr(tcc_last_error(), "recv") && strstr(tcc_last_error(), "rank 0"),
            "a receive whose sender exited after its reference went out: %s: %s", tcc_result_string(r),
            tcc_last_error());
  }
  free(buf);
}

/* Rank 1 exits without receiving; rank 0's send fails naming it. */
static void receiver_exits(tcc_comm_t *comm) {
  if (tcc_comm_rank(comm) == 1) {
    usleep(200 * 1000);
    _exit(0);
  }
  if (tcc_comm_rank(comm) != 0) return;
  uint8_t *buf = calloc(1, BIG);
  const tcc_result_t r = group_move_bytes(comm, true, buf, BIG, 1, 5, true);
  CHECK(r == TCC_ERR_REMOTE && strstr(tcc_last_error(), "send") && strstr(tcc_last_error(), "rank 1"),
        "a send whose receiver exited: %s: %s", tcc_result_string(r), tcc_last_error());
  free(buf);
}

/* Rank 0's send (a 300 ms timeout) waits for an answer rank 1 never
 * gives: it fails, and so does the communicator (rank 1 could still read
 * the buffer). */
static void send_times_out(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me == 1) {
    usleep(1500 * 1000);
    return;
  }
  if (me != 0) return;
  uint8_t *buf = calloc(1, BIG);
  const tcc_op_opts_t opts = {.timeout_ms = 300};
  tcc_op_t *op;
  CHECK(tcc_send(comm, bytes_of(buf, BIG), 1, 5, &opts, &op) == TCC_OK, "issue: %s", tcc_last_error());
  const tcc_result_t r = tcc_op_wait(op, -1);
  CHECK(r == TCC_ERR_TIMEOUT && strstr(tcc_op_error(op), "send") && strstr(tcc_op_error(op), "rank 1"),
        "a send never answered: %s: %s", tcc_result_string(r), tcc_op_error(op));
  tcc_op_release(op);
  const tcc_result_t again = group_move_bytes(comm, true, buf, 8, 1, 6, true);
  CHECK(again != TCC_OK && strstr(tcc_last_error(), "before its peer read it"),
        "after such a timeout the communicator must be failed: %s: %s", tcc_result_string(again), tcc_last_error());
  free(buf);
}

/* What rank 1 puts on its stream to rank 0 in garbage_frames. */
static int garbage_kind;

static void write_raw(tcc_comm_t *comm, const void *p, size_t n) {
  tcc_err_t err = {TCC_OK, {0}};
  size_t sent = 0;
  while (sent < n) {
    const ssize_t k = comm->ops->p2p_write(comm, 0, &(struct iovec){(char *)p + sent, n - sent}, 1, &err);
    CHECK(k >= 0, "writing garbage: %s", err.msg);
    if (k < 0) return;
    sent += (size_t)k;
  }
}

/* Rank 1 writes a reference frame with a bad check word (0), one to an
 * address nothing is mapped at (1), or a done frame for no send (2: token
 * 5, in the tag's place);
 * rank 0's receive fails naming rank 1 and the cause. */
static void garbage_frames(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me == 1) {
    struct {
      tcc_p2p_frame_t f;
      tcc_p2p_ref_t ref;
    } w;
    tcc__p2p_frame_make(&w.f, garbage_kind == 2 ? TCC_P2P_DONE : TCC_P2P_REF, 5, garbage_kind == 2 ? 0 : BIG);
    tcc__p2p_ref_make(&w.ref, 4096, 77); /* page 1: never mapped */
    if (garbage_kind == 0) w.ref.addr += 64;
    write_raw(comm, &w, garbage_kind == 2 ? sizeof w.f : sizeof w);
    usleep(500 * 1000);
    return;
  }
  if (me != 0) return;
  uint8_t *buf = calloc(1, BIG);
  const tcc_result_t r = group_move_bytes(comm, false, buf, BIG, 1, 5, true);
  const char *want[] = {"a reference whose check word does not match", "Bad address", "a done frame for token 5"};
  CHECK(r != TCC_OK && strstr(tcc_last_error(), "rank 1") && strstr(tcc_last_error(), want[garbage_kind]),
        "garbage %d on the stream: %s: %s", garbage_kind, tcc_result_string(r), tcc_last_error());
  free(buf);
}

int main(void) {
  char threshold[32];
  snprintf(threshold, sizeof threshold, "%d", THRESHOLD);
  setenv("TCCOMM_P2P_DIRECT_BYTES", threshold, 1);
  alarm(600); /* a hang fails the test instead of blocking CI */
  /* Where the kernel refuses single-copy reads nothing goes by reference,
   * which the cases below would take for a failure of the path. */
  const char *unavailable = group_cma_unavailable();
  if (unavailable) {
    printf("skip test_p2p_direct: %s\n", unavailable);
    return 0;
  }
  const char *const specs[] = {"shm", "auto-pairs", "auto-interleaved"};
  for (size_t g = 0; g < sizeof specs / sizeof *specs; g++) {
    const int n = strncmp(specs[g], "auto", 4) == 0 ? 4 : 2;
    CHECK(run_group(n, specs[g], 60000, "direct-sizes", every_size) == 0, "every size, %s", specs[g]);
  }
  CHECK(run_group(2, "shm", 60000, "direct-late", receive_late) == 0, "receives posted late");
  CHECK(run_group(4, "auto-pairs", 60000, "direct-late", receive_late) == 0, "receives posted late, hybrid");
  send_completed = group_shared_flag();
  CHECK(run_group(2, "shm", 60000, "direct-unwaited", posted_not_waited) == 0, "a receive posted, not waited on");
  CHECK(run_group(4, "auto-pairs", 60000, "direct-unwaited", posted_not_waited) == 0,
        "a receive posted, not waited on, hybrid");
  group_rank_setup = no_cma_on_rank1;
  CHECK(run_group(2, "shm", 60000, "direct-off", without_cma) == 0, "TCCOMM_CMA=0 on rank 1");
  group_rank_setup = NULL;
  CHECK(run_group(2, "shm", 30000, "direct-exit", receiver_exits) == 0, "the receiver exits");
  CHECK(run_group(2, "shm", 30000, "direct-timeout", send_times_out) == 0, "a send times out");
  CHECK(run_group(2, "shm", 30000, "direct-sender-exit", sender_exits) == 0, "the sender exits");
  for (garbage_kind = 0; garbage_kind < 3; garbage_kind++)
    CHECK(run_group(2, "shm", 30000, "direct-garbage", garbage_frames) == 0, "garbage %d", garbage_kind);
  CHECK_DONE();
}
