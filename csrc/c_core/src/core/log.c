/*
 * log.c - debug logging (see log.h): reading TCCOMM_DEBUG and
 * TCCOMM_DEBUG_FILE once, formatting a line, writing it.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/log.h"
#include "tccomm.h"

#define LINE_BYTES 2048
#define PATH_BYTES 1024

atomic_int tcc__log_level = TCC__LOG_OFF;

/* Written once by setup, before the level is published (release), and
 * read only after a line's writer has seen the level (acquire). */
static int log_fd = STDERR_FILENO;
static char hostname[64] = "?";
static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

static const char *const level_names[] = {"OFF", "VERSION", "WARN", "INFO", "TRACE"};

/* Writes all of buf with as few write calls as the kernel allows: one for
 * any line of ordinary length, so lines of concurrent writers (threads, or
 * processes sharing an O_APPEND file) never interleave. */
static void write_all(int fd, const char *buf, size_t len) {
  while (len > 0) {
    ssize_t n = write(fd, buf, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return; /* nowhere to report it: logging must never fail an op */
    buf += n;
    len -= (size_t)n;
  }
}

/* One line "<host>:<pid>:<tid> [<rank>] TCCOMM <LEVEL> <message>\n" to fd.
 * A message longer than the line is cut (marked "..."); newlines inside it
 * become spaces so every record stays one line. */
static void format_and_write(int fd, tcc__log_level_t level, int rank, const char *fmt, va_list ap) {
  char line[LINE_BYTES];
  char who[16];
  if (rank >= 0) snprintf(who, sizeof who, "%d", rank);
  else snprintf(who, sizeof who, "-");
  int head = snprintf(line, sizeof line, "%s:%d:%ld [%s] TCCOMM %s ", hostname, (int)getpid(),
                      (long)syscall(SYS_gettid), who, level_names[level]);
  if (head < 0 || (size_t)head >= sizeof line - 5) return;
  const size_t room = sizeof line - (size_t)head - 1; /* keeps one byte for '\n' */
  int body = vsnprintf(line + head, room, fmt, ap);
  if (body < 0) body = 0;
  size_t end = (size_t)head + ((size_t)body < room ? (size_t)body : room - 1);
  if ((size_t)body >= room) memcpy(line + end - 3, "...", 3);
  for (size_t i = (size_t)head; i < end; i++)
    if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
  line[end++] = '\n';
  write_all(fd, line, end);
}

void tcc__log_write(tcc__log_level_t level, int rank, const char *fmt, ...) {
  /* Pairs with the release in setup: log_fd and hostname are complete. */
  if (atomic_load_explicit(&tcc__log_level, memory_order_acquire) < (int)level) return;
  va_list ap;
  va_start(ap, fmt);
  format_and_write(log_fd, level, rank, fmt, ap);
  va_end(ap);
}

/* A complaint about the settings themselves: always to stderr, whatever
 * the level, since it says why logging is not what was asked for. */
static void setup_warning(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void setup_warning(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  format_and_write(STDERR_FILENO, TCC__LOG_WARN, -1, fmt, ap);
  va_end(ap);
}

static tcc__log_level_t parse_level(const char *s) {
  if (!s || !*s) return TCC__LOG_OFF;
  for (int l = TCC__LOG_VERSION; l <= TCC__LOG_TRACE; l++)
    if (strcasecmp(s, level_names[l]) == 0) return (tcc__log_level_t)l;
  /* Garbage turns logging off rather than on: a typo must not flood the
   * job's output, nor stop it. */
  setup_warning("TCCOMM_DEBUG='%.100s' is not one of VERSION, WARN, INFO, TRACE (any case): debug logging is off", s);
  return TCC__LOG_OFF;
}

/* pattern with %h -> host name and %p -> pid; any other '%' stays as it is.
 * False when the result does not fit. */
static int expand_path(const char *pattern, char *out, size_t len) {
  size_t o = 0;
  for (const char *p = pattern; *p; p++) {
    char piece[64];
    const char *add = piece;
    if (p[0] == '%' && p[1] == 'h') {
      add = hostname;
      p++;
    } else if (p[0] == '%' && p[1] == 'p') {
      snprintf(piece, sizeof piece, "%d", (int)getpid());
      p++;
    } else {
      piece[0] = *p;
      piece[1] = '\0';
    }
    size_t n = strlen(add);
    if (o + n >= len) return 0;
    memcpy(out + o, add, n);
    o += n;
  }
  out[o] = '\0';
  return 1;
}

/* The file named by TCCOMM_DEBUG_FILE, else stderr (with a warning when the
 * file cannot be opened: the lines then still go somewhere). */
static int open_destination(void) {
  const char *pattern = getenv("TCCOMM_DEBUG_FILE");
  if (!pattern || !*pattern) return STDERR_FILENO;
  char path[PATH_BYTES];
  if (!expand_path(pattern, path, sizeof path)) {
    setup_warning("TCCOMM_DEBUG_FILE='%.200s' is too long once expanded: logging to stderr", pattern);
    return STDERR_FILENO;
  }
  /* O_APPEND: each line lands whole at the end, also when several
   * processes share one file; O_CLOEXEC: an exec'd child does not keep it. */
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    setup_warning("cannot open TCCOMM_DEBUG_FILE '%.400s' (%s): logging to stderr", path, strerror(errno));
    return STDERR_FILENO;
  }
  return fd;
}

static void log_version(tcc__log_level_t level) {
  int nccl = tcc_nccl_header_version();
  char built[64];
  if (nccl) snprintf(built, sizeof built, "built with NCCL headers %d", nccl);
  else snprintf(built, sizeof built, "built without CUDA");
  tcc__log_write(level, -1, "tccomm version %d.%d (%s)", TCC_VERSION_MAJOR, TCC_VERSION_MINOR, built);
}

static void setup(void) {
  if (gethostname(hostname, sizeof hostname) != 0) snprintf(hostname, sizeof hostname, "?");
  hostname[sizeof hostname - 1] = '\0';
  tcc__log_level_t level = parse_level(getenv("TCCOMM_DEBUG"));
  if (level == TCC__LOG_OFF) return;
  log_fd = open_destination();
  atomic_store_explicit(&tcc__log_level, (int)level, memory_order_release);
  /* The version once per process: alone at VERSION, as the first INFO line
   * above it; WARN keeps to failures. */
  if (level == TCC__LOG_VERSION) log_version(TCC__LOG_VERSION);
  else if (level >= TCC__LOG_INFO) log_version(TCC__LOG_INFO);
}

void tcc__log_setup(void) { pthread_once(&setup_once, setup); }
