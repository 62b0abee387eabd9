/*
 * test_window.c - one-sided windows (tccomm.h, "windows") in real forked
 * process groups: puts at offsets into every peer, signal counting and
 * ordering, views of peers' buffers, bad arguments, wait timeouts, and the
 * refusal on a TCP communicator.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "tccomm.h"

typedef struct rendezvous {
  atomic_int published;
  uint8_t blobs[4 * TCC_ENDPOINT_BLOB_SIZE];
} rendezvous_t;

typedef void (*rank_fn)(tcc_comm_t *comm);

/* Bytes of rank r's window: different per rank on purpose. */
static size_t win_bytes(int r) { return 4096 + (size_t)r * 1000; }

static void test_puts_and_signals(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  tcc_window_t *win = NULL;
  tcc_result_t r = tcc_window_create(comm, win_bytes(me), 0, &win);
  CHECK(r == TCC_OK, "create: %s", tcc_last_error());
  if (r != TCC_OK) return;
  size_t bytes = 0;
  const unsigned char *mine = tcc_window_buffer(win, me, &bytes);
  CHECK(bytes == win_bytes(me), "own size %zu", bytes);
  size_t nonzero = 0;
  for (size_t i = 0; i < bytes; i++) nonzero += mine[i] != 0;
  CHECK(nonzero == 0, "starts zeroed: %zu bytes are not", nonzero);
  /* Peers put only once everyone has checked that. */
  tcc_op_t *op;
  CHECK(tcc_barrier(comm, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "barrier");
  tcc_op_release(op);
  /* Every rank writes 8 bytes of value (me+1) at offset 8*me of every peer
   * (itself included), then signals it. */
  unsigned char src[8];
  memset(src, me + 1, sizeof src);
  for (int d = 0; d < n; d++) {
    CHECK(tcc_window_put(win, src, sizeof src, d, 8 * (size_t)me) == TCC_OK, "put: %s", tcc_last_error());
    CHECK(tcc_window_signal(win, d) == TCC_OK, "signal");
  }
  for (int p = 0; p < n; p++) {
    CHECK(tcc_window_wait_signal(win, p, 0) == TCC_OK, "wait %d: %s", p, tcc_last_error());
    for (int k = 0; k < 8; k++) CHECK(mine[8 * p + k] == p + 1, "rank %d's bytes from %d", me, p);
  }
  /* Two signals are two waits; a third wait times out and names the peer. */
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  tcc_window_signal(win, next);
  tcc_window_signal(win, next);
  CHECK(tcc_window_wait_signal(win, prev, 0) == TCC_OK, "first of two");
  CHECK(tcc_window_wait_signal(win, prev, 0) == TCC_OK, "second of two");
  r = tcc_window_wait_signal(win, prev, 100);
  CHECK(r == TCC_ERR_TIMEOUT && strstr(tcc_last_error(), "timed out"), "third: %s",
        tcc_last_error());
  /* The peer's view shows its buffer, written by its owner. */
  size_t pbytes = 0;
  const unsigned char *peer = tcc_window_buffer(win, next, &pbytes);
  CHECK(pbytes == win_bytes(next), "peer size %zu", pbytes);
  CHECK(peer[8 * me] == me + 1, "my put seen through the peer's view");
  /* Bad arguments fail with a message and change nothing. */
  CHECK(tcc_window_put(win, src, 8, n, 0) == TCC_ERR_INVALID && strstr(tcc_last_error(), "out of range"),
        "bad rank: %s", tcc_last_error());
  CHECK(tcc_window_put(win, src, 8, next, win_bytes(next) - 4) == TCC_ERR_INVALID &&
            strstr(tcc_last_error(), "do not fit"),
        "bad offset: %s", tcc_last_error());
  CHECK(tcc_window_put(win, src, 8, next, (size_t)-4) == TCC_ERR_INVALID, "overflowing offset");
  CHECK(tcc_window_signal(win, -1) == TCC_ERR_INVALID, "bad signal rank");
  CHECK(tcc_window_wait_signal(win, n, 10) == TCC_ERR_INVALID, "bad wait rank");
  CHECK(tcc_window_buffer(win, n, &pbytes) == NULL && pbytes == 0, "bad buffer rank");
  /* Everyone is done reading before anyone destroys. */
  CHECK(tcc_barrier(comm, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK, "barrier");
  tcc_op_release(op);
  tcc_window_destroy(win);
  /* One rank asking for too much fails the creation on every rank. */
  r = tcc_window_create(comm, me == n - 1 ? ((size_t)1 << 50) : 8, 0, &win);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "more than"), "too large: %s", tcc_last_error());
  /* A rank that declines fails the creation on every rank, naming it. */
  r = tcc_window_create(comm, me == 0 ? TCC_WINDOW_DECLINE : 8, 0, &win);
  CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "rank 0 could not register"), "declined: %s", tcc_last_error());
  /* A second window on the same communicator is independent. */
  r = tcc_window_create(comm, 16, 0, &win);
  CHECK(r == TCC_OK, "second create: %s", tcc_last_error());
  if (r == TCC_OK) {
    const unsigned char *b = tcc_window_buffer(win, me, &bytes);
    CHECK(bytes == 16 && b[0] == 0, "second window fresh");
    tcc_window_destroy(win);
  }
}

static void test_tcp_refused(tcc_comm_t *comm) {
  tcc_window_t *win = NULL;
  tcc_result_t r = tcc_window_create(comm, 64, 0, &win);
  CHECK(r == TCC_ERR_UNSUPPORTED && strstr(tcc_last_error(), "shared-memory") && strstr(tcc_last_error(), "tcp"), "tcp: %s", tcc_last_error());
}

static int run_group(int n, tcc_transport_t transport, rank_fn fn) {
  rendezvous_t *rv = mmap(NULL, sizeof *rv, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pid_t pids[4];
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] != 0) continue;
    tcc_endpoint_t *ep;
    uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
    if (tcc_endpoint_open("127.0.0.1", &ep, blob) != TCC_OK) _exit(2);
    memcpy(rv->blobs + (size_t)r * TCC_ENDPOINT_BLOB_SIZE, blob, sizeof blob);
    atomic_fetch_add(&rv->published, 1);
    while (atomic_load(&rv->published) < n) usleep(1000);
    tcc_comm_config_t cfg = {r, n, 30000, "window-group", transport};
    tcc_comm_t *comm;
    if (tcc_comm_create(&cfg, ep, rv->blobs, &comm) != TCC_OK) {
      fprintf(stderr, "rank %d create: %s\n", r, tcc_last_error());
      _exit(2);
    }
    fn(comm);
    tcc_comm_destroy(comm);
    rank_exit(check_failures ? 1 : 0);
  }
  int failed = 0;
  for (int r = 0; r < n; r++) {
    int status;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  munmap(rv, sizeof *rv);
  return failed;
}

int main(void) {
  alarm(300); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  int failed = 0;
  for (int n = 1; n <= 4; n++) {
    int bad = run_group(n, TCC_TRANSPORT_SHM, test_puts_and_signals);
    printf("%s windows n=%d\n", bad ? "FAIL" : "ok  ", n);
    failed += bad;
  }
  int bad = run_group(2, TCC_TRANSPORT_TCP, test_tcp_refused);
  printf("%s window refused over tcp\n", bad ? "FAIL" : "ok  ");
  failed += bad;
  printf("test_window: %d failed\n", failed);
  return failed ? 1 : 0;
}
