/*
 * test_p2p_now.c - blocking sends and receives (no op handle), which the
 * host executor moves in the calling thread when its engine is idle for
 * the peer (src/host/p2p_now.c), in real groups of forked ranks; every
 * payload checked byte for byte against values computed here.
 *
 *  - Sizes around every boundary of those paths (0 B, the read-ahead
 *    buffer's room, one gathered write) over shm, tcp and the hybrid, in
 *    both directions, blocking calls meeting calls with handles.
 *  - What must make a blocking call give way to the rounds, each checked
 *    by where the messages end up: another tag at the front of the
 *    stream, messages buffered from the peer (one on the same tag as the
 *    next frame of the stream), an any-source receive
 *    posted before, sends still queued to the peer, a ring too full to
 *    take the message whole, a receive buffer of the wrong size.
 *  - Two threads per rank sending and receiving blocking on one
 *    communicator at once, each on its own tag.
 *  - A peer that exits without destroying, an abort from another thread
 *    during a blocking receive, garbage where a record of the shared-memory
 *    ring starts: the call fails with the code, and tcc_last_error() names
 *    the op, the group, the peer and the cause.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "group.h"

#include "transport/shm/shm.h"

static tcc_buf_t bytes_of(void *p, size_t n) { return (tcc_buf_t){p, n, TCC_UINT8, -1, NULL}; }

static double within_s(double s) { return getenv("TCC_TEST_SLOW") ? 5 * s : s; }

/* Byte i of message `m` from rank `from`. */
static uint8_t byte_of(int from, int m, size_t i) { return (uint8_t)(from * 101 + m * 37 + (int)(i % 251) * 7 + 1); }

static void fill(uint8_t *p, size_t n, int from, int m) {
  for (size_t i = 0; i < n; i++) p[i] = byte_of(from, m, i);
}

/* Bytes of p that differ from message m of rank `from`. */
static size_t wrong_bytes(const uint8_t *p, size_t n, int from, int m) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += p[i] != byte_of(from, m, i);
  return bad;
}


static tcc_result_t send_msg(tcc_comm_t *comm, uint8_t *p, size_t n, int peer, uint64_t tag, bool blocking) {
  return group_move_bytes(comm, true, p, n, peer, tag, blocking);
}

static tcc_result_t recv_msg(tcc_comm_t *comm, uint8_t *p, size_t n, int peer, uint64_t tag, bool blocking) {
  return group_move_bytes(comm, false, p, n, peer, tag, blocking);
}

/* The read-ahead buffer holds 1024 bytes, a frame header 24: 1000 is the
 * largest message taken straight from it. 65536 is the largest sent in
 * one gathered write. */
static const size_t sizes[] = {0, 1, 8, 232, 999, 1000, 1001, 4096, 65536, 65537, 300000};
#define SIZES (sizeof sizes / sizeof *sizes)

/* Ranks 0 and 1 send each size to each other, the receiver blocking and
 * the sender blocking or not by turns (and the other way round). */
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
          fill(buf, sizes[k], me, m);
          CHECK(send_msg(comm, buf, sizes[k], peer, (uint64_t)m, blocking) == TCC_OK, "send of %zu B: %s", sizes[k],
                tcc_last_error());
        } else {
          memset(buf, 0, sizes[k]);
          CHECK(recv_msg(comm, buf, sizes[k], peer, (uint64_t)m, blocking) == TCC_OK, "recv of %zu B: %s", sizes[k],
                tcc_last_error());
          const size_t bad = wrong_bytes(buf, sizes[k], peer, m);
          CHECK(bad == 0, "%zu of %zu bytes wrong (%s receive, %s)", bad, sizes[k], blocking ? "blocking" : "handle",
                tcc_comm_transport_name(comm));
        }
      }
    }
  free(buf);
}

/* Waits until both ranks got here (ranks 0 and 1 only). */
static void pair_barrier(tcc_comm_t *comm) {
  uint8_t x = 0;
  const int peer = 1 - tcc_comm_rank(comm);
  CHECK(send_msg(comm, &x, 1, peer, 999, true) == TCC_OK && recv_msg(comm, &x, 1, peer, 999, true) == TCC_OK,
        "pair barrier: %s", tcc_last_error());
}

/* Messages for receives other than the blocking one, or in its way. */
static void others_first(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  uint8_t a[8], b[8], c[40];
  if (me == 0) {
    /* tags 1, 2, 3: received 2, 1, 3. */
    for (int t = 1; t <= 3; t++) {
      fill(a, sizeof a, 0, t);
      CHECK(send_msg(comm, a, sizeof a, 1, (uint64_t)t, true) == TCC_OK, "send tag %d: %s", t, tcc_last_error());
    }
    /* Two on tag 5: the first for an any-source receive posted before. */
    pair_barrier(comm);
    for (int m = 0; m < 2; m++) {
      fill(a, sizeof a, 0, 50 + m);
      CHECK(send_msg(comm, a, sizeof a, 1, 5, true) == TCC_OK, "send %d on tag 5: %s", m, tcc_last_error());
    }
    /* 8 bytes for a receive of 40, then 40 for it again. */
    fill(a, sizeof a, 0, 60);
    CHECK(send_msg(comm, a, sizeof a, 1, 6, true) == TCC_OK, "send of 8 B: %s", tcc_last_error());
    fill(c, sizeof c, 0, 61);
    CHECK(send_msg(comm, c, sizeof c, 1, 6, true) == TCC_OK, "send of 40 B: %s", tcc_last_error());
    /* Tag 7 buffered behind tag 8, then another tag 7 at the front of the
     * stream: the buffered one is the first. */
    for (int m = 0; m < 2; m++) {
      fill(a, sizeof a, 0, 70 + m);
      CHECK(send_msg(comm, a, sizeof a, 1, (uint64_t)(7 + m), true) == TCC_OK, "send tag %d: %s", 7 + m,
            tcc_last_error());
    }
    pair_barrier(comm);
    fill(a, sizeof a, 0, 72);
    CHECK(send_msg(comm, a, sizeof a, 1, 7, true) == TCC_OK, "second send on tag 7: %s", tcc_last_error());
    return;
  }
  usleep(50 * 1000); /* all three there before the first receive */
  CHECK(recv_msg(comm, b, sizeof b, 0, 2, true) == TCC_OK && wrong_bytes(b, sizeof b, 0, 2) == 0,
        "tag 2 behind tag 1: %s", tcc_last_error());
  CHECK(recv_msg(comm, b, sizeof b, 0, 1, true) == TCC_OK && wrong_bytes(b, sizeof b, 0, 1) == 0,
        "tag 1, buffered: %s", tcc_last_error());
  CHECK(recv_msg(comm, b, sizeof b, 0, 3, true) == TCC_OK && wrong_bytes(b, sizeof b, 0, 3) == 0,
        "tag 3 after the buffered ones: %s", tcc_last_error());
  tcc_op_t *any;
  uint8_t first[8];
  CHECK(tcc_recv(comm, bytes_of(first, sizeof first), TCC_ANY_SOURCE, 5, NULL, &any) == TCC_OK, "any-source: %s",
        tcc_last_error());
  pair_barrier(comm);
  CHECK(recv_msg(comm, b, sizeof b, 0, 5, true) == TCC_OK, "tag 5 after an any-source receive: %s", tcc_last_error());
  CHECK(tcc_op_wait(any, -1) == TCC_OK && tcc_op_peer(any) == 0, "any-source receive: %s", tcc_op_error(any));
  tcc_op_release(any);
  CHECK(wrong_bytes(first, sizeof first, 0, 50) == 0 && wrong_bytes(b, sizeof b, 0, 51) == 0,
        "the any-source receive posted first must take the first message");
  memset(c, 0, sizeof c);
  usleep(50 * 1000); /* both on tag 6 there: more than 40 bytes after the header */
  const tcc_result_t r = recv_msg(comm, c, sizeof c, 0, 6, true);
  CHECK(r == TCC_ERR_MISMATCH && strstr(tcc_last_error(), "recv") && strstr(tcc_last_error(), "rank 0") &&
            strstr(tcc_last_error(), "tag 6") && strstr(tcc_last_error(), "size mismatch"),
        "a receive of 40 B for 8: %s: %s", tcc_result_string(r), tcc_last_error());
  CHECK(recv_msg(comm, c, sizeof c, 0, 6, true) == TCC_OK && wrong_bytes(c, sizeof c, 0, 61) == 0,
        "the stream after a size mismatch: %s", tcc_last_error());
  CHECK(recv_msg(comm, b, sizeof b, 0, 8, true) == TCC_OK && wrong_bytes(b, sizeof b, 0, 71) == 0,
        "tag 8 behind tag 7: %s", tcc_last_error());
  pair_barrier(comm);
  usleep(50 * 1000); /* the second on tag 7 there too */
  for (int m = 0; m < 2; m++) {
    memset(b, 0, sizeof b);
    CHECK(recv_msg(comm, b, sizeof b, 0, 7, true) == TCC_OK, "recv %d on tag 7: %s", m, tcc_last_error());
    CHECK(wrong_bytes(b, sizeof b, 0, m == 0 ? 70 : 72) == 0, "receive %d on tag 7 took the wrong message", m);
  }
}

/* Sends the ring cannot take whole, and sends queued to the peer before
 * blocking ones: all arrive, in order. Rank 1 starts receiving late, so
 * the ring fills: of a send with a handle the ring takes a part, and the
 * rest waits queued (below 64 KiB nobody but the caller's next call
 * moves it) while the blocking send behind it finds room. */
enum { SMALL_SENDS = 40000, MID_SENDS = 200, MID = 60 << 10 };

static void queued_first(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  if (me > 1) return;
  uint8_t small[40];
  uint8_t *mid = malloc((size_t)MID_SENDS * MID);
  if (me == 0) {
    /* 40000 frames of 64 B: more than a ring of 1 MiB holds. */
    for (int m = 0; m < SMALL_SENDS; m++) {
      fill(small, sizeof small, 0, m);
      CHECK(send_msg(comm, small, sizeof small, 1, 1, true) == TCC_OK, "small send %d: %s", m, tcc_last_error());
    }
    tcc_op_t *ops[MID_SENDS];
    for (int k = 0; k < MID_SENDS; k++) {
      fill(mid + (size_t)k * MID, MID, 0, 100 + k);
      CHECK(tcc_send(comm, bytes_of(mid + (size_t)k * MID, MID), 1, 2, NULL, &ops[k]) == TCC_OK, "send: %s",
            tcc_last_error());
      fill(small, sizeof small, 0, 1000 + k);
      CHECK(send_msg(comm, small, sizeof small, 1, 3, true) == TCC_OK, "send %d behind a queued one: %s", k,
            tcc_last_error());
    }
    for (int k = 0; k < MID_SENDS; k++) {
      CHECK(tcc_op_wait(ops[k], -1) == TCC_OK, "send with a handle: %s", tcc_op_error(ops[k]));
      tcc_op_release(ops[k]);
    }
  } else {
    usleep(200 * 1000);
    size_t bad = 0;
    for (int m = 0; m < SMALL_SENDS; m++) {
      CHECK(recv_msg(comm, small, sizeof small, 0, 1, true) == TCC_OK, "small recv %d: %s", m, tcc_last_error());
      bad += wrong_bytes(small, sizeof small, 0, m) != 0;
    }
    CHECK(bad == 0, "%zu of %d small messages wrong or out of order", bad, SMALL_SENDS);
    usleep(100 * 1000);
    for (int k = 0; k < MID_SENDS; k++) {
      CHECK(recv_msg(comm, mid, MID, 0, 2, true) == TCC_OK, "recv %d of 60 KiB: %s", k, tcc_last_error());
      bad += wrong_bytes(mid, MID, 0, 100 + k) != 0;
      CHECK(recv_msg(comm, small, sizeof small, 0, 3, true) == TCC_OK, "recv %d behind 60 KiB: %s", k,
            tcc_last_error());
      bad += wrong_bytes(small, sizeof small, 0, 1000 + k) != 0;
    }
    CHECK(bad == 0, "%zu messages sent behind queued ones wrong or out of order", bad);
  }
  free(mid);
}

/* Two threads of ranks 0 and 1 each send to and receive from the other
 * rank's thread of the same tag, blocking, at once. */
enum { THREAD_MSGS = 3000 };

typedef struct talker {
  tcc_comm_t *comm;
  int tag;
  size_t wrong, failed;
} talker_t;

static void *talk(void *arg) {
  talker_t *t = arg;
  const int me = tcc_comm_rank(t->comm), peer = 1 - me;
  uint8_t out[24], in[24];
  for (int m = 0; m < THREAD_MSGS; m++) {
    const size_t n = 1 + (size_t)(m % 24);
    fill(out, n, me * 10 + t->tag, m);
    if (me == 0) {
      t->failed += send_msg(t->comm, out, n, peer, (uint64_t)t->tag, true) != TCC_OK;
      t->failed += recv_msg(t->comm, in, n, peer, (uint64_t)t->tag, true) != TCC_OK;
    } else {
      t->failed += recv_msg(t->comm, in, n, peer, (uint64_t)t->tag, true) != TCC_OK;
      t->failed += send_msg(t->comm, out, n, peer, (uint64_t)t->tag, true) != TCC_OK;
    }
    t->wrong += wrong_bytes(in, n, peer * 10 + t->tag, m) != 0;
  }
  return NULL;
}

static void two_threads(tcc_comm_t *comm) {
  if (tcc_comm_rank(comm) > 1) return;
  talker_t a = {comm, 1, 0, 0}, b = {comm, 2, 0, 0};
  pthread_t other;
  CHECK(pthread_create(&other, NULL, talk, &b) == 0, "pthread_create");
  talk(&a);
  pthread_join(other, NULL);
  CHECK(a.failed + b.failed == 0, "%zu blocking calls failed: %s", a.failed + b.failed, tcc_last_error());
  CHECK(a.wrong + b.wrong == 0, "%zu messages wrong or crossed between the threads' tags", a.wrong + b.wrong);
}

/* Rank 1 leaves without destroying; rank 0's blocking receive from it
 * fails naming it, and so does a send to it afterwards. */
static void peer_exits(tcc_comm_t *comm) {
  uint8_t x[8] = {0};
  pair_barrier(comm);
  if (tcc_comm_rank(comm) == 1) _exit(check_failures ? 1 : 0); /* what a crash leaves */
  const int64_t t0 = tcc__now_ns();
  tcc_result_t r = recv_msg(comm, x, sizeof x, 1, 4, true);
  const double seconds = (double)(tcc__now_ns() - t0) / 1e9;
  CHECK(r == TCC_ERR_REMOTE && strstr(tcc_last_error(), "recv") && strstr(tcc_last_error(), "rank 1") &&
            strstr(tcc_last_error(), "tag 4") && strstr(tcc_last_error(), "now-exit"),
        "blocking recv from a rank that exited: %s: %s", tcc_result_string(r), tcc_last_error());
  CHECK(seconds < within_s(2.0), "the exit was noticed after %.2f s", seconds);
  r = send_msg(comm, x, sizeof x, 1, 4, true);
  CHECK(r == TCC_ERR_REMOTE && strstr(tcc_last_error(), "send") && strstr(tcc_last_error(), "rank 1"),
        "blocking send to a rank that exited: %s: %s", tcc_result_string(r), tcc_last_error());
}

/* Rank 0 blocks receiving what rank 1 never sends; its main thread aborts
 * the communicator. */
static atomic_int *shared_flag;

typedef struct blocked_recv {
  tcc_comm_t *comm;
  tcc_result_t result;
  char error[TCC_ERRLEN];
} blocked_recv_t;

static void *recv_forever(void *arg) {
  blocked_recv_t *b = arg;
  uint8_t x[8];
  b->result = recv_msg(b->comm, x, sizeof x, 1, 3, true);
  snprintf(b->error, sizeof b->error, "%s", tcc_last_error());
  return NULL;
}

static void abort_during_recv(tcc_comm_t *comm) {
  if (tcc_comm_rank(comm) == 1) {
    for (int i = 0; i < 20000 && !atomic_load(shared_flag); i++) usleep(1000);
    return;
  }
  blocked_recv_t b = {comm, TCC_OK, ""};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, recv_forever, &b) == 0, "pthread_create");
  usleep(200 * 1000);
  const int64_t t0 = tcc__now_ns();
  tcc_comm_abort(comm);
  pthread_join(t, NULL);
  const double seconds = (double)(tcc__now_ns() - t0) / 1e9;
  atomic_store(shared_flag, 1);
  CHECK(b.result == TCC_ERR_ABORTED && strstr(b.error, "recv") && strstr(b.error, "abort"),
        "blocking recv ended by an abort: %s: %s", tcc_result_string(b.result), b.error);
  CHECK(seconds < within_s(2.0), "the blocking recv returned %.2f s after the abort", seconds);
}

/* Garbage where rank 0's next record to rank 1 starts (a header no
 * writer makes): rank 1's receive fails naming the corrupt ring, and the
 * stream stays failed. */
static uint64_t garbage_header; /* set before the ranks fork */

static void corrupt_record(tcc_comm_t *comm) {
  uint8_t x[8];
  pair_barrier(comm);
  if (tcc_comm_rank(comm) == 0) {
    shm_ring_t *ring = shm_ring_of(shm_of(comm), 0, 1);
    const uint64_t at = atomic_load(&ring->head) % shm_of(comm)->hdr->ring_bytes;
    atomic_store((_Atomic uint64_t *)(void *)(ring->data + at), garbage_header);
    for (int i = 0; i < 20000 && !atomic_load(shared_flag); i++) usleep(1000);
    return;
  }
  for (int k = 0; k < 2; k++) {
    const tcc_result_t r = recv_msg(comm, x, sizeof x, 0, 1, k == 0);
    CHECK(r == TCC_ERR_REMOTE && strstr(tcc_last_error(), "recv") && strstr(tcc_last_error(), "corrupt ring from rank 0"),
          "receive %d from a corrupt ring (header %#llx): %s: %s", k, (unsigned long long)garbage_header,
          tcc_result_string(r), tcc_last_error());
  }
  atomic_store(shared_flag, 1);
}

int main(void) {
  shared_flag = group_shared_flag();
  /* Ranks 0 and 1 talk: over shm, tcp, a hybrid's ring (pairs) and its TCP (interleaved). */
  const char *const specs[] = {"shm", "tcp", "auto-pairs", "auto-interleaved"};
  for (size_t g = 0; g < sizeof specs / sizeof *specs; g++) {
    const char *spec = specs[g];
    const int n = strncmp(spec, "auto", 4) == 0 ? 4 : 2;
    CHECK(run_group(n, spec, 60000, "now-sizes", every_size) == 0, "every size, %d ranks %s", n, spec);
    CHECK(run_group(n, spec, 60000, "now-others", others_first) == 0, "others first, %d ranks %s", n, spec);
    CHECK(run_group(n, spec, 60000, "now-queued", queued_first) == 0, "queued first, %d ranks %s", n, spec);
    CHECK(run_group(n, spec, 60000, "now-threads", two_threads) == 0, "two threads, %d ranks %s", n, spec);
  }
  /* No mark; the mark with a length past the ring; the mark with no length. */
  const uint64_t garbage[] = {0xdeadbeefcafef00dull, 0x72656331ull << 32 | 0xfffffff0u, 0x72656331ull << 32};
  for (int k = 0; k < 3; k++) {
    garbage_header = garbage[k];
    atomic_store(shared_flag, 0);
    CHECK(run_group(2, "shm", 30000, "now-corrupt", corrupt_record) == 0, "a corrupt record header %#llx",
          (unsigned long long)garbage[k]);
  }
  for (size_t g = 0; g < 2; g++) {
    CHECK(run_group(2, specs[g], 30000, "now-exit", peer_exits) == 0, "a peer exits, %s", specs[g]);
    atomic_store(shared_flag, 0);
    CHECK(run_group(2, specs[g], 30000, "now-abort", abort_during_recv) == 0, "abort during a blocking recv, %s",
          specs[g]);
  }
  CHECK_DONE();
}
