/*
 * test_util.c - errors, clock, futexes, randomness and host identity.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "core/internal.h"

static void test_err_set(void) {
  tcc_err_t err = {0};
  CHECK(tcc__err_set(&err, TCC_ERR_TIMEOUT, "rank %d late", 3) == TCC_ERR_TIMEOUT, "returns code");
  CHECK(err.code == TCC_ERR_TIMEOUT && strcmp(err.msg, "rank 3 late") == 0, "recorded: %s",
        err.msg);
  /* The first error is kept; later ones only return their code. */
  CHECK(tcc__err_set(&err, TCC_ERR_ABORTED, "later") == TCC_ERR_ABORTED, "returns later code");
  CHECK(err.code == TCC_ERR_TIMEOUT && strcmp(err.msg, "rank 3 late") == 0, "first wins: %s",
        err.msg);
  CHECK(tcc__err_set(NULL, TCC_ERR_SYSTEM, "x") == TCC_ERR_SYSTEM, "NULL err");
  tcc_err_t ok = {0};
  CHECK(tcc__err_set(&ok, TCC_OK, "fine") == TCC_OK && ok.code == TCC_OK, "TCC_OK records nothing");
  tcc_err_t longmsg = {0};
  char big[2 * TCC_ERRLEN];
  memset(big, 'x', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  tcc__err_set(&longmsg, TCC_ERR_INVALID, "%s", big);
  CHECK(strlen(longmsg.msg) == TCC_ERRLEN - 1, "truncated to %zu", strlen(longmsg.msg));
}

static void test_clock(void) {
  int64_t a = tcc__now_ns(), b = tcc__now_ns();
  CHECK(a > 0 && b >= a, "monotonic: %lld then %lld", (long long)a, (long long)b);
}

static void test_deadline(void) {
  const int64_t before = tcc__now_ns();
  const int64_t d = tcc__deadline_after_ms(250);
  CHECK(d >= before + 250 * 1000000LL && d <= tcc__now_ns() + 250 * 1000000LL, "250 ms: %lld", (long long)(d - before));
  /* Huge timeouts saturate instead of wrapping into the past. */
  CHECK(tcc__deadline_after_ms(INT64_MAX) == INT64_MAX, "INT64_MAX ms");
  CHECK(tcc__deadline_after_ms(INT64_MAX / 1000) == INT64_MAX, "INT64_MAX/1000 ms");
  const int64_t year_ms = 365LL * 24 * 3600 * 1000;
  CHECK(tcc__deadline_after_ms(200 * year_ms) > tcc__now_ns() + 100 * year_ms * 1000000, "200 years");
  /* A negative timeout is "now", never a deadline in the past. */
  const int64_t now = tcc__now_ns();
  const int64_t neg = tcc__deadline_after_ms(-5);
  CHECK(neg >= now && neg <= tcc__now_ns(), "negative: %lld", (long long)(neg - now));
}

/* An op's deadline: from the coarse clock, never early, late by at most
 * two of its ticks (10 ms each at the coarsest). */
static void test_coarse_deadline(void) {
  for (int i = 0; i < 1000; i++) {
    const int64_t before = tcc__now_ns();
    const int64_t d = tcc__coarse_deadline_after_ms(250);
    const int64_t after = tcc__now_ns();
    CHECK(d >= before + 250 * 1000000LL, "coarse 250 ms is early by %lld ns", (long long)(before + 250 * 1000000LL - d));
    CHECK(d <= after + 270 * 1000000LL, "coarse 250 ms is late by %lld ns", (long long)(d - after - 250 * 1000000LL));
  }
  CHECK(tcc__coarse_deadline_after_ms(INT64_MAX) == INT64_MAX, "coarse INT64_MAX ms");
  const int64_t now = tcc__now_ns();
  const int64_t zero = tcc__coarse_deadline_after_ms(0);
  CHECK(zero >= now && zero <= tcc__now_ns(), "coarse 0 ms: %lld", (long long)(zero - now));
}

static atomic_uint futex_word;

static void *wake_later(void *arg) {
  (void)arg;
  struct timespec pause = {0, 20 * 1000 * 1000};
  nanosleep(&pause, NULL);
  atomic_store(&futex_word, 1);
  tcc__futex_wake_all(&futex_word);
  return NULL;
}

static void test_futex(void) {
  atomic_store(&futex_word, 0);
  int64_t start = tcc__now_ns();
  tcc__futex_wait(&futex_word, 0, 0); /* max_ns <= 0: returns at once */
  tcc__futex_wait(&futex_word, 0, -5);
  CHECK(tcc__now_ns() - start < 50 * 1000 * 1000, "non-positive max_ns blocked");

  start = tcc__now_ns();
  tcc__futex_wait(&futex_word, 0, 5 * 1000 * 1000); /* nobody wakes: times out */
  int64_t waited = tcc__now_ns() - start;
  CHECK(waited >= 4 * 1000 * 1000 && waited < 2000LL * 1000 * 1000, "timeout wait %lld ns",
        (long long)waited);

  start = tcc__now_ns();
  tcc__futex_wait(&futex_word, 7, 2000LL * 1000 * 1000); /* value differs: returns */
  CHECK(tcc__now_ns() - start < 500LL * 1000 * 1000, "mismatched value blocked");

  pthread_t waker;
  pthread_create(&waker, NULL, wake_later, NULL);
  start = tcc__now_ns();
  while (atomic_load(&futex_word) == 0) tcc__futex_wait(&futex_word, 0, 5000LL * 1000 * 1000);
  waited = tcc__now_ns() - start;
  pthread_join(waker, NULL);
  CHECK(waited < 4000LL * 1000 * 1000, "woken after %lld ns", (long long)waited);
}

static void test_random(void) {
  uint8_t a[64] = {0}, b[64] = {0};
  CHECK(tcc__random_bytes(a, sizeof a) == TCC_OK, "random a");
  CHECK(tcc__random_bytes(b, sizeof b) == TCC_OK, "random b");
  CHECK(memcmp(a, b, sizeof a) != 0, "two draws are equal");
  CHECK(tcc__random_bytes(a, 0) == TCC_OK, "zero bytes");
  static uint8_t large[1 << 20];
  CHECK(tcc__random_bytes(large, sizeof large) == TCC_OK, "1 MiB");
}

static void test_host_identity(void) {
  char hostname[64], boot_id[40];
  memset(hostname, 'z', sizeof hostname);
  memset(boot_id, 'z', sizeof boot_id);
  tcc__host_identity(hostname, boot_id);
  CHECK(memchr(hostname, '\0', sizeof hostname) != NULL, "hostname unterminated");
  CHECK(memchr(boot_id, '\0', sizeof boot_id) != NULL, "boot id unterminated");
  CHECK(hostname[0] != '\0', "empty hostname");
  /* Linux boot ids are UUIDs; elsewhere the id may be empty. */
  size_t len = strlen(boot_id);
  CHECK(len == 0 || (len == 36 && boot_id[8] == '-'), "boot id '%s'", boot_id);
  CHECK(strchr(boot_id, '\n') == NULL, "boot id keeps its newline");
  char again_host[64], again_boot[40];
  tcc__host_identity(again_host, again_boot);
  CHECK(strcmp(hostname, again_host) == 0 && strcmp(boot_id, again_boot) == 0, "unstable");
}

int main(void) {
  test_err_set();
  test_clock();
  test_deadline();
  test_coarse_deadline();
  test_futex();
  test_random();
  test_host_identity();
  printf("test_util: %ld failures\n", check_failures);
  CHECK_DONE();
}
