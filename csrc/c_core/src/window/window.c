/*
 * window.c - one-sided RMA windows over shared memory (see tccomm.h).
 *
 * One segment per window, created by rank 0 under a name derived from 16
 * random bytes, mode 0600, and unlinked as soon as every rank has mapped it
 * (as the transport's own segment in shm_setup.c; shm_segment.h). Rank 0 holds
 * the lock it took at creation until then, like any creator, so the
 * reaper of abandoned segments (shm_reap.c) leaves a window that is being
 * set up alone, however long a rank takes to come, and the other ranks
 * notice when rank 0 dies meanwhile. Windows need no liveness lock after
 * that: a wait for a signal is bounded by its timeout. Layout,
 * identical on every rank because each computes it from the same
 * allgathered sizes; rank 0 also writes it into the header, and the other
 * ranks accept the segment only when that matches their own:
 *
 *   header (4 KiB) | per-rank control: futex word, sleepers, n signal counters
 *                  | per-rank data buffers, each page aligned
 *
 * Rank d's counter for src counts the signals src sent to d; d remembers how
 * many it consumed, so signals never get lost or merged.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/idle_wait.h"
#include "window/window.h"
#include "core/copy.h"

#define WIN_PAGE 4096

_Static_assert(sizeof(win_header_t) <= WIN_HEADER_BYTES, "the header must fit the segment's first page");

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static win_ctrl_t *ctrl_of(const tcc_window_t *win, int r) {
  return (win_ctrl_t *)(win->base + WIN_HEADER_BYTES + (size_t)r * win->ctrl_stride);
}

/* Waits for a collective of `comm` just issued (r: the result of issuing it). */
static tcc_result_t wait_coll(tcc_result_t r, tcc_op_t *op, tcc_err_t *err) {
  if (r != TCC_OK) return tcc__err_set(err, r, "%s", tcc_last_error());
  r = tcc_op_wait(op, -1);
  if (r != TCC_OK) tcc__err_set(err, r, "%s", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}

/* Every rank's hello, in rank order, through an allgather of the comm. */
static tcc_result_t exchange_hellos(tcc_comm_t *comm, size_t bytes, int64_t timeout_ms, win_hello_t *all,
                                    tcc_err_t *err) {
  win_hello_t mine;
  memset(&mine, 0, sizeof mine);
  mine.bytes = bytes;
  if (comm->rank == 0 && tcc__random_bytes(mine.token, sizeof mine.token) != TCC_OK)
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm window on '%s': no random bytes for the segment name",
                       comm->name);
  const int n = comm->size;
  tcc_buf_t *recvs = calloc((size_t)n, sizeof *recvs);
  if (!recvs) return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  for (int r = 0; r < n; r++) recvs[r] = (tcc_buf_t){&all[r], sizeof mine, TCC_UINT8, -1, NULL};
  tcc_op_opts_t opts = {.timeout_ms = timeout_ms, .premul_factor = 1.0};
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allgather(comm, (tcc_buf_t){&mine, sizeof mine, TCC_UINT8, -1, NULL}, recvs, &opts, &op);
  free(recvs);
  return wait_coll(r, op, err);
}

static void window_free(tcc_window_t *win) {
  if (!win) return;
  if (win->base) munmap(win->base, win->total);
  free(win->off);
  free(win->bytes);
  free(win->consumed);
  free(win);
}

void tcc__window_layout(tcc_window_t *win, const win_hello_t *hellos) {
  const int n = win->size;
  win->ctrl_stride = align_up(sizeof(win_ctrl_t) + (size_t)n * sizeof(atomic_ullong), 64);
  size_t at = align_up(WIN_HEADER_BYTES + (size_t)n * win->ctrl_stride, WIN_PAGE);
  for (int r = 0; r < n; r++) {
    win->off[r] = at;
    win->bytes[r] = (size_t)hellos[r].bytes;
    at += align_up(win->bytes[r], WIN_PAGE);
  }
  win->total = at;
}

static void write_header(const tcc_window_t *win, void *base) {
  win_header_t *h = base;
  h->size = (uint32_t)win->size;
  h->ctrl_stride = win->ctrl_stride;
  h->data_off = win->off[0];
}

tcc_result_t tcc__window_check_header(const tcc_window_t *win, const win_header_t *h, size_t mapped, const char *who,
                                     tcc_err_t *err) {
  const struct {
    const char *what;
    uint64_t got, want;
  } fields[] = {
      {"size", h->size, (uint64_t)win->size},
      {"ctrl_stride", h->ctrl_stride, win->ctrl_stride},
      {"data_off", h->data_off, win->off[0]},
      {"total", h->seg.total_bytes, win->total},
      {"segment size", mapped, win->total},
  };
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    if (fields[i].got == fields[i].want) continue;
    return tcc__err_set(err, TCC_ERR_INVALID,
                       "%s: the window segment's header is inconsistent: %s is %llu, expected %llu: not trusted", who,
                       fields[i].what, (unsigned long long)fields[i].got, (unsigned long long)fields[i].want);
  }
  return TCC_OK;
}

/* The other ranks: rank 0's segment, accepted only when its header and size
 * match the layout this rank computed from the same allgathered sizes. */
static tcc_result_t open_segment(const tcc_window_t *win, const tcc_segment_id_t *id, int64_t deadline,
                                 const char *who, void **base, int *fd, tcc_err_t *err) {
  size_t mapped = 0;
  tcc_result_t r = tcc__segment_open(id, win->rank, win->size, deadline, who, base, &mapped, fd, err);
  if (r != TCC_OK) return r;
  r = tcc__window_check_header(win, *base, mapped, who, err);
  if (r != TCC_OK) {
    munmap(*base, mapped);
    *base = NULL;
    tcc__fd_close(*fd);
    *fd = -1;
  }
  return r;
}

tcc_result_t tcc__window_check_hellos(const tcc_window_t *win, const win_hello_t *hellos, tcc_err_t *err) {
  for (int r = 0; r < win->size; r++) {
    if (hellos[r].bytes == (uint64_t)TCC_WINDOW_DECLINE)
      return tcc__err_set(err, TCC_ERR_INVALID,
                         "tccomm window on '%s' (rank %d): rank %d could not register its buffer (its own error "
                         "says why)", win->name, win->rank, r);
    if (hellos[r].bytes > WIN_MAX_BYTES)
      return tcc__err_set(err, TCC_ERR_INVALID, "tccomm window on '%s' (rank %d): rank %d asked for %llu bytes, more "
                         "than the %llu a window buffer may have", win->name, win->rank, r,
                         (unsigned long long)hellos[r].bytes, (unsigned long long)WIN_MAX_BYTES);
  }
  return TCC_OK;
}

tcc_result_t tcc_window_create(tcc_comm_t *comm, size_t bytes, int64_t timeout_ms, tcc_window_t **out) {
  tcc_err_t err = {TCC_OK, ""};
  tcc_window_t *win = NULL;
  win_hello_t *hellos = NULL;
  int seg_fd = -1; /* the segment's, until every rank mapped it */
  if (!comm || !out) {
    tcc__err_set(&err, TCC_ERR_INVALID, "tccomm window: no communicator or output handle given");
    goto fail;
  }
  if (!(comm->ops->caps & TCC__TRANSPORT_SHARES_MEMORY)) {
    tcc__err_set(&err, TCC_ERR_UNSUPPORTED,
                "tccomm window on '%s' (rank %d): windows need the shared-memory transport (every rank on one "
                "host), but this communicator uses %s",
                comm->name, comm->rank, comm->ops->name);
    goto fail;
  }
  if (timeout_ms <= 0) timeout_ms = atomic_load(&comm->timeout_ms);
  const int n = comm->size;
  win = calloc(1, sizeof *win);
  hellos = calloc((size_t)n, sizeof *hellos);
  if (win) {
    win->off = calloc((size_t)n, sizeof *win->off);
    win->bytes = calloc((size_t)n, sizeof *win->bytes);
    win->consumed = calloc((size_t)n, sizeof *win->consumed);
  }
  if (!win || !hellos || !win->off || !win->bytes || !win->consumed) {
    tcc__err_set(&err, TCC_ERR_SYSTEM, "tccomm: out of memory");
    goto fail;
  }
  win->rank = comm->rank;
  win->size = n;
  win->timeout_ms = timeout_ms;
  snprintf(win->name, sizeof win->name, "%s", comm->name);

  const int64_t deadline = tcc__deadline_after_ms(timeout_ms);
  if (exchange_hellos(comm, bytes, timeout_ms, hellos, &err) != TCC_OK) goto fail;
  /* Checked after the exchange, on every rank alike: one rank's bad size
   * fails the creation everywhere at once instead of leaving peers waiting. */
  if (tcc__window_check_hellos(win, hellos, &err) != TCC_OK) goto fail;
  tcc__window_layout(win, hellos);
  tcc_segment_id_t id;
  char who[160];
  tcc__segment_id("win-", hellos[0].token, &id);
  snprintf(who, sizeof who, "tccomm window on '%s' (rank %d)", win->name, win->rank);
  void *base = NULL;
  if (win->rank == 0) {
    if (tcc__segment_create(&id, win->total, n, who, &base, &seg_fd, &err) != TCC_OK) goto fail;
    write_header(win, base);
    tcc__segment_publish(base); /* buffers and counters start zeroed: nothing else to lay out */
  } else if (open_segment(win, &id, deadline, who, &base, &seg_fd, &err) != TCC_OK) {
    goto fail;
  }
  win->base = base;
  int got = 0;
  tcc_result_t r = tcc__segment_attach(base, seg_fd, &id, win->rank, n, deadline, who, &got, &err);
  if (r == TCC_ERR_TIMEOUT)
    tcc__err_set(&err, TCC_ERR_TIMEOUT, "%s: timed out after %lld ms: only %d of %d ranks mapped it", who,
                (long long)timeout_ms, got, n);
  if (r != TCC_OK) goto fail;
  /* The name is gone: rank 0's lock has done its job. */
  tcc__fd_close(seg_fd);
  free(hellos);
  *out = win;
  return TCC_OK;

fail:
  if (seg_fd >= 0) tcc__fd_close(seg_fd);
  window_free(win);
  free(hellos);
  return tcc__fail_with(&err, err.code != TCC_OK ? err.code : TCC_ERR_SYSTEM);
}

int tcc_window_rank(const tcc_window_t *win) { return win->rank; }
int tcc_window_size(const tcc_window_t *win) { return win->size; }

void *tcc_window_buffer(tcc_window_t *win, int rank, size_t *bytes) {
  if (rank < 0 || rank >= win->size) {
    if (bytes) *bytes = 0;
    return NULL;
  }
  if (bytes) *bytes = win->bytes[rank];
  return win->base + win->off[rank];
}

static tcc_result_t check_peer(tcc_window_t *win, const char *what, const char *role, int peer) {
  if (peer >= 0 && peer < win->size) return TCC_OK;
  return tcc__fail(TCC_ERR_INVALID, "tccomm window %s on '%s' (rank %d): %s rank %d is out of range [0, %d)",
                  what, win->name, win->rank, role, peer, win->size);
}

tcc_result_t tcc_window_put(tcc_window_t *win, const void *src, size_t bytes, int dst_rank, size_t offset) {
  tcc_result_t r = check_peer(win, "put", "destination", dst_rank);
  if (r != TCC_OK) return r;
  const size_t cap = win->bytes[dst_rank];
  /* Written so that offset + bytes cannot overflow. */
  if (offset > cap || bytes > cap - offset)
    return tcc__fail(TCC_ERR_INVALID,
                    "tccomm window put on '%s' (rank %d): %zu bytes at offset %zu do not fit the %zu-byte buffer "
                    "of rank %d",
                    win->name, win->rank, bytes, offset, cap, dst_rank);
  if (bytes == 0) return TCC_OK;
  if (!src) return tcc__fail(TCC_ERR_INVALID, "tccomm window put on '%s': no source buffer", win->name);
  tcc__copy(win->base + win->off[dst_rank] + offset, src, bytes);
  return TCC_OK;
}

tcc_result_t tcc_window_signal(tcc_window_t *win, int dst_rank) {
  tcc_result_t r = check_peer(win, "signal", "destination", dst_rank);
  if (r != TCC_OK) return r;
  win_ctrl_t *c = ctrl_of(win, dst_rank);
  /* seq_cst: orders the puts before it (release) and the sleepers check. */
  atomic_fetch_add(&c->sig[win->rank], 1);
  if (atomic_load(&c->sleepers) > 0) {
    atomic_fetch_add(&c->futex, 1);
    tcc__futex_wake_all(&c->futex);
  }
  return TCC_OK;
}

typedef struct signal_wait {
  const atomic_ullong *sig;
  uint64_t want;
} signal_wait_t;

static bool signal_arrived(void *arg) {
  const signal_wait_t *s = arg;
  return atomic_load(s->sig) >= s->want;
}

tcc_result_t tcc_window_wait_signal(tcc_window_t *win, int peer, int64_t timeout_ms) {
  tcc_result_t r = check_peer(win, "wait_signal", "source", peer);
  if (r != TCC_OK) return r;
  if (timeout_ms <= 0) timeout_ms = win->timeout_ms;
  win_ctrl_t *c = ctrl_of(win, win->rank);
  signal_wait_t s = {&c->sig[peer], win->consumed[peer] + 1};
  const tcc__idle_wait_t w = {.ready = signal_arrived, .arg = &s, .yields = 64, .max_nap_ns = 50 * 1000000LL,
                              .deadline_ns = tcc__deadline_after_ms(timeout_ms), .word = &c->futex,
                              .sleepers = &c->sleepers};
  if (tcc__idle_wait(&w) != TCC_OK)
    return tcc__fail(TCC_ERR_TIMEOUT,
                    "tccomm window wait_signal on '%s' (rank %d): timed out after %lld ms waiting for signal #%llu "
                    "from rank %d",
                    win->name, win->rank, (long long)timeout_ms, (unsigned long long)s.want, peer);
  win->consumed[peer] = s.want;
  return TCC_OK;
}

void tcc_window_destroy(tcc_window_t *win) { window_free(win); }
