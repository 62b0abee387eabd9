/*
 * test_faults.c - what happens off the happy path, in real multi-process
 * groups over shared memory and TCP:
 *   - a peer that exits without destroying is noticed within a second;
 *   - a forked child (which keeps none of the parent's descriptors) does
 *     not hide its parent's death;
 *   - destroy and abort from another thread release a thread blocked in
 *     tcc_op_wait (even one running the queue) within a second, and op
 *     handles stay usable after destroy; destroy while another thread
 *     polls a receive (each poll runs a p2p round) ends the poll;
 *   - a bounded wait returns after its bound and the op still completes;
 *   - a peer whose communicator fails while its process lives on tells
 *     the ranks waiting on it, which fail within a second.
 *
 * Usage: test_faults [shm|tcp]   (default: both)
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "group.h"
#include "host/p2p_frame.h"
#include "transport/transport.h"

/* Sanitizers slow everything down (and exits most): their runs set
 * TCC_TEST_SLOW and get a wider bound. */
static double within_s(double s) { return getenv("TCC_TEST_SLOW") ? 5 * s : s; }

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static tcc_buf_t f32(float *p, size_t n) { return (tcc_buf_t){p, n, TCC_FLOAT32, -1, NULL}; }

static tcc_result_t allreduce_wait(tcc_comm_t *comm, float *x, size_t n, char *msg, size_t len) {
  tcc_op_t *op;
  tcc_result_t r = tcc_allreduce(comm, f32(x, n), f32(x, n), TCC_SUM, NULL, &op);
  if (r != TCC_OK) {
    snprintf(msg, len, "%s", tcc_last_error());
    return r;
  }
  r = tcc_op_wait(op, -1);
  snprintf(msg, len, "%s", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}

/* Rank 1 leaves the process after one allreduce (no destroy); rank 0's
 * next allreduce must fail within a second naming it. With `forked`, rank
 * 1 first forks a child that outlives it by seconds. */
static void peer_exits(tcc_comm_t *comm, int forked) {
  float x[1000];
  char msg[512];
  for (int i = 0; i < 1000; i++) x[i] = 1;
  CHECK(allreduce_wait(comm, x, 1000, msg, sizeof msg) == TCC_OK, "first allreduce: %s", msg);
  if (tcc_comm_rank(comm) == 1) {
    if (forked && fork() == 0) {
      sleep(4); /* a DataLoader worker, say: alive long after its parent */
      _exit(0);
    }
    _exit(check_failures ? 1 : 0); /* gone without destroying: what a crash leaves */
  }
  double t0 = now_s();
  tcc_result_t r = allreduce_wait(comm, x, 1000, msg, sizeof msg);
  double dt = now_s() - t0;
  CHECK(r == TCC_ERR_REMOTE, "allreduce after rank 1 exited gave %s: %s", tcc_result_string(r), msg);
  CHECK(dt < within_s(1.0), "the exit of rank 1 was noticed after %.2f s", dt);
  CHECK(strstr(msg, "allreduce") && strstr(msg, "rank 1") && strstr(msg, "exited") &&
            strstr(msg, "faults-group"),
        "message: %s", msg);
}

static void peer_exits_plain(tcc_comm_t *comm) { peer_exits(comm, 0); }

/* Rank 1's communicator fails (it aborts) while its process lives on; rank
 * 0's allreduce waits on it and must fail within a second (the group
 * timeout is 30 s), naming it: over shared memory with the cause rank 1
 * published, over TCP by the connections rank 1 ended. */
static void peer_fails_alive(tcc_comm_t *comm) {
  float x[1000];
  char msg[512];
  for (int i = 0; i < 1000; i++) x[i] = 1;
  CHECK(allreduce_wait(comm, x, 1000, msg, sizeof msg) == TCC_OK, "first allreduce: %s", msg);
  if (tcc_comm_rank(comm) == 1) {
    tcc_comm_abort(comm);
    sleep(2); /* alive, its communicator failed: no exit, no destroy to see */
    return;
  }
  const int shm = strcmp(tcc_comm_transport_name(comm), "shm") == 0;
  double t0 = now_s();
  tcc_result_t r = allreduce_wait(comm, x, 1000, msg, sizeof msg);
  double dt = now_s() - t0;
  CHECK(r == TCC_ERR_REMOTE, "allreduce after rank 1 failed gave %s: %s", tcc_result_string(r), msg);
  CHECK(dt < within_s(1.0), "the failure of rank 1 was noticed after %.2f s", dt);
  CHECK(strstr(msg, "allreduce") && strstr(msg, "faults-group") &&
            strstr(msg, shm ? "rank 1 failed" : "connection to rank 1") &&
            (!shm || strstr(msg, "was aborted on rank 1")),
        "message: %s", msg);
}
static void peer_exits_after_fork(tcc_comm_t *comm) { peer_exits(comm, 1); }

typedef struct waiter {
  tcc_op_t *op;
  int64_t timeout_ms;
  tcc_result_t result;
  double returned_at;
} waiter_t;

static void *wait_thread(void *arg) {
  waiter_t *w = arg;
  w->result = tcc_op_wait(w->op, w->timeout_ms);
  w->returned_at = now_s();
  return NULL;
}

/* Rank 1 stays away from the allreduce; rank 0 waits for it in a thread
 * (which runs the queue itself) and ends it from the main thread. */
static void end_from_other_thread(tcc_comm_t *comm, int destroy) {
  if (tcc_comm_rank(comm) == 1) {
    sleep(2);
    return;
  }
  float x = 1;
  waiter_t w = {.timeout_ms = -1};
  CHECK(tcc_allreduce(comm, f32(&x, 1), f32(&x, 1), TCC_SUM, NULL, &w.op) == TCC_OK, "issue");
  pthread_t t;
  pthread_create(&t, NULL, wait_thread, &w);
  usleep(200 * 1000);
  double t0 = now_s();
  if (destroy) {
    tcc_comm_destroy(comm);
    group_comm_destroyed = 1;
  } else {
    tcc_comm_abort(comm);
  }
  pthread_join(t, NULL);
  double dt = w.returned_at - t0;
  CHECK(w.result == TCC_ERR_ABORTED, "waiter got %s: %s", tcc_result_string(w.result), tcc_op_error(w.op));
  CHECK(dt < within_s(1.0), "the waiter returned %.2f s after %s", dt, destroy ? "destroy" : "abort");
  CHECK(strstr(tcc_op_error(w.op), destroy ? "destroyed" : "aborted"), "message: %s", tcc_op_error(w.op));
  /* The handle outlives the communicator. */
  CHECK(tcc_op_test(w.op) == 1 && tcc_op_wait(w.op, 0) == TCC_ERR_ABORTED, "op after the end");
  tcc_op_release(w.op);
}

static void destroy_from_other_thread(tcc_comm_t *comm) { end_from_other_thread(comm, 1); }

/* A thread polls a receive with tcc_op_test (each call runs a p2p round
 * on the transport) while the main thread destroys the communicator: the
 * poller sees the op end, and no round runs on a transport that is gone
 * (ASan would report it). */
static void *poll_thread(void *arg) {
  waiter_t *w = arg;
  while (!tcc_op_test(w->op)) {
  }
  w->result = tcc_op_result(w->op);
  w->returned_at = now_s();
  return NULL;
}

static void destroy_while_polled(tcc_comm_t *comm) {
  if (tcc_comm_rank(comm) == 1) {
    sleep(2);
    return;
  }
  float x = 0;
  waiter_t w = {.timeout_ms = -1};
  CHECK(tcc_recv(comm, f32(&x, 1), 1, 3, NULL, &w.op) == TCC_OK, "issue");
  pthread_t t;
  pthread_create(&t, NULL, poll_thread, &w);
  usleep(200 * 1000);
  double t0 = now_s();
  tcc_comm_destroy(comm);
  group_comm_destroyed = 1;
  pthread_join(t, NULL);
  double dt = w.returned_at - t0;
  CHECK(w.result == TCC_ERR_ABORTED && strstr(tcc_op_error(w.op), "destroyed"), "poller got %s: %s",
        tcc_result_string(w.result), tcc_op_error(w.op));
  CHECK(dt < within_s(1.0), "the poller returned %.2f s after destroy", dt);
  tcc_op_release(w.op);
}
static void abort_from_other_thread(tcc_comm_t *comm) { end_from_other_thread(comm, 0); }

/* A bounded wait returns after its bound while the peer is late; the op
 * keeps going and completes when the peer arrives. */
static void bounded_wait(tcc_comm_t *comm) {
  float x = (float)(tcc_comm_rank(comm) + 1);
  tcc_op_t *op;
  if (tcc_comm_rank(comm) == 1) usleep(800 * 1000);
  CHECK(tcc_allreduce(comm, f32(&x, 1), f32(&x, 1), TCC_SUM, NULL, &op) == TCC_OK, "issue");
  if (tcc_comm_rank(comm) == 0) {
    double t0 = now_s();
    tcc_result_t r = tcc_op_wait(op, 300);
    double dt = now_s() - t0;
    CHECK(r == TCC_ERR_INPROGRESS, "bounded wait gave %s", tcc_result_string(r));
    CHECK(dt > 0.25 && dt < within_s(0.6), "bounded wait of 300 ms returned after %.2f s", dt);
  }
  CHECK(tcc_op_wait(op, -1) == TCC_OK, "the op after the bounded wait: %s", tcc_op_error(op));
  CHECK(x == 3.0f, "allreduce gave %g", (double)x);
  tcc_op_release(op);
}

/* Rank 1 puts a frame header on its p2p stream to rank 0 whose length was
 * damaged after its check word was computed (a terabyte instead of 100
 * bytes): rank 0's receives fail at once, naming rank 1 and the corrupt
 * stream, without allocating or waiting for the named length. */
static void corrupt_p2p_stream(tcc_comm_t *comm) {
  if (tcc_comm_rank(comm) == 1) {
    tcc_p2p_frame_t f;
    tcc__p2p_frame_make(&f, TCC_P2P_DATA, 5, 100);
    f.bytes = 1ull << 40;
    tcc_err_t err = {TCC_OK, {0}};
    size_t sent = 0;
    while (sent < sizeof f) {
      ssize_t n = comm->ops->p2p_write(comm, 0, &(struct iovec){(char *)&f + sent, sizeof f - sent}, 1, &err);
      CHECK(n >= 0, "writing the damaged header: %s", err.msg);
      sent += (size_t)(n > 0 ? n : 0);
    }
  }
  float x[4] = {0};
  char bar = 0;
  tcc_buf_t b = {&bar, 1, TCC_UINT8, -1, NULL};
  if (tcc_comm_rank(comm) == 0) {
    for (int attempt = 0; attempt < 2; attempt++) { /* the stream stays refused */
      tcc_op_t *op;
      double t0 = now_s();
      CHECK(tcc_recv(comm, f32(x, 4), 1, 5, NULL, &op) == TCC_OK, "issue");
      tcc_result_t r = tcc_op_wait(op, -1);
      double dt = now_s() - t0;
      CHECK(r == TCC_ERR_REMOTE, "receive from a corrupt stream gave %s", tcc_result_string(r));
      CHECK(strstr(tcc_op_error(op), "corrupt stream from rank 1") && strstr(tcc_op_error(op), "'faults-group'") &&
                strstr(tcc_op_error(op), "(rank 0)"),
            "error does not name the group, the rank and the peer: %s", tcc_op_error(op));
      CHECK(dt < within_s(1.0), "the error took %.2f s", dt);
      tcc_op_release(op);
    }
  }
  /* The group's collectives are untouched: a barrier-like allreduce. */
  tcc_op_t *op;
  CHECK(tcc_allreduce(comm, b, b, TCC_MAX, NULL, &op) == TCC_OK, "issue the allreduce");
  CHECK(tcc_op_wait(op, -1) == TCC_OK, "allreduce after the corrupt stream: %s", tcc_op_error(op));
  tcc_op_release(op);
}

int main(int argc, char **argv) {
  const char *transports[] = {"shm", "tcp"};
  struct {
    const char *name;
    rank_fn fn;
  } cases[] = {
      {"peer exits", peer_exits_plain},
      {"peer exits, its forked child lives on", peer_exits_after_fork},
      {"destroy from another thread", destroy_from_other_thread},
      {"abort from another thread", abort_from_other_thread},
      {"destroy while another thread polls a receive", destroy_while_polled},
      {"bounded wait", bounded_wait},
      {"peer fails, its process lives on", peer_fails_alive},
      {"corrupt p2p stream", corrupt_p2p_stream},
  };
  alarm(300); /* a hang fails the test instead of blocking CI */
  signal(SIGCHLD, SIG_DFL);
  int passed = 0, failed = 0;
  for (int t = 0; t < 2; t++) {
    if (argc > 1 && strcmp(argv[1], transports[t]) != 0) continue;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      /* group timeout 30 s: anything noticed within a second was not a timeout */
      int bad = run_group(2, transports[t], 30000, "faults-group", cases[c].fn);
      printf("%s %s %s\n", bad ? "FAIL" : "ok  ", transports[t], cases[c].name);
      bad ? failed++ : passed++;
    }
  }
  printf("test_faults: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
