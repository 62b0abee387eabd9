/*
 * check.h - minimal assertions for the C core's tests.
 *
 *   CHECK(x == 3, "x=%d", x);   records a failure and prints file:line
 *   CHECK_DONE();               ends main: returns 1 if anything failed
 *
 * Failures are counted, not fatal, so one run shows every broken case;
 * printing stops after CHECK_MAX_PRINTED to keep loops readable.
 */
#ifndef TCC_TESTS_CHECK_H
#define TCC_TESTS_CHECK_H

#include <stdio.h>

#define CHECK_MAX_PRINTED 50

static long check_failures __attribute__((unused));

/* The format and its arguments are the variadic part so CHECK(c, "msg")
 * needs no trailing arguments. */
#define CHECK(cond, ...)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      if (check_failures++ < CHECK_MAX_PRINTED) {                             \
        fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
        fprintf(stderr, __VA_ARGS__);                                         \
        fputc('\n', stderr);                                                  \
      }                                                                       \
    }                                                                         \
  } while (0)

/* Ends a forked rank. Ranks leave through _exit (the atexit handlers are
 * the parent's, not theirs), so LeakSanitizer, which looks at exit, would
 * never see what a rank leaked: under ASan it is asked here, and a leak
 * fails the rank (exit code 3). */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif
#include <unistd.h>

static void __attribute__((unused, noreturn)) rank_exit(int code) {
#if defined(__SANITIZE_ADDRESS__)
  if (code == 0 && __lsan_do_recoverable_leak_check()) code = 3;
#endif
  _exit(code);
}

#define CHECK_DONE()                                                          \
  do {                                                                        \
    if (check_failures) {                                                     \
      fprintf(stderr, "%s: %ld check(s) failed\n", __FILE__, check_failures); \
      return 1;                                                               \
    }                                                                         \
    return 0;                                                                 \
  } while (0)

#endif /* TCC_TESTS_CHECK_H */
