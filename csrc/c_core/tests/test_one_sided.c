/*
 * test_one_sided.c - small rooted collectives over TCP whose senders do
 * not wait (src/coll/coll_stream_eager.c, stream_frames.c), in real
 * multi-process groups:
 *
 *  - broadcast, scatter, gather and reduce of sizes up to the one-exchange
 *    budget, every root, in loops longer than the frames a sender may leave
 *    unread (TCC_STREAM_UNREAD_MAX), mixed with ops every rank waits in;
 *    every result against values computed here, and every op counted as
 *    one-sided;
 *  - a receiver that lags (sleeps) while its root runs on;
 *  - the frames no one waits for, held back: a receiver holds them, and
 *    once it goes quiet its collective thread sends them, so a root that
 *    must read them does not wait for the receiver's next op;
 *  - disagreements: a size (found by the receiver in the op, by the root
 *    at its next op), two roots that both only send (found at the next
 *    op), two receivers (found at once), another kind of op, and one rank
 *    past the budget: each fails on every rank with a message that says
 *    why, well before the timeout;
 *  - a sender that dies, a receiver that dies, and an abort from another
 *    thread while a receiver waits: an error naming the cause;
 *  - TCCOMM_STREAM_ONE_SIDED=0: every rank waits again.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "group.h"
#include "coll/stream_frames.h"

#define LOOP 150 /* ops per case: more than twice TCC_STREAM_UNREAD_MAX */
#define EAGER_MAX 16384 /* int32 elements the one-exchange budget (64 KiB per peer) takes at 2 ranks */

static tcc_buf_t i32_buf(void *p, size_t count) { return (tcc_buf_t){p, count, TCC_INT32, -1, NULL}; }

static int32_t value(int source, int op, size_t i) {
  return (int32_t)((uint32_t)source * 2654435761u + (uint32_t)op * 97u + (uint32_t)i * 40503u + 17u);
}

static tcc_result_t finish(tcc_result_t r, tcc_op_t *op, char *msg, size_t len) {
  if (msg && len) msg[0] = 0;
  if (r != TCC_OK) {
    if (msg) snprintf(msg, len, "%s", tcc_last_error());
    return r;
  }
  r = tcc_op_wait(op, -1);
  if (msg && r != TCC_OK) snprintf(msg, len, "%s", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}
#define RUN(call) ({ tcc_op_t *op = NULL; tcc_result_t r_ = (call); finish(r_, op, msg, sizeof msg); })

/* Ops this rank ran one-sided, and frames it held back. */
static uint64_t one_sided_ops(tcc_comm_t *comm) { return coll_scratch_of(comm)->one_sided_ops; }
static uint64_t held_frames(tcc_comm_t *comm) { return coll_scratch_of(comm)->held_frames; }

/* The largest count of `kind` (0 broadcast, 1 scatter, 2 gather, 3 reduce)
 * that goes one-sided on n ranks: each peer's payload within the budget. */
static size_t max_count(int n) { return EAGER_MAX / (size_t)(n - 1); }

/* One rooted op of `count` int32 elements, checked. */
static void rooted_op(tcc_comm_t *comm, int kind, int root, size_t count, int op_no) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t *mem = malloc((size_t)(n + 2) * (count + 1) * sizeof(int32_t));
  int32_t *one = mem, *out = mem + count + 1, *bufs = mem + 2 * (count + 1);
  tcc_buf_t list[8];
  for (int j = 0; j < n; j++) list[j] = i32_buf(bufs + (size_t)j * (count + 1), count);
  int32_t *block[8];
  for (int j = 0; j < n; j++) block[j] = bufs + (size_t)j * (count + 1);
  switch (kind) {
    case 0:
      for (size_t i = 0; i < count; i++) one[i] = me == root ? value(root, op_no, i) : -1;
      CHECK(RUN(tcc_broadcast(comm, i32_buf(one, count), root, NULL, &op)) == TCC_OK, "broadcast: %s", msg);
      for (size_t i = 0; i < count; i++)
        CHECK(one[i] == value(root, op_no, i), "broadcast #%d root %d count %zu: [%zu] %d", op_no, root, count, i,
              one[i]);
      break;
    case 1:
      for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) block[j][i] = value(j, op_no, i);
      for (size_t i = 0; i < count; i++) one[i] = -1;
      CHECK(RUN(tcc_scatter(comm, me == root ? list : NULL, i32_buf(one, count), root, NULL, &op)) == TCC_OK,
            "scatter: %s", msg);
      for (size_t i = 0; i < count; i++)
        CHECK(one[i] == value(me, op_no, i), "scatter #%d root %d count %zu: [%zu] %d", op_no, root, count, i, one[i]);
      break;
    case 2:
      for (size_t i = 0; i < count; i++) one[i] = value(me, op_no, i);
      for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) block[j][i] = -1;
      CHECK(RUN(tcc_gather(comm, i32_buf(one, count), me == root ? list : NULL, root, NULL, &op)) == TCC_OK,
            "gather: %s", msg);
      if (me == root)
        for (int j = 0; j < n; j++)
          for (size_t i = 0; i < count; i++)
            CHECK(block[j][i] == value(j, op_no, i), "gather #%d root %d count %zu: from %d [%zu] %d", op_no, root,
                  count, j, i, block[j][i]);
      break;
    default: /* reduce, sum: wrapping int32 adds are exact in any order */
      for (size_t i = 0; i < count; i++) one[i] = value(me, op_no, i);
      CHECK(RUN(tcc_reduce(comm, i32_buf(one, count), i32_buf(out, count), TCC_SUM, root, NULL, &op)) == TCC_OK,
            "reduce: %s", msg);
      if (me == root)
        for (size_t i = 0; i < count; i++) {
          uint32_t want = 0;
          for (int j = 0; j < n; j++) want += (uint32_t)value(j, op_no, i);
          CHECK(out[i] == (int32_t)want, "reduce #%d root %d count %zu: [%zu] %d, want %d", op_no, root, count, i,
                out[i], (int32_t)want);
        }
      break;
  }
  free(mem);
}

static void allreduce_ok(tcc_comm_t *comm) {
  char msg[TCC_ERRLEN];
  int32_t x = 1, sum = 0;
  CHECK(RUN(tcc_allreduce(comm, i32_buf(&x, 1), i32_buf(&sum, 1), TCC_SUM, NULL, &op)) == TCC_OK, "allreduce: %s",
        msg);
  CHECK(sum == tcc_comm_size(comm), "allreduce %d", sum);
}

static void all_rooted(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm);
  char msg[TCC_ERRLEN];
  int op_no = 0;
  for (int kind = 0; kind < 4; kind++) {
    const size_t counts[] = {0, 1, 3, 8, max_count(n)};
    const uint64_t before = one_sided_ops(comm), held_before = held_frames(comm);
    for (int i = 0; i < LOOP; i++) rooted_op(comm, kind, i % n, counts[i % 5], op_no++);
    CHECK(one_sided_ops(comm) - before == LOOP, "kind %d: %llu ops of %d ran one-sided", kind,
          (unsigned long long)(one_sided_ops(comm) - before), LOOP);
    /* every rank receives in some of them, whose frames it holds back */
    CHECK(held_frames(comm) > held_before, "kind %d: no frame held back", kind);
    allreduce_ok(comm);
  }
  /* One element past the budget takes the exchange, on every rank alike. */
  const uint64_t before = one_sided_ops(comm);
  rooted_op(comm, 0, 0, max_count(n) + 1, op_no++);
  CHECK(one_sided_ops(comm) == before, "a broadcast past the budget ran one-sided");
  /* Mixed: rooted ops of every kind between allreduces and barriers. */
  for (int i = 0; i < LOOP; i++) {
    rooted_op(comm, i % 4, (i / 4) % n, 1 + (size_t)i % 7, op_no++);
    if (i % 9 == 0) CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier: %s", msg);
  }
  CHECK(tcc_comm_status(comm) == TCC_OK, "failed: %s", tcc_comm_failure(comm));
}

/* The last rank sleeps now and then while the root broadcasts and
 * scatters on: the root runs ahead, reads what waits when it must, and
 * every payload is still the right one. Then the root lags behind the
 * other ranks' gathers and reduces. */
static void lagging_receiver(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  for (int i = 0; i < 2 * LOOP; i++) {
    if (me == n - 1 && i % 50 == 0) usleep(20000);
    rooted_op(comm, i % 2, 0, 4, i);
  }
  for (int i = 0; i < 2 * LOOP; i++) {
    if (me == 0 && i % 50 == 0) usleep(20000);
    rooted_op(comm, 2 + i % 2, 0, 4, i);
  }
  char msg[TCC_ERRLEN];
  CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier: %s", msg);
}

/* The receiver starts late, so the root runs ahead until it must read the
 * frames of the receiver that it left unread (TCC_STREAM_UNREAD_MAX of
 * them); the receiver then finds every op's data there, waits for nothing,
 * and holds its last frames back. It goes quiet after the last op: its
 * collective thread sends them, and the root goes on well before the
 * receiver's next op. */
static void quiet_receiver(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[4];
  if (me == 1) usleep(200000);
  const int64_t t0 = tcc__now_ns();
  for (int i = 0; i <= TCC_STREAM_UNREAD_MAX; i++) {
    for (size_t k = 0; k < 4; k++) buf[k] = me == 0 ? value(0, i, k) : -1;
    CHECK(RUN(tcc_broadcast(comm, i32_buf(buf, 4), 0, NULL, &op)) == TCC_OK, "broadcast #%d: %s", i, msg);
    for (size_t k = 0; k < 4; k++) CHECK(buf[k] == value(0, i, k), "broadcast #%d: [%zu] %d", i, k, buf[k]);
  }
  const double took_s = (double)(tcc__now_ns() - t0) / 1e9;
  if (me == 1) {
    CHECK(held_frames(comm) >= TCC_STREAM_HOLD_MAX, "rank 1 held back %llu frames",
          (unsigned long long)held_frames(comm));
    sleep(4);
  } else {
    CHECK(took_s < 2.0, "the root's broadcasts took %.2f s: it waited for the receiver's next op", took_s);
  }
  CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier: %s", msg);
}

/* ---- disagreements --------------------------------------------------- */

static void expect_failed(tcc_comm_t *comm, tcc_result_t got, const char *msg, const char *want) {
  CHECK(got == TCC_ERR_MISMATCH || got == TCC_ERR_REMOTE, "rank %d: %s (%s)", tcc_comm_rank(comm),
        tcc_result_string(got), msg);
  CHECK(tcc_comm_status(comm) != TCC_OK, "rank %d: the communicator is still usable", tcc_comm_rank(comm));
  if (want) CHECK(strstr(msg, want) != NULL, "rank %d: '%s' lacks '%s'", tcc_comm_rank(comm), msg, want);
}

/* The receiver finds it in the op; the root, which went on, at its next.
 * The receiver comes late, finds the root's frame there and so waits for
 * nothing: it holds its own frame back, and sends it before it fails, so
 * the root reads why. */
static void size_disagrees(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[8] = {0};
  if (me == 1) usleep(100000);
  tcc_result_t r = RUN(tcc_broadcast(comm, i32_buf(buf, me == 1 ? 8 : 4), 0, NULL, &op));
  if (me == 1) {
    expect_failed(comm, r, msg, "size mismatch");
    CHECK(strstr(msg, "out of step") != NULL, "%s", msg);
    return;
  }
  CHECK(r == TCC_OK, "root: %s", msg);
  r = RUN(tcc_barrier(comm, NULL, &op));
  expect_failed(comm, r, msg, "size mismatch");
}

/* Ranks 0 and 1 both think they are the root: both only send. A third
 * rank names rank 1 and takes its part, as it listens to it alone. Every
 * rank finds the disagreement when it next reads from the others. */
static void two_roots(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[4] = {me, me, me, me};
  const int64_t t0 = (int64_t)time(NULL);
  CHECK(RUN(tcc_broadcast(comm, i32_buf(buf, 4), me < 2 ? me : 1, NULL, &op)) == TCC_OK, "rank %d: %s", me, msg);
  if (me == 2) CHECK(buf[0] == 1 && buf[3] == 1, "rank 2 took [%d .. %d], not rank 1's part", buf[0], buf[3]);
  tcc_result_t r = RUN(tcc_barrier(comm, NULL, &op));
  expect_failed(comm, r, msg, NULL);
  if (r == TCC_ERR_MISMATCH) CHECK(strstr(msg, "root mismatch") != NULL, "rank %d: %s", me, msg);
  CHECK((int64_t)time(NULL) - t0 < 20, "the disagreement took until the timeout: %s", msg);
}

/* Rank 0's first send to rank 2 waits LATE_SEND_US: the root scheduled
 * out between its sends to its two peers, which 3 ranks on 2 CPUs do. And
 * rank 2 finds rank 1's stream reset from its barrier on, as when rank 1
 * failed and closed it with rank 2's bytes unread: whether a real reset
 * reaches rank 2 before it has read rank 1's frame is a race. */
#define LATE_SEND_US 100000
static const tcc__stream_ops_t *tcp_streams;
static bool rank1_gone;
static ssize_t late_send_to_2(tcc_comm_t *comm, int peer, const void *buf, size_t len) {
  static int delayed;
  if (peer == 2 && !delayed++) usleep(LATE_SEND_US);
  return tcp_streams->send(comm, peer, buf, len);
}
static ssize_t send_but_1_gone(tcc_comm_t *comm, int peer, const void *buf, size_t len) {
  if (peer == 1 && rank1_gone) return errno = ECONNRESET, -1;
  return tcp_streams->send(comm, peer, buf, len);
}
static ssize_t recv_but_1_gone(tcc_comm_t *comm, int peer, void *buf, size_t len) {
  if (peer == 1 && rank1_gone) return errno = ECONNRESET, -1;
  return tcp_streams->recv(comm, peer, buf, len);
}

/* two_roots, rank 0's frame to rank 2 late: rank 1 finds rank 0's frame,
 * fails and hangs up on rank 2 before rank 2 has rank 0's. Rank 2 must
 * still name the disagreement, not only rank 1's hang-up (stream_xfer.c,
 * hang-ups). */
static void two_roots_one_late(tcc_comm_t *comm) {
  static struct tcc_transport_ops ops;
  static tcc__stream_ops_t streams;
  const int me = tcc_comm_rank(comm);
  if (me != 1) {
    tcp_streams = comm->ops->streams;
    streams = *tcp_streams;
    if (me == 0) streams.send = late_send_to_2;
    else streams.send = send_but_1_gone, streams.recv = recv_but_1_gone;
    ops = *comm->ops;
    ops.streams = &streams;
    comm->ops = &ops;
  }
  char msg[TCC_ERRLEN];
  int32_t buf[4] = {me, me, me, me};
  CHECK(RUN(tcc_broadcast(comm, i32_buf(buf, 4), me < 2 ? me : 1, NULL, &op)) == TCC_OK, "rank %d: %s", me, msg);
  rank1_gone = me == 2;
  tcc_result_t r = RUN(tcc_barrier(comm, NULL, &op));
  expect_failed(comm, r, msg, NULL);
  if (me == 2) CHECK(r == TCC_ERR_MISMATCH && strstr(msg, "root mismatch"), "rank 2: %s (%s)",
                     tcc_result_string(r), msg);
}

/* Both ranks think they are the gather's root: both wait to receive, and
 * each reads the other's frame at once. */
static void two_receivers(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t one[2] = {me, me}, bufs[2][2];
  tcc_buf_t list[2] = {i32_buf(bufs[0], 2), i32_buf(bufs[1], 2)};
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = RUN(tcc_gather(comm, i32_buf(one, 2), list, me, NULL, &op));
  expect_failed(comm, r, msg, "root mismatch");
  CHECK((int64_t)time(NULL) - t0 < 20, "the disagreement took until the timeout");
}

/* Rank 0 gathers (it receives), rank 1 broadcasts from rank 0 (it
 * receives too): another kind of op. */
static void other_kind(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t one[2] = {me, me}, bufs[2][2];
  tcc_buf_t list[2] = {i32_buf(bufs[0], 2), i32_buf(bufs[1], 2)};
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = me == 0 ? RUN(tcc_gather(comm, i32_buf(one, 2), list, 0, NULL, &op))
                           : RUN(tcc_broadcast(comm, i32_buf(one, 2), 0, NULL, &op));
  expect_failed(comm, r, msg, "different collectives");
  CHECK((int64_t)time(NULL) - t0 < 20, "the disagreement took until the timeout");
}

/* Rank 0 broadcasts past the budget (every rank waits), rank 1 thinks
 * the op small (it receives, one-sided). */
static void one_past_budget(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  static int32_t buf[EAGER_MAX + 1];
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = RUN(tcc_broadcast(comm, i32_buf(buf, me == 0 ? EAGER_MAX + 1 : 4), 0, NULL, &op));
  CHECK(r == TCC_ERR_MISMATCH, "rank %d: %s (%s)", me, tcc_result_string(r), msg);
  CHECK(strstr(msg, "size mismatch") != NULL, "rank %d: %s", me, msg);
  if (me == 1) CHECK(tcc_comm_status(comm) != TCC_OK, "the receiver's communicator is still usable");
  CHECK((int64_t)time(NULL) - t0 < 20, "the disagreement took until the timeout: %s", msg);
}

/* ---- faults ------------------------------------------------------------ */

/* The root dies (no destroy): it may have run ahead of its receivers,
 * and a stream it leaves unread is reset, so a receiver fails at some op
 * from there on, naming it, and every op it completed is right. */
static void sender_dies(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN] = "";
  int32_t buf[4];
  tcc_result_t r = TCC_OK;
  const int64_t t0 = (int64_t)time(NULL);
  for (int i = 0; i < 200 && r == TCC_OK; i++) {
    if (me == 0 && i == 40) _exit(0);
    for (size_t k = 0; k < 4; k++) buf[k] = me == 0 ? value(0, i, k) : -1;
    r = RUN(tcc_broadcast(comm, i32_buf(buf, 4), 0, NULL, &op));
    for (size_t k = 0; k < 4 && r == TCC_OK && i < 40; k++)
      CHECK(buf[k] == value(0, i, k), "rank %d broadcast #%d: [%zu] %d", me, i, k, buf[k]);
  }
  CHECK(r == TCC_ERR_REMOTE, "rank %d: %s (%s)", me, tcc_result_string(r), msg);
  /* A receiver may first see the other leave, whose communicator failed first. */
  CHECK(strstr(msg, "rank 0") || strstr(msg, me == 1 ? "connection to rank 2" : "connection to rank 1"),
        "rank %d: '%s' names neither rank 0 nor the other receiver", me, msg);
  CHECK((int64_t)time(NULL) - t0 < 20, "the dead rank was noticed only at the timeout");
}

/* The root runs on after its receiver died: within a stream's worth of
 * unread frames, or at its next op that reads, it fails naming it. */
static void receiver_dies(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN] = "";
  int32_t buf[4] = {0};
  for (int i = 0; i < 40; i++) rooted_op(comm, 0, 0, 4, i);
  if (me == 1) _exit(0);
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = TCC_OK;
  for (int i = 0; i < 4 * TCC_STREAM_UNREAD_MAX && r == TCC_OK; i++)
    r = RUN(tcc_broadcast(comm, i32_buf(buf, 4), 0, NULL, &op));
  if (r == TCC_OK) r = RUN(tcc_barrier(comm, NULL, &op));
  CHECK(r == TCC_ERR_REMOTE, "%s (%s)", tcc_result_string(r), msg);
  CHECK(strstr(msg, "rank 1") != NULL, "'%s' does not name rank 1", msg);
  CHECK((int64_t)time(NULL) - t0 < 20, "the dead rank was noticed only at the timeout");
}

static void *abort_soon(void *arg) {
  usleep(300000);
  tcc_comm_abort(arg);
  return NULL;
}

static void aborted_while_waiting(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[4] = {0};
  if (me == 0) {
    /* The root never sends: rank 1 waits for its frame until aborted. */
    sleep(2);
    return;
  }
  pthread_t t;
  pthread_create(&t, NULL, abort_soon, comm);
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = RUN(tcc_broadcast(comm, i32_buf(buf, 4), 0, NULL, &op));
  pthread_join(t, NULL);
  CHECK(r == TCC_ERR_ABORTED, "%s (%s)", tcc_result_string(r), msg);
  CHECK((int64_t)time(NULL) - t0 < 20, "the abort was noticed only at the timeout");
}

/* Every rank waits in every op. */
static void one_sided_off(tcc_comm_t *comm) {
  for (int kind = 0; kind < 4; kind++) rooted_op(comm, kind, 1, 4, kind);
  CHECK(one_sided_ops(comm) == 0, "%llu ops ran one-sided", (unsigned long long)one_sided_ops(comm));
}

int main(void) {
  alarm(600); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  unsetenv("TCCOMM_STREAM_ONE_SIDED");
  signal(SIGPIPE, SIG_IGN);
  int passed = 0, failed = 0;
  const struct {
    const char *name;
    int n;
    rank_fn fn;
  } cases[] = {
      {"rooted ops", 2, all_rooted},
      {"rooted ops", 3, all_rooted},
      {"rooted ops", 4, all_rooted},
      {"lagging receiver", 3, lagging_receiver},
      {"quiet receiver", 2, quiet_receiver},
      {"size disagrees", 2, size_disagrees},
      {"two roots", 2, two_roots},
      {"two roots and a receiver", 3, two_roots},
      {"two roots, one's frame to the receiver late", 3, two_roots_one_late},
      {"two receivers", 2, two_receivers},
      {"another kind of op", 2, other_kind},
      {"one rank past the budget", 2, one_past_budget},
      {"sender dies", 3, sender_dies},
      {"receiver dies", 2, receiver_dies},
      {"aborted while waiting", 2, aborted_while_waiting},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    group_comm_destroyed = 0;
    int bad = run_group(cases[i].n, "tcp", 60000, "one-sided", cases[i].fn);
    printf("%s %s n=%d\n", bad ? "FAIL" : "ok  ", cases[i].name, cases[i].n);
    bad ? failed++ : passed++;
  }
  setenv("TCCOMM_STREAM_ONE_SIDED", "0", 1);
  int bad = run_group(2, "tcp", 60000, "one-sided-off", one_sided_off);
  printf("%s one-sided off (TCCOMM_STREAM_ONE_SIDED=0) n=2\n", bad ? "FAIL" : "ok  ");
  bad ? failed++ : passed++;
  printf("test_one_sided: %d cases passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
