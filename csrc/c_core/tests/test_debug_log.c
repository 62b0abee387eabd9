/*
 * test_debug_log.c - TCCOMM_DEBUG / TCCOMM_DEBUG_FILE in real 2-rank groups.
 *
 * Each scenario runs in a process of its own (the level is read once per
 * process): its stderr goes to a file, TCCOMM_DEBUG* are set, and a group
 * is forked with each rank logging to <dir>/log.%p. The files are then read
 * back and checked line by line:
 *   - every line is "<host>:<pid>:<tid> [<rank>] TCCOMM <LEVEL> <message>",
 *     with this host, the pid of the file and the rank of its process;
 *   - INFO: the version, the transport and why (shm on one host, tcp across
 *     "hosts" and when forced), the thresholds (an overridden one-shot
 *     size), name, rank, size, timeout, destroy; nothing at TRACE level;
 *   - TRACE: one line per op with its sequence number, dtype, count and
 *     bytes, root or peer and the algorithm (one-shot vs pipelined by size);
 *   - WARN: nothing in a clean run; a timeout, an abort and a failed
 *     creation each give a WARN line, and nothing else is written;
 *   - VERSION: the version line only;
 *   - unset: no file at all; garbage: off, one warning per process on
 *     stderr naming the accepted values; an unopenable file: stderr.
 *
 * Usage: test_debug_log
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "group.h"

#define MAX_FILES 8
#define NAME "log-group"

static char dir[64];
static char host[64];
/* Shared by the ranks (mapped before the fork): rank 1 has aborted. */
static atomic_int *rank1_aborted;


typedef struct log_file {
  char name[256];
  int pid;   /* from the file name: log.<pid> */
  char *text;
} log_file_t;

static char *read_text(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  size_t cap = 4096, len = 0;
  char *buf = malloc(cap);
  size_t n;
  while ((n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (len + 1 == cap) buf = realloc(buf, cap *= 2);
  }
  buf[len] = '\0';
  fclose(f);
  return buf;
}

/* The log files the last scenario left in dir (log.*), in no order. */
static int read_logs(log_file_t *files) {
  int n = 0;
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d)) && n < MAX_FILES) {
    if (strncmp(e->d_name, "log.", 4) != 0) continue;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    snprintf(files[n].name, sizeof files[n].name, "%s", e->d_name);
    const char *last_dot = strrchr(e->d_name, '.');
    files[n].pid = atoi(last_dot + 1);
    files[n].text = read_text(path);
    n++;
  }
  if (d) closedir(d);
  return n;
}

static void free_logs(log_file_t *files, int n) {
  for (int i = 0; i < n; i++) free(files[i].text);
}

/* Empties dir for the next scenario. */
static void clear_dir(void) {
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    unlink(path);
  }
  if (d) closedir(d);
}

static int count_lines(const char *text, const char *needle) {
  int n = 0;
  for (const char *line = text; line && *line;) {
    const char *end = strchr(line, '\n');
    size_t len = end ? (size_t)(end - line) : strlen(line);
    char buf[4096];
    snprintf(buf, sizeof buf, "%.*s", (int)len, line);
    if (strstr(buf, needle)) n++;
    line = end ? end + 1 : NULL;
  }
  return n;
}

/* Every line has the prefix of this host and pid, one rank of the group
 * (the same on all lines that name one, '-' before there is a communicator)
 * and a level; returns the rank (-1 when no line named one). */
static int check_format(const log_file_t *f) {
  int rank = -1;
  for (const char *line = f->text; line && *line;) {
    const char *end = strchr(line, '\n');
    CHECK(end != NULL, "%s: last line not terminated", f->name);
    char h[64], who[16], level[16];
    int pid = 0;
    long tid = 0;
    int got = sscanf(line, "%63[^:]:%d:%ld [%15[^]]] TCCOMM %15s ", h, &pid, &tid, who, level);
    CHECK(got == 5, "%s: malformed line: %.200s", f->name, line);
    if (got == 5) {
      CHECK(strcmp(h, host) == 0, "%s: host %s, expected %s", f->name, h, host);
      CHECK(pid == f->pid, "%s: pid %d in a line of the file of pid %d", f->name, pid, f->pid);
      CHECK(tid > 0, "%s: tid %ld", f->name, tid);
      CHECK(strcmp(level, "VERSION") == 0 || strcmp(level, "WARN") == 0 || strcmp(level, "INFO") == 0 ||
                strcmp(level, "TRACE") == 0,
            "%s: level %s", f->name, level);
      if (strcmp(who, "-") != 0) {
        int r = atoi(who);
        CHECK(r == 0 || r == 1, "%s: rank %s", f->name, who);
        CHECK(rank < 0 || rank == r, "%s: ranks %d and %d in one process", f->name, rank, r);
        rank = r;
      }
    }
    line = end ? end + 1 : NULL;
  }
  return rank;
}

/* Runs the group of 2 ranks in a process of its own, with stderr to
 * dir/stderr and the environment given as NAME=VALUE strings (NULL-ended;
 * "NAME=" without a value unsets). Returns run_group's verdict. */
static int scenario(const char *spec, int64_t timeout_ms, rank_fn fn, const char *const *env) {
  clear_dir();
  atomic_store(rank1_aborted, 0);
  pid_t pid = fork();
  if (pid == 0) {
    char path[128];
    snprintf(path, sizeof path, "%s/stderr", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDERR_FILENO);
    close(fd);
    unsetenv("TCCOMM_DEBUG");
    unsetenv("TCCOMM_DEBUG_FILE");
    unsetenv("TCCOMM_TRANSPORT");
    for (const char *const *e = env; *e; e++) {
      char name[64];
      const char *eq = strchr(*e, '=');
      snprintf(name, sizeof name, "%.*s", (int)(eq - *e), *e);
      if (eq[1]) setenv(name, eq + 1, 1);
      else unsetenv(name);
    }
    _exit(run_group(2, spec, timeout_ms, NAME, fn));
  }
  int status;
  waitpid(pid, &status, 0);
  int failed = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  if (failed) { /* the ranks' own complaints went to the scenario's stderr */
    char path[128];
    snprintf(path, sizeof path, "%s/stderr", dir);
    char *t = read_text(path);
    fprintf(stderr, "scenario %s failed; its stderr:\n%s\n", spec, t ? t : "(none)");
    free(t);
  }
  return failed;
}

static char *read_stderr(void) {
  char path[128];
  snprintf(path, sizeof path, "%s/stderr", dir);
  char *t = read_text(path);
  return t ? t : calloc(1, 1);
}

static tcc_buf_t f32(float *p, size_t n) { return (tcc_buf_t){p, n, TCC_FLOAT32, -1, NULL}; }

static tcc_result_t wait_release(tcc_result_t issued, tcc_op_t *op) {
  if (issued != TCC_OK) return issued;
  tcc_result_t r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  return r;
}

/* ---- what the ranks do ------------------------------------------------- */

static float big[20003];

/* allreduce of 8 floats (32 bytes: one-shot), of 4096 (16 KiB: pipelined
 * once TCCOMM_SHM_SMALL_BYTES=4096), broadcast from root 1, barrier, and a
 * send from rank 0 to rank 1 with tag 7. */
static void some_ops(tcc_comm_t *comm) {
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allreduce(comm, f32(x, 8), f32(x, 8), TCC_SUM, NULL, &op);
  CHECK(wait_release(r, op) == TCC_OK, "allreduce: %s", tcc_last_error());
  r = tcc_allreduce(comm, f32(big, 20003), f32(big, 20003), TCC_SUM, NULL, &op);
  CHECK(wait_release(r, op) == TCC_OK, "allreduce: %s", tcc_last_error());
  r = tcc_broadcast(comm, f32(x, 8), 1, NULL, &op);
  CHECK(wait_release(r, op) == TCC_OK, "broadcast: %s", tcc_last_error());
  r = tcc_barrier(comm, NULL, &op);
  CHECK(wait_release(r, op) == TCC_OK, "barrier: %s", tcc_last_error());
  if (tcc_comm_rank(comm) == 0) r = tcc_send(comm, f32(x, 8), 1, 7, NULL, &op);
  else r = tcc_recv(comm, f32(x, 8), 0, 7, NULL, &op);
  CHECK(wait_release(r, op) == TCC_OK, "send/recv: %s", tcc_last_error());
}

/* Rank 0 times out in an allreduce rank 1 never joins; rank 1 then aborts,
 * and only then rank 0 leaves (so rank 1's first failure is its abort, not
 * rank 0's exit). */
static void timeout_then_abort(tcc_comm_t *comm) {
  float x[8] = {0};
  tcc_op_t *op = NULL;
  if (tcc_comm_rank(comm) == 0) {
    tcc_op_opts_t opts = {.timeout_ms = 300};
    tcc_result_t r = tcc_allreduce(comm, f32(x, 8), f32(x, 8), TCC_SUM, &opts, &op);
    r = wait_release(r, op);
    CHECK(r == TCC_ERR_TIMEOUT, "allreduce alone gave %s", tcc_result_string(r));
    for (int i = 0; i < 3000 && !atomic_load(rank1_aborted); i++) usleep(10000);
  } else {
    usleep(getenv("TCC_TEST_SLOW") ? 3000000 : 1000000);
    tcc_comm_abort(comm);
    atomic_store(rank1_aborted, 1);
  }
}

/* ---- the checks ---------------------------------------------------------- */

/* Two files, one per rank, each well formed; their rank in ranks[i]. */
static int two_files(log_file_t *files, int *ranks, const char *what) {
  int n = read_logs(files);
  CHECK(n == 2, "%s: %d log files, expected one per rank", what, n);
  for (int i = 0; i < n && i < 2; i++) ranks[i] = check_format(&files[i]);
  return n;
}

static void test_info_shm(void) {
  const char *env[] = {"TCCOMM_DEBUG=info", "TCCOMM_DEBUG_FILE=", "TCCOMM_SHM_SMALL_BYTES=4096", NULL};
  char file_env[128];
  snprintf(file_env, sizeof file_env, "TCCOMM_DEBUG_FILE=%s/log.%%h.%%p", dir);
  env[1] = file_env;
  CHECK(scenario("auto", 5000, some_ops, env) == 0, "info shm: the group failed");
  log_file_t f[MAX_FILES];
  int ranks[2] = {-1, -1};
  int n = two_files(f, ranks, "info shm");
  for (int i = 0; i < n; i++) {
    const char *t = f[i].text;
    char want[256];
    snprintf(want, sizeof want, "log.%s.", host); /* %h expanded */
    CHECK(strncmp(f[i].name, want, strlen(want)) == 0, "file %s, expected %s<pid>", f[i].name, want);
    CHECK(ranks[i] == 0 || ranks[i] == 1, "%s: no rank", f[i].name);
    CHECK(count_lines(t, "[-] TCCOMM INFO tccomm version 0.1") == 1, "%s: version line:\n%s", f[i].name, t);
    snprintf(want, sizeof want, "[%d] TCCOMM INFO communicator '" NAME "': all 2 ranks on host %s share /dev/shm: shm",
             ranks[i], host);
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    CHECK(count_lines(t, "reductions up to 4096 bytes one-shot (TCCOMM_SHM_SMALL_BYTES)") == 1 &&
              count_lines(t, "524288-byte windows") == 1,
          "%s: thresholds:\n%s", f[i].name, t);
    snprintf(want, sizeof want, "communicator '" NAME "' created: rank %d of 2, transport shm, timeout 5000 ms",
             ranks[i]);
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    snprintf(want, sizeof want, "communicator '" NAME "' destroyed: rank %d of 2, 4 collectives issued", ranks[i]);
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    CHECK(count_lines(t, "TCCOMM TRACE") == 0 && count_lines(t, "TCCOMM WARN") == 0, "%s: TRACE/WARN at INFO:\n%s",
          f[i].name, t);
  }
  CHECK(ranks[0] != ranks[1], "both files of rank %d", ranks[0]);
  free_logs(f, n);
}

static void test_info_tcp(void) {
  char file_env[128];
  snprintf(file_env, sizeof file_env, "TCCOMM_DEBUG_FILE=%s/log.%%p", dir);
  const char *env[] = {"TCCOMM_DEBUG=INFO", file_env, NULL};
  /* chosen: every rank claims a host of its own */
  CHECK(scenario("auto-hosts", 5000, NULL, env) == 0, "info tcp: the group failed");
  log_file_t f[MAX_FILES];
  int ranks[2] = {-1, -1};
  int n = two_files(f, ranks, "info tcp");
  for (int i = 0; i < n; i++) {
    const char *t = f[i].text;
    CHECK(count_lines(t, "rank 1 is on another host (test-host-1; rank 0 is on test-host-0): tcp") == 1,
          "%s: transport reason:\n%s", f[i].name, t);
    CHECK(count_lines(t, "algorithms over tcp streams: small ops (and an all-to-all's small blocks) in one exchange, the "
                         "data with the descriptors; all-reduces up to 65536 bytes per rank's chunk with their "
                         "reduce-scatter in the descriptors' exchange; "
                         "larger ones direct exchange between every pair, reductions reduce-scatter + all-gather "
                         "pipelined in 1048576-byte segments") == 1,
          "%s: thresholds:\n%s", f[i].name, t);
    CHECK(count_lines(t, "created: rank") == 1 && count_lines(t, "transport tcp, timeout 5000 ms") == 1,
          "%s: creation:\n%s", f[i].name, t);
  }
  free_logs(f, n);
  /* forced by the caller, on one host */
  CHECK(scenario("tcp", 5000, NULL, env) == 0, "info tcp forced: the group failed");
  n = two_files(f, ranks, "info tcp forced");
  for (int i = 0; i < n; i++) {
    char want[256];
    snprintf(want, sizeof want, "transport tcp forced by the caller's config; all 2 ranks on host %s share /dev/shm",
             host);
    CHECK(count_lines(f[i].text, want) == 1, "%s: no '%s':\n%s", f[i].name, want, f[i].text);
  }
  free_logs(f, n);
}

static void test_trace(const char *spec) {
  char file_env[128];
  snprintf(file_env, sizeof file_env, "TCCOMM_DEBUG_FILE=%s/log.%%p", dir);
  const char *env[] = {"TCCOMM_DEBUG=Trace", file_env, "TCCOMM_SHM_SMALL_BYTES=4096", NULL};
  CHECK(scenario(spec, 5000, some_ops, env) == 0, "trace %s: the group failed", spec);
  const int shm = strcmp(spec, "shm") == 0;
  log_file_t f[MAX_FILES];
  int ranks[2] = {-1, -1};
  int n = two_files(f, ranks, spec);
  for (int i = 0; i < n; i++) {
    const char *t = f[i].text;
    char want[256];
    snprintf(want, sizeof want, "[%d] TCCOMM TRACE allreduce #1 on '" NAME "': float32 count 8 (32 bytes), host memory, "
             "executor host, algorithm %s", ranks[i], shm ? "spans one-shot reduction" : "streams one exchange (data with the descriptors)");
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    snprintf(want, sizeof want, "allreduce #2 on '" NAME "': float32 count 20003 (80012 bytes), host memory, "
             "executor host, algorithm %s",
             shm ? "spans pipelined reduce-scatter + all-gather"
                 : "streams reduce-scatter with the descriptors + all-gather");
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    snprintf(want, sizeof want, "broadcast #3 on '" NAME "': float32 count 8 (32 bytes), root 1, host memory, "
             "executor host, algorithm %s",
             shm ? "spans slot rings" : "streams one-sided (data with the descriptors; its senders do not wait)");
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    CHECK(count_lines(t, "TCCOMM TRACE barrier #4 on '" NAME "': uint8 count 0 (0 bytes)") == 1, "%s: barrier:\n%s",
          f[i].name, t);
    snprintf(want, sizeof want, ranks[i] == 0 ? "TRACE send on '" NAME "': 32 bytes, to peer 1 tag 7, host memory, "
                                                "executor host, algorithm %s p2p"
                                              : "TRACE recv on '" NAME "': 32 bytes, from peer 0 tag 7, host memory, "
                                                "executor host, algorithm %s p2p",
             shm ? "shm" : "tcp");
    CHECK(count_lines(t, want) == 1, "%s: no '%s':\n%s", f[i].name, want, t);
    CHECK(count_lines(t, "TCCOMM TRACE") == 5, "%s: %d TRACE lines, expected one per op:\n%s", f[i].name,
          count_lines(t, "TCCOMM TRACE"), t);
    CHECK(count_lines(t, "created: rank") == 1, "%s: TRACE includes INFO:\n%s", f[i].name, t);
  }
  free_logs(f, n);
}

static void test_warn(void) {
  char file_env[128];
  snprintf(file_env, sizeof file_env, "TCCOMM_DEBUG_FILE=%s/log.%%p", dir);
  const char *env[] = {"TCCOMM_DEBUG=WARN", file_env, NULL};
  log_file_t f[MAX_FILES];
  int ranks[2] = {-1, -1};
  /* a clean run: the files exist (opened once at setup) and stay empty */
  CHECK(scenario("shm", 5000, some_ops, env) == 0, "warn clean: the group failed");
  int n = two_files(f, ranks, "warn clean");
  for (int i = 0; i < n; i++) CHECK(f[i].text[0] == '\0', "%s: a clean run logged at WARN:\n%s", f[i].name, f[i].text);
  free_logs(f, n);

  for (int k = 0; k < 2; k++) {
    const char *spec = k ? "tcp" : "shm";
    CHECK(scenario(spec, 5000, timeout_then_abort, env) == 0, "warn %s: the group failed", spec);
    n = two_files(f, ranks, spec);
    for (int i = 0; i < n; i++) {
      const char *t = f[i].text;
      int lines = count_lines(t, "");
      CHECK(count_lines(t, "TCCOMM WARN") == lines && lines >= 1, "%s (%s): not only WARN lines:\n%s", f[i].name, spec, t);
      if (ranks[i] == 0)
        CHECK(count_lines(t, "[0] TCCOMM WARN communicator '" NAME "' failed (timed out): ") == 1 &&
                  count_lines(t, "allreduce") >= 1 && count_lines(t, "[op timeout 300 ms]") == 1,
              "%s (%s): no timeout warning:\n%s", f[i].name, spec, t);
      if (ranks[i] == 1)
        CHECK(count_lines(t, "[1] TCCOMM WARN communicator '" NAME "' failed (communicator aborted): communicator '" NAME
                             "' was aborted on rank 1") == 1,
              "%s (%s): no abort warning:\n%s", f[i].name, spec, t);
    }
    free_logs(f, n);
  }

  /* creation fails on every rank: shm forced across hosts */
  CHECK(scenario("shm-hosts", 5000, NULL, env) == 0, "warn create: the group failed");
  n = two_files(f, ranks, "warn create");
  for (int i = 0; i < n; i++) {
    const char *t = f[i].text;
    CHECK(count_lines(t, "TCCOMM WARN communicator '" NAME "' could not be created: ") == 1 &&
              count_lines(t, "different hosts") == 1 && count_lines(t, "") == 1,
          "%s: creation warning:\n%s", f[i].name, t);
  }
  free_logs(f, n);
}

static void test_version(void) {
  char file_env[128];
  snprintf(file_env, sizeof file_env, "TCCOMM_DEBUG_FILE=%s/log.%%p", dir);
  const char *env[] = {"TCCOMM_DEBUG=version", file_env, NULL};
  CHECK(scenario("shm", 5000, timeout_then_abort, env) == 0, "version: the group failed");
  log_file_t f[MAX_FILES];
  int ranks[2];
  int n = two_files(f, ranks, "version");
  for (int i = 0; i < n; i++)
    CHECK(count_lines(f[i].text, "[-] TCCOMM VERSION tccomm version 0.1 (") == 1 && count_lines(f[i].text, "") == 1,
          "%s: version only:\n%s", f[i].name, f[i].text);
  free_logs(f, n);
}

static void test_off_and_bad_settings(void) {
  char file_env[128];
  snprintf(file_env, sizeof file_env, "TCCOMM_DEBUG_FILE=%s/log.%%p", dir);
  log_file_t f[MAX_FILES];
  /* unset: not even a file, however much happens */
  const char *off[] = {"TCCOMM_DEBUG=", file_env, NULL};
  CHECK(scenario("shm", 5000, timeout_then_abort, off) == 0, "off: the group failed");
  int n = read_logs(f);
  CHECK(n == 0, "off: %d log files", n);
  free_logs(f, n);
  char *err = read_stderr();
  CHECK(!strstr(err, "TCCOMM"), "off: stderr has log lines:\n%s", err);
  free(err);

  /* garbage: off, and one warning per process saying what is accepted */
  const char *bad[] = {"TCCOMM_DEBUG=loud", file_env, NULL};
  CHECK(scenario("shm", 5000, some_ops, bad) == 0, "garbage: the group failed");
  n = read_logs(f);
  CHECK(n == 0, "garbage: %d log files", n);
  free_logs(f, n);
  err = read_stderr();
  CHECK(count_lines(err, "TCCOMM WARN TCCOMM_DEBUG='loud' is not one of VERSION, WARN, INFO, TRACE (any case): "
                         "debug logging is off") == 2 && count_lines(err, "TCCOMM") == 2,
        "garbage: stderr:\n%s", err);
  free(err);

  /* a file that cannot be opened: the lines go to stderr */
  const char *nofile[] = {"TCCOMM_DEBUG=INFO", "TCCOMM_DEBUG_FILE=/nonexistent-tccomm-dir/log.%p", NULL};
  CHECK(scenario("shm", 5000, NULL, nofile) == 0, "no file: the group failed");
  err = read_stderr();
  CHECK(count_lines(err, "TCCOMM WARN cannot open TCCOMM_DEBUG_FILE '/nonexistent-tccomm-dir/log.") == 2 &&
            count_lines(err, "No such file or directory): logging to stderr") == 2,
        "no file: stderr:\n%s", err);
  CHECK(count_lines(err, "TCCOMM INFO communicator '" NAME "' created: rank") == 2, "no file: INFO not on stderr:\n%s",
        err);
  free(err);
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  gethostname(host, sizeof host);
  host[sizeof host - 1] = '\0';
  snprintf(dir, sizeof dir, "/tmp/tccomm-log-test-XXXXXX");
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }
  for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) big[i] = 1;
  rank1_aborted = mmap(NULL, sizeof *rank1_aborted, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  printf("info shm\n");
  test_info_shm();
  printf("info tcp\n");
  test_info_tcp();
  printf("trace shm\n");
  test_trace("shm");
  printf("trace tcp\n");
  test_trace("tcp");
  printf("warn\n");
  test_warn();
  printf("version\n");
  test_version();
  printf("off, garbage, unopenable file\n");
  test_off_and_bad_settings();
  clear_dir();
  rmdir(dir);
  CHECK_DONE();
}
