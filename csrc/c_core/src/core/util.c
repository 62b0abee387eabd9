/*
 * util.c - names of enums, the dtype x op support matrix, error recording,
 * time, futexes, randomness and host identity.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"

/* ---- names ------------------------------------------------------------ */

const char *tcc_result_string(tcc_result_t r) {
  switch (r) {
    case TCC_OK: return "success";
    case TCC_ERR_INVALID: return "invalid argument";
    case TCC_ERR_MISMATCH: return "ranks disagree on the operation";
    case TCC_ERR_TIMEOUT: return "timed out";
    case TCC_ERR_ABORTED: return "communicator aborted";
    case TCC_ERR_SYSTEM: return "system call failed";
    case TCC_ERR_UNSUPPORTED: return "unsupported dtype/op combination";
    case TCC_ERR_REMOTE: return "remote peer failed";
    case TCC_ERR_INPROGRESS: return "operation still in progress";
  }
  return "unknown";
}

size_t tcc_dtype_size(tcc_dtype_t dt) { return tcc__dtype_size(dt); }

/* Same spelling as torch's dtype names, so messages read naturally there. */
const char *tcc_dtype_name(tcc_dtype_t dt) {
  switch (dt) {
    case TCC_FLOAT32: return "float32";
    case TCC_FLOAT64: return "float64";
    case TCC_FLOAT16: return "float16";
    case TCC_BFLOAT16: return "bfloat16";
    case TCC_INT8: return "int8";
    case TCC_INT16: return "int16";
    case TCC_INT32: return "int32";
    case TCC_INT64: return "int64";
    case TCC_UINT8: return "uint8";
    case TCC_BOOL: return "bool";
    case TCC_DTYPE_COUNT: break;
  }
  return "unknown";
}

const char *tcc_redop_name(tcc_redop_t op) {
  switch (op) {
    case TCC_SUM: return "sum";
    case TCC_AVG: return "avg";
    case TCC_PRODUCT: return "product";
    case TCC_MIN: return "min";
    case TCC_MAX: return "max";
    case TCC_BAND: return "band";
    case TCC_BOR: return "bor";
    case TCC_BXOR: return "bxor";
    case TCC_PREMUL_SUM: return "premul_sum";
    case TCC_REDOP_COUNT: break;
  }
  return "unknown";
}

/* ---- support matrix ----------------------------------------------------- */

static int dtype_is_float(tcc_dtype_t dt) {
  return dt == TCC_FLOAT32 || dt == TCC_FLOAT64 || dt == TCC_FLOAT16 || dt == TCC_BFLOAT16;
}

static int dtype_is_integer(tcc_dtype_t dt) {
  return dt == TCC_INT8 || dt == TCC_INT16 || dt == TCC_INT32 || dt == TCC_INT64 ||
         dt == TCC_UINT8;
}

tcc_result_t tcc_redop_supported(tcc_dtype_t dt, tcc_redop_t op) {
  /* Enums may arrive from untrusted casts: anything out of range is unsupported. */
  if ((unsigned)dt >= (unsigned)TCC_DTYPE_COUNT || (unsigned)op >= (unsigned)TCC_REDOP_COUNT)
    return TCC_ERR_UNSUPPORTED;
  int is_float = dtype_is_float(dt);
  int is_int = dtype_is_integer(dt);
  int is_bool = dt == TCC_BOOL;
  int ok = 0;
  switch (op) {
    case TCC_SUM:
    case TCC_PRODUCT:
    case TCC_MIN:
    case TCC_MAX: ok = 1; break;
    case TCC_AVG: ok = is_float || is_int; break;
    case TCC_PREMUL_SUM: ok = is_float; break;
    case TCC_BAND:
    case TCC_BOR:
    case TCC_BXOR: ok = is_int || is_bool; break;
    case TCC_REDOP_COUNT: break;
  }
  return ok ? TCC_OK : TCC_ERR_UNSUPPORTED;
}

/* ---- errors --------------------------------------------------------------- */

/* Synchronous causes: one message per thread, so concurrent calls on one
 * communicator from several threads never overwrite each other's. */
static _Thread_local char last_error[TCC_ERRLEN];

const char *tcc_last_error(void) { return last_error; }

tcc_result_t tcc__fail(tcc_result_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return code;
}

tcc_result_t tcc__fail_with(const tcc_err_t *err, tcc_result_t code) {
  return tcc__fail(code, "%s", err->msg[0] ? err->msg : tcc_result_string(code));
}

tcc_result_t tcc__err_set(tcc_err_t *err, tcc_result_t code, const char *fmt, ...) {
  /* The first failure is the cause; later ones are usually its echoes. */
  if (err == NULL || err->code != TCC_OK || code == TCC_OK) return code;
  err->code = code;
  err->msg[0] = '\0';
  if (fmt != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

tcc_result_t tcc__err_prefix(tcc_err_t *err, tcc_result_t code, const char *fmt, ...) {
  if (err == NULL || code == TCC_OK) return code;
  char rest[sizeof err->msg];
  memcpy(rest, err->code != TCC_OK ? err->msg : tcc_result_string(code), sizeof rest);
  rest[sizeof rest - 1] = '\0';
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
  va_end(ap);
  size_t at = k < 0 ? 0 : (size_t)k < sizeof err->msg ? (size_t)k : sizeof err->msg - 1;
  size_t len = strnlen(rest, sizeof err->msg - 1 - at);
  memcpy(err->msg + at, rest, len);
  err->msg[at + len] = '\0';
  err->code = code;
  return code;
}

/* ---- time and waiting ------------------------------------------------------ */

int64_t tcc__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t tcc__coarse_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* now + timeout_ms, saturated at INT64_MAX. */
static int64_t after_ms(int64_t now, int64_t timeout_ms) {
  /* Compared before multiplying: neither the product nor the sum may overflow. */
  if (timeout_ms > (INT64_MAX - now) / 1000000) return INT64_MAX;
  return now + timeout_ms * 1000000;
}

int64_t tcc__deadline_after_ms(int64_t timeout_ms) {
  const int64_t now = tcc__now_ns();
  return timeout_ms <= 0 ? now : after_ms(now, timeout_ms);
}

/* The coarse clock's tick: how far it may lag behind the fine one. */
static int64_t coarse_tick_ns(void) {
  static atomic_llong tick; /* 0: not read yet; every thread reads the same */
  int64_t t = atomic_load_explicit(&tick, memory_order_relaxed);
  if (t == 0) {
    struct timespec res;
    t = clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 ? (int64_t)res.tv_sec * 1000000000 + res.tv_nsec : 0;
    if (t <= 0) t = 10 * 1000000; /* no answer: a 100 Hz tick, the coarsest Linux has */
    atomic_store_explicit(&tick, t, memory_order_relaxed);
  }
  return t;
}

int64_t tcc__coarse_deadline_after_ms(int64_t timeout_ms) {
  if (timeout_ms <= 0) return tcc__now_ns();
  /* The coarse clock moves at each tick: it lags by up to one, a little
   * more when a tick comes late; two cover both. */
  return after_ms(tcc__coarse_now_ns() + 2 * coarse_tick_ns(), timeout_ms);
}

void tcc__cond_init_monotonic(pthread_cond_t *cv) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &attr);
  pthread_condattr_destroy(&attr);
}

/* No FUTEX_PRIVATE_FLAG: the word may be in memory shared between
 * processes, and private futexes only match waiters of one process. */
void tcc__futex_wait(atomic_uint *word, unsigned expected, int64_t max_ns) {
  if (max_ns <= 0) return;
  struct timespec rel;
  rel.tv_sec = (time_t)(max_ns / 1000000000);
  rel.tv_nsec = (long)(max_ns % 1000000000);
  /* EAGAIN (value changed), EINTR and ETIMEDOUT all mean "go and look
   * again", which is what every caller does anyway. */
  syscall(SYS_futex, (void *)word, FUTEX_WAIT, expected, &rel, NULL, 0);
}

void tcc__futex_wake_all(atomic_uint *word) {
  syscall(SYS_futex, (void *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* ---- randomness and host identity ------------------------------------------- */

static tcc_result_t read_urandom(uint8_t *out, size_t n) {
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return TCC_ERR_SYSTEM;
  size_t done = 0;
  while (done < n) {
    ssize_t got = read(fd, out + done, n - done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      close(fd);
      return TCC_ERR_SYSTEM;
    }
    done += (size_t)got;
  }
  close(fd);
  return TCC_OK;
}

tcc_result_t tcc__random_bytes(void *buf, size_t n) {
  uint8_t *out = buf;
  size_t done = 0;
  while (done < n) {
    ssize_t got = getrandom(out + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      /* Old kernels or seccomp filters may lack getrandom. */
      if (errno == ENOSYS || errno == EPERM) return read_urandom(out + done, n - done);
      return TCC_ERR_SYSTEM;
    }
    done += (size_t)got; /* large requests may come back short */
  }
  return TCC_OK;
}

void tcc__host_identity(char hostname[64], char boot_id[40]) {
  /* TCCOMM_HOSTID stands for the hostname, as NCCL_HOSTID does for NCCL:
   * processes that could share memory but should not (or tests that
   * simulate hosts) name themselves apart. */
  const char *hostid = getenv("TCCOMM_HOSTID");
  if (hostid && *hostid) snprintf(hostname, 64, "%s", hostid);
  /* gethostname need not NUL-terminate a truncated name. */
  else if (gethostname(hostname, 64) != 0) hostname[0] = '\0';
  hostname[63] = '\0';

  boot_id[0] = '\0';
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  size_t len = 0;
  while (len < 39) {
    ssize_t got = read(fd, boot_id + len, 39 - len);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    len += (size_t)got;
  }
  close(fd);
  while (len > 0 && (boot_id[len - 1] == '\n' || boot_id[len - 1] == ' ' ||
                     boot_id[len - 1] == '\r' || boot_id[len - 1] == '\t'))
    len--;
  boot_id[len] = '\0';
}

void tcc__shm_identity(uint64_t *dev, uint64_t *ino) {
  struct stat sb;
  if (stat("/dev/shm", &sb) != 0 || !S_ISDIR(sb.st_mode)) {
    *dev = *ino = 0;
    return;
  }
  *dev = (uint64_t)sb.st_dev;
  *ino = (uint64_t)sb.st_ino;
}
