/*
 * test_slots.c - small rooted collectives over the slot rings
 * (src/coll/coll_slots.c), in real multi-process groups:
 *
 *  - broadcast, scatter, gather and reduce of every size that fits a slot,
 *    every root, in loops several times longer than the ring, mixed with
 *    ops over the staging windows; every result against values computed
 *    here, and no stage barrier passed by a slot-ring op;
 *  - the same with parts over several slots (TCCOMM_SHM_SLOT_SPAN_BYTES):
 *    sizes on both sides of each slot's end, up to the whole ring, mixed
 *    with one-slot ops so that parts start at every place in the ring and
 *    skip to the next lap; afterwards the first word of every slot still
 *    holds a position (data never lands there, so a receiver cannot take
 *    data for the position it waits for);
 *  - a receiver that lags (sleeps), so the senders fill the ring and wait
 *    for room: the payload checks test the flow control, with one-slot
 *    parts, parts of a few slots and parts of more than half the ring;
 *  - disagreements: found by a receiver in the op (a size), by the
 *    digests at the next op over the windows (two roots that both only
 *    send), by a receiver whose sender went past the op (gather with two
 *    roots; an op one rank runs over the windows): each fails the
 *    communicator on every rank, with a message that says why;
 *  - a sender that dies, and an abort from another thread, while a
 *    receiver waits on its slot: an error naming the cause, well before
 *    the op's timeout.
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "coll/coll_scratch.h"
#include "group.h"
#include "transport/shm/shm.h"

#define SLOT_BYTES 512
#define SLOTS 32                   /* SHM_SLOTS */
#define PART_MAX (SLOT_BYTES - 32) /* a slot's head is 32 bytes */
#define PIECE (SLOT_BYTES - 64)    /* a part over several slots starts a line into each */
#define SPAN_MAX (SLOTS * PIECE)   /* the most a part may span by default: the whole ring */
#define COUNT_MAX (SPAN_MAX / 4 + 1)
#define LOOP 80                    /* ops per case: more than twice the ring's 32 slots */

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

static uint64_t stage_now(tcc_comm_t *comm) { return shm_of(comm)->stage; }

/* One rooted op of `count` int32 elements, checked. */
static void rooted_op(tcc_comm_t *comm, int kind, int root, size_t count, int op_no) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  static int32_t bufs[8][COUNT_MAX], one[COUNT_MAX];
  tcc_buf_t list[8];
  for (int j = 0; j < n; j++) list[j] = i32_buf(bufs[j], count);
  switch (kind) {
    case 0: /* broadcast */
      for (size_t i = 0; i < count; i++) one[i] = me == root ? value(root, op_no, i) : -1;
      CHECK(RUN(tcc_broadcast(comm, i32_buf(one, count), root, NULL, &op)) == TCC_OK, "broadcast: %s", msg);
      for (size_t i = 0; i < count; i++)
        CHECK(one[i] == value(root, op_no, i), "broadcast #%d root %d count %zu: [%zu] %d", op_no, root, count, i,
              one[i]);
      break;
    case 1: /* scatter */
      for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) bufs[j][i] = value(j, op_no, i);
      for (size_t i = 0; i < count; i++) one[i] = -1;
      CHECK(RUN(tcc_scatter(comm, me == root ? list : NULL, i32_buf(one, count), root, NULL, &op)) == TCC_OK,
            "scatter: %s", msg);
      for (size_t i = 0; i < count; i++)
        CHECK(one[i] == value(me, op_no, i), "scatter #%d root %d count %zu: [%zu] %d", op_no, root, count, i, one[i]);
      break;
    case 2: /* gather */
      for (size_t i = 0; i < count; i++) one[i] = value(me, op_no, i);
      for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) bufs[j][i] = -1;
      CHECK(RUN(tcc_gather(comm, i32_buf(one, count), me == root ? list : NULL, root, NULL, &op)) == TCC_OK,
            "gather: %s", msg);
      if (me == root)
        for (int j = 0; j < n; j++)
          for (size_t i = 0; i < count; i++)
            CHECK(bufs[j][i] == value(j, op_no, i), "gather #%d root %d count %zu: from %d [%zu] %d", op_no, root,
                  count, j, i, bufs[j][i]);
      break;
    default: { /* reduce, sum; wrapping adds in int32 are exact in any order */
      for (size_t i = 0; i < count; i++) one[i] = value(me, op_no, i);
      static int32_t out[COUNT_MAX];
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
  }
}

/* After a loop of slot-ring ops of `kind` that started at `stage`: none
 * passed a stage barrier, and an op over the windows, which compares the
 * digests of all of them, succeeds. */
static void after_slot_ops(tcc_comm_t *comm, int kind, uint64_t stage) {
  char msg[TCC_ERRLEN];
  CHECK(stage_now(comm) == stage, "kind %d: slot-ring ops passed %llu stage barriers", kind,
        (unsigned long long)(stage_now(comm) - stage));
  int32_t x = 1, sum = 0;
  CHECK(RUN(tcc_allreduce(comm, i32_buf(&x, 1), i32_buf(&sum, 1), TCC_SUM, NULL, &op)) == TCC_OK, "allreduce: %s",
        msg);
  CHECK(sum == tcc_comm_size(comm), "allreduce %d", sum);
}

/* The largest count of `kind` that fits a slot on n ranks. */
static size_t max_count(int kind, int n) { return kind == 1 ? PART_MAX / 4 / (size_t)(n - 1) : PART_MAX / 4; }

static void all_rooted(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm);
  char msg[TCC_ERRLEN];
  int op_no = 0;
  for (int kind = 0; kind < 4; kind++) {
    const size_t counts[] = {0, 1, 3, 8, max_count(kind, n)};
    const uint64_t stage = stage_now(comm);
    for (int i = 0; i < LOOP; i++) rooted_op(comm, kind, i % n, counts[i % 5], op_no++);
    after_slot_ops(comm, kind, stage);
  }
  /* One element past what fits goes over the windows, alike on every rank. */
  const uint64_t stage = stage_now(comm);
  rooted_op(comm, 0, 0, PART_MAX / 4 + 1, op_no++);
  CHECK(stage_now(comm) > stage, "a broadcast too large for a slot passed no stage barrier");
  /* Mixed: rooted ops of every kind between allreduces and barriers. */
  for (int i = 0; i < LOOP; i++) {
    rooted_op(comm, i % 4, (i / 4) % n, 1 + (size_t)i % 7, op_no++);
    if (i % 9 == 0) CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier: %s", msg);
  }
  CHECK(tcc_comm_status(comm) == TCC_OK, "failed: %s", tcc_comm_failure(comm));
}

/* A receiver sleeps now and then while its senders run on: they fill the
 * ring and wait for room, and every payload is still the right one. First
 * the root sends (broadcast, scatter) and rank n-1 lags; then the others
 * send (gather, reduce) and the root lags. `count`: per op. */
static void lag_with(tcc_comm_t *comm, size_t count) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  for (int i = 0; i < 3 * LOOP; i++) {
    if (me == n - 1 && i % 40 == 0) usleep(20000);
    rooted_op(comm, i % 2 == 0 ? 0 : 1, 0, i % 2 == 0 ? count : count / (size_t)(n - 1), i);
  }
  for (int i = 0; i < 3 * LOOP; i++) {
    if (me == 0 && i % 40 == 0) usleep(20000);
    rooted_op(comm, i % 2 == 0 ? 2 : 3, 0, count, i);
  }
  char msg[TCC_ERRLEN];
  CHECK(RUN(tcc_barrier(comm, NULL, &op)) == TCC_OK, "barrier: %s", msg);
}

static void lagging_receiver(tcc_comm_t *comm) { lag_with(comm, 4); }

/* Parts of 3 slots (several in the ring at once), then of 20 (more than
 * half: each waits until the peers are done with the one before). */
static void lagging_receiver_spans(tcc_comm_t *comm) {
  lag_with(comm, 3 * PIECE / 4);
  lag_with(comm, 20 * PIECE / 4);
}

/* ---- parts over several slots ------------------------------------------ */

/* The first word of each of this rank's slots and its peers': a position
 * no later than the last one this rank used, never data (the data here is
 * made of words far above any position: data at a slot's start shows). */
static void slot_heads_are_positions(tcc_comm_t *comm) {
  shm_state_t *st = shm_of(comm);
  const uint64_t last = coll_scratch_of(comm)->slot_pos;
  for (int j = 0; j < tcc_comm_size(comm); j++)
    for (unsigned k = 0; k < SLOTS; k++) {
      uint64_t head;
      memcpy(&head, shm_slot(st, j, k), sizeof head);
      CHECK(head <= last, "rank %d's slot %u starts with %llu, past the last position %llu: data, not a position",
            j, k, (unsigned long long)head, (unsigned long long)last);
    }
}

/* Counts of int32 on both sides of where a part leaves one slot for
 * several, and of each slot's end, up to the whole ring. */
static void all_rooted_spans(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm);
  const size_t per = PIECE / 4;
  const size_t counts[] = {PART_MAX / 4, PART_MAX / 4 + 1, per * 2 - 1, per * 2, per * 2 + 1, per * 5 + 3,
                           per * 16, per * 17, SPAN_MAX / 4 - 1, SPAN_MAX / 4};
  const size_t ncounts = sizeof counts / sizeof *counts;
  int op_no = 0;
  for (int kind = 0; kind < 4; kind++) {
    const uint64_t stage = stage_now(comm);
    for (int i = 0; i < LOOP; i++) {
      size_t count = counts[(size_t)i % ncounts];
      if (kind == 1) count /= (size_t)(n - 1); /* a scatter's part is the n - 1 pieces */
      rooted_op(comm, kind, i % n, count, op_no++);
      /* A one-slot op now and then: parts start at every place. */
      if (i % 3 == 0) rooted_op(comm, (kind + 1) % 4, (i + 1) % n, 1 + (size_t)i % 5, op_no++);
    }
    slot_heads_are_positions(comm);
    after_slot_ops(comm, kind, stage);
  }
  /* One element past the whole ring goes over the windows. */
  const uint64_t stage = stage_now(comm);
  rooted_op(comm, 0, 0, SPAN_MAX / 4 + 1, op_no++);
  CHECK(stage_now(comm) > stage, "a broadcast too large for the ring passed no stage barrier");
  CHECK(tcc_comm_status(comm) == TCC_OK, "failed: %s", tcc_comm_failure(comm));
}

/* TCCOMM_SHM_SLOT_SPAN_BYTES=4096 (set by main): 1024 int32 over slots,
 * 1025 over the windows. */
static void span_limit(tcc_comm_t *comm) {
  for (size_t count = 1024; count <= 1025; count++) {
    const uint64_t stage = stage_now(comm);
    rooted_op(comm, 0, 1, count, (int)count);
    CHECK((stage_now(comm) == stage) == (count == 1024), "%zu int32 passed %llu stage barriers", count,
          (unsigned long long)(stage_now(comm) - stage));
  }
}

/* ---- disagreements --------------------------------------------------- */

static void expect_failed(tcc_comm_t *comm, tcc_result_t got, const char *msg, const char *want) {
  CHECK(got == TCC_ERR_MISMATCH || got == TCC_ERR_REMOTE, "rank %d: %s (%s)", tcc_comm_rank(comm),
        tcc_result_string(got), msg);
  CHECK(tcc_comm_status(comm) != TCC_OK, "rank %d: the communicator is still usable", tcc_comm_rank(comm));
  if (want) CHECK(strstr(msg, want) != NULL, "rank %d: '%s' lacks '%s'", tcc_comm_rank(comm), msg, want);
}

/* A receiver finds it in the sender's descriptor. */
static void size_disagrees(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[8] = {0};
  tcc_result_t r = RUN(tcc_broadcast(comm, i32_buf(buf, me == 1 ? 8 : 4), 0, NULL, &op));
  if (me == 1) {
    expect_failed(comm, r, msg, "size mismatch");
    CHECK(strstr(msg, "out of step") != NULL, "%s", msg);
    return;
  }
  /* The root returned; its next op learns of the receiver's failure. */
  CHECK(r == TCC_OK, "root: %s", msg);
  r = RUN(tcc_barrier(comm, NULL, &op));
  expect_failed(comm, r, msg, "size mismatch");
}

/* Both ranks think they are the root: both only send, and learn it at the
 * next op over the windows. */
static void two_roots(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[4] = {me, me, me, me};
  CHECK(RUN(tcc_broadcast(comm, i32_buf(buf, 4), me, NULL, &op)) == TCC_OK, "broadcast: %s", msg);
  /* The next one agrees: rank 1 takes rank 0's part. */
  CHECK(RUN(tcc_broadcast(comm, i32_buf(buf, 4), 0, NULL, &op)) == TCC_OK, "broadcast: %s", msg);
  tcc_result_t r = RUN(tcc_barrier(comm, NULL, &op));
  expect_failed(comm, r, msg, "digest");
}

/* Both ranks think they are the gather's root: both wait to receive, and
 * each sees the other go past the op without sending. */
static void two_receivers(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t one[2] = {me, me}, bufs[2][2];
  tcc_buf_t list[2] = {i32_buf(bufs[0], 2), i32_buf(bufs[1], 2)};
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = RUN(tcc_gather(comm, i32_buf(one, 2), list, me, NULL, &op));
  expect_failed(comm, r, msg, NULL);
  CHECK(strstr(msg, "went past") || strstr(msg, "out of step"), "%s", msg);
  CHECK((int64_t)time(NULL) - t0 < 20, "the disagreement took until the timeout");
}

/* Rank 0 broadcasts more than a slot holds (over the windows); rank 1
 * thinks the op small. */
static void one_over_windows(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  static int32_t buf[1024];
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = RUN(tcc_broadcast(comm, i32_buf(buf, me == 0 ? 1024 : 4), 0, NULL, &op));
  expect_failed(comm, r, msg, NULL);
  CHECK((int64_t)time(NULL) - t0 < 20, "the disagreement took until the timeout: %s", msg);
}

/* ---- faults ------------------------------------------------------------ */

static void sender_dies(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  char msg[TCC_ERRLEN];
  int32_t buf[4] = {0};
  for (int i = 0; i < 40; i++) rooted_op(comm, 0, 0, 4, i);
  if (me == 0) _exit(0); /* dies between ops: holds nothing */
  const int64_t t0 = (int64_t)time(NULL);
  tcc_result_t r = RUN(tcc_broadcast(comm, i32_buf(buf, 4), 0, NULL, &op));
  CHECK(r == TCC_ERR_REMOTE, "rank %d: %s (%s)", me, tcc_result_string(r), msg);
  CHECK(strstr(msg, "rank 0") != NULL, "rank %d: '%s' does not name rank 0", me, msg);
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
    /* The root never sends: rank 1 waits on its slot until aborted. */
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

/* The same small ops go over the windows: a stage barrier each. */
static void slots_off(tcc_comm_t *comm) {
  for (int kind = 0; kind < 4; kind++) {
    const uint64_t stage = stage_now(comm);
    rooted_op(comm, kind, 1, 4, kind);
    CHECK(stage_now(comm) > stage, "kind %d passed no stage barrier", kind);
  }
}

/* By default the slots of a group take at most 8 MiB: 64 KiB each up to 4
 * ranks, 32 KiB up to 8, and a part may span the whole ring. A broadcast
 * of the largest part the ring holds (each slot less its 64-byte line)
 * passes no stage barrier; one element more goes over the windows. */
static size_t default_part_int32(int n) { return SLOTS * ((n <= 4 ? 65536 : 32768) - 64) / sizeof(int32_t); }

static void default_size(tcc_comm_t *comm) {
  const int me = tcc_comm_rank(comm);
  const size_t fits = default_part_int32(tcc_comm_size(comm));
  char msg[TCC_ERRLEN];
  static int32_t buf[SLOTS * 65536 / sizeof(int32_t)];
  for (size_t count = fits; count <= fits + 1; count++) {
    for (size_t i = 0; i < count; i++) buf[i] = me == 0 ? value(0, (int)count, i) : -1;
    const uint64_t stage = stage_now(comm);
    CHECK(RUN(tcc_broadcast(comm, i32_buf(buf, count), 0, NULL, &op)) == TCC_OK, "broadcast: %s", msg);
    for (size_t i = 0; i < count; i++) CHECK(buf[i] == value(0, (int)count, i), "count %zu: [%zu] %d", count, i, buf[i]);
    CHECK((stage_now(comm) == stage) == (count == fits), "%zu int32 passed %llu stage barriers", count,
          (unsigned long long)(stage_now(comm) - stage));
  }
}

int main(void) {
  alarm(600); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  char slot[32];
  snprintf(slot, sizeof slot, "%d", SLOT_BYTES);
  setenv("TCCOMM_SHM_SLOT_BYTES", slot, 1);
  /* One slot per part first: the cases at a slot's end expect the windows past it. */
  setenv("TCCOMM_SHM_SLOT_SPAN_BYTES", "0", 1);
  signal(SIGPIPE, SIG_IGN);
  int passed = 0, failed = 0;
  const struct {
    const char *name;
    int n;
    int64_t timeout_ms;
    rank_fn fn;
  } cases[] = {
      {"rooted ops", 2, 60000, all_rooted},
      {"rooted ops", 3, 60000, all_rooted},
      {"rooted ops", 4, 60000, all_rooted},
      {"lagging receiver", 3, 60000, lagging_receiver},
      {"size disagrees", 2, 60000, size_disagrees},
      {"two roots", 2, 60000, two_roots},
      {"two receivers", 2, 60000, two_receivers},
      {"one rank over the windows", 2, 60000, one_over_windows},
      {"sender dies", 3, 60000, sender_dies},
      {"aborted while waiting", 2, 60000, aborted_while_waiting},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    group_comm_destroyed = 0;
    int bad = run_group(cases[i].n, "shm", cases[i].timeout_ms, "slots", cases[i].fn);
    printf("%s %s n=%d\n", bad ? "FAIL" : "ok  ", cases[i].name, cases[i].n);
    bad ? failed++ : passed++;
  }
  unsetenv("TCCOMM_SHM_SLOT_SPAN_BYTES");
  const struct {
    const char *name;
    int n;
    rank_fn fn;
  } spans[] = {
      {"rooted ops over several slots", 2, all_rooted_spans},
      {"rooted ops over several slots", 3, all_rooted_spans},
      {"rooted ops over several slots", 4, all_rooted_spans},
      {"lagging receiver, parts over several slots", 3, lagging_receiver_spans},
  };
  for (size_t i = 0; i < sizeof spans / sizeof *spans; i++) {
    int bad = run_group(spans[i].n, "shm", 60000, "slots-span", spans[i].fn);
    printf("%s %s n=%d\n", bad ? "FAIL" : "ok  ", spans[i].name, spans[i].n);
    bad ? failed++ : passed++;
  }
  setenv("TCCOMM_SHM_SLOT_SPAN_BYTES", "4096", 1);
  int bad_limit = run_group(2, "shm", 60000, "slots-span-limit", span_limit);
  printf("%s parts over several slots up to TCCOMM_SHM_SLOT_SPAN_BYTES n=2\n", bad_limit ? "FAIL" : "ok  ");
  bad_limit ? failed++ : passed++;
  unsetenv("TCCOMM_SHM_SLOT_SPAN_BYTES");
  unsetenv("TCCOMM_SHM_SLOT_BYTES");
  for (int n = 2; n <= 5; n += 3) {
    int bad_default = run_group(n, "shm", 60000, "slots-default", default_size);
    printf("%s slot rings by default n=%d\n", bad_default ? "FAIL" : "ok  ", n);
    bad_default ? failed++ : passed++;
  }
  /* 0 turns them off. */
  setenv("TCCOMM_SHM_SLOT_BYTES", "0", 1);
  int bad = run_group(2, "shm", 60000, "slots-off", slots_off);
  printf("%s slot rings off (0) n=2\n", bad ? "FAIL" : "ok  ");
  bad ? failed++ : passed++;
  printf("test_slots: %d cases passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
