/*
 * shm.c - the shared-memory transport: segment setup, the stage barrier,
 * and the point-to-point rings. Collective algorithms are in shm_coll.c;
 * the layout and the stage rule are described in shm.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mutation.h"
#include "shm.h"

#define HEADER_BYTES TCC_SEGMENT_HEAD_BYTES
#define DEFAULT_WINDOW (512u * 1024u)
#define MAX_WINDOW (64u << 20)
#define DEFAULT_SMALL (32u * 1024u)

_Static_assert(sizeof(shm_header_t) <= HEADER_BYTES, "the header must fit the segment's first page");

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static size_t env_bytes(const char *name, size_t dflt, size_t lo, size_t hi) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != 0 || v < lo || v > hi) return dflt;
  return (size_t)v;
}

/* ---- layout ----------------------------------------------------------- */

static size_t ring_stride(const shm_header_t *h) {
  return align_up(sizeof(shm_ring_t) + h->ring_bytes, 4096);
}

static shm_ring_t *ring_of(shm_state_t *st, int from, int to) {
  size_t idx = (size_t)from * st->hdr->size + (size_t)to;
  return (shm_ring_t *)(st->base + st->hdr->ring_off + idx * ring_stride(st->hdr));
}

/* Each stage gives every rank at least a cache line of the window. */
static size_t min_window(int n) { return align_up((size_t)n * TCC_CACHELINE, 4096); }

/* Rank 0's choice of the tunables: its environment alone decides, and the
 * header carries the result to every other rank. */
static void choose_sizes(int n, uint64_t *window, uint64_t *small) {
  size_t w = align_up(env_bytes("TCCOMM_SHM_WINDOW_BYTES", DEFAULT_WINDOW, 4096, MAX_WINDOW), 4096);
  if (w < min_window(n)) w = min_window(n);
  size_t s = env_bytes("TCCOMM_SHM_SMALL_BYTES", DEFAULT_SMALL, 0, w);
  *window = w;
  *small = s < w ? s : w;
}

/* Everything else follows from the group size and the window: rank 0 lays
 * the segment out with it, the other ranks recompute it to check the
 * header. With n <= TCC_MAX_RANKS and window <= MAX_WINDOW nothing here
 * comes near overflow. */
static void layout(shm_header_t *h, int n, uint64_t window) {
  h->size = (uint32_t)n;
  h->window = window;
  h->ring_bytes = n <= 4 ? (1u << 20) : align_up((4u << 20) / (size_t)n, 4096);
  if (h->ring_bytes < (64u << 10)) h->ring_bytes = 64u << 10;
  h->desc_stride = align_up(tcc_coll_desc_bytes(TCC_COLL_ALLTOALL, n), TCC_CACHELINE);
  h->ctrl_off = HEADER_BYTES;
  h->desc_off = align_up(h->ctrl_off + (size_t)n * sizeof(shm_rank_ctrl_t), TCC_CACHELINE);
  h->data_off = align_up(h->desc_off + (size_t)n * 2 * h->desc_stride, 4096);
  h->ring_off = h->data_off + (size_t)n * 2 * 2 * h->window;
  h->seg.total_bytes = h->ring_off + (size_t)n * (size_t)n * ring_stride(h);
}

/* ---- setup ------------------------------------------------------------ */

/* Rank 0: the segment, laid out for this group, then published. *fd: the
 * creating descriptor, with rank 0's lock. */
static tcc_result_t create_segment(tcc_comm_t *comm, const tcc_segment_id_t *id, const char *who, shm_state_t *st,
                                   int *fd, tcc_err_t *err) {
  shm_header_t h;
  memset(&h, 0, sizeof h);
  uint64_t window, small;
  choose_sizes(comm->size, &window, &small);
  layout(&h, comm->size, window);
  void *base;
  tcc_result_t r = tcc_segment_create(id, h.seg.total_bytes, comm->size, who, &base, fd, err);
  if (r != TCC_OK) return r;
  /* Fresh tmpfs pages are zero: counters, rings and doorbells start at 0. */
  shm_header_t *hdr = base;
  hdr->size = h.size;
  hdr->window = h.window;
  hdr->small_bytes = small;
  hdr->ring_bytes = h.ring_bytes;
  hdr->desc_stride = h.desc_stride;
  hdr->ctrl_off = h.ctrl_off;
  hdr->desc_off = h.desc_off;
  hdr->data_off = h.data_off;
  hdr->ring_off = h.ring_off;
  tcc_segment_publish(base);
  st->base = base;
  st->bytes = h.seg.total_bytes;
  st->hdr = hdr;
  return TCC_OK;
}

__attribute__((format(printf, 3, 4)))
static tcc_result_t bad_header(const char *who, tcc_err_t *err, const char *fmt, ...) {
  char why[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  return tcc_err_set(err, TCC_ERR_INVALID, "%s: the shared-memory segment's header is inconsistent: %s: not trusted",
                     who, why);
}

/* The other ranks: rank 0's header against the layout recomputed from its
 * published tunables and this group's size, field by field. `bytes`: the
 * verified size of the mapping, of which only the first page is read. */
tcc_result_t tcc_shm_check_header(const shm_header_t *h, int n, size_t bytes, const char *who, tcc_err_t *err) {
  if (h->size != (uint32_t)n) return bad_header(who, err, "it is laid out for %u ranks, this group has %d", h->size, n);
  if (h->window < min_window(n) || h->window > MAX_WINDOW || h->window % 4096 != 0)
    return bad_header(who, err, "window of %llu bytes is not a multiple of 4096 in [%zu, %u]",
                      (unsigned long long)h->window, min_window(n), MAX_WINDOW);
  if (h->small_bytes > h->window)
    return bad_header(who, err, "small-message threshold of %llu bytes exceeds the %llu-byte window",
                      (unsigned long long)h->small_bytes, (unsigned long long)h->window);
  shm_header_t want;
  memset(&want, 0, sizeof want);
  layout(&want, n, h->window);
  const struct {
    const char *what;
    uint64_t got, want;
  } fields[] = {
      {"ring_bytes", h->ring_bytes, want.ring_bytes}, {"desc_stride", h->desc_stride, want.desc_stride},
      {"ctrl_off", h->ctrl_off, want.ctrl_off},       {"desc_off", h->desc_off, want.desc_off},
      {"data_off", h->data_off, want.data_off},       {"ring_off", h->ring_off, want.ring_off},
      {"total", h->seg.total_bytes, want.seg.total_bytes}, {"segment size", bytes, want.seg.total_bytes},
  };
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    if (fields[i].got != fields[i].want)
      return bad_header(who, err, "%s is %llu, expected %llu for %d ranks and a %llu-byte window", fields[i].what,
                        (unsigned long long)fields[i].got, (unsigned long long)fields[i].want, n,
                        (unsigned long long)h->window);
  }
  return TCC_OK;
}

/* The other ranks: rank 0's segment, verified, mapped at st->base. *fd:
 * the verified descriptor. */
static tcc_result_t open_segment(tcc_comm_t *comm, const tcc_segment_id_t *id, int64_t deadline, const char *who,
                                 shm_state_t *st, int *fd, tcc_err_t *err) {
  void *base = NULL;
  tcc_result_t r = tcc_segment_open(id, comm->rank, comm->size, deadline, who, &base, &st->bytes, fd, err);
  if (r != TCC_OK) return r;
  r = tcc_shm_check_header(base, comm->size, st->bytes, who, err);
  if (r != TCC_OK) {
    munmap(base, st->bytes);
    tcc_fd_close(*fd);
    return r;
  }
  st->base = base;
  st->hdr = base;
  return TCC_OK;
}

static const tcc_transport_ops_t shm_ops;
static void shm_destroy(tcc_comm_t *comm);

tcc_result_t tcc_shm_setup(tcc_comm_t *comm, const tcc_blob_t *blobs, tcc_err_t *err) {
  /* What killed processes left behind goes first (shm_reap.c). */
  tcc_shm_reap_once();
  shm_state_t *st = calloc(1, sizeof *st);
  if (!st) return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  tcc_segment_id_t id;
  char who[160];
  tcc_segment_id("", blobs[0].token, &id);
  snprintf(who, sizeof who, "tccomm '%s' (rank %d)", comm->name, comm->rank);
  const int64_t deadline = tcc_deadline_after_ms(atomic_load(&comm->timeout_ms));
  int fd = -1;
  tcc_result_t r = comm->rank == 0 ? create_segment(comm, &id, who, st, &fd, err)
                                   : open_segment(comm, &id, deadline, who, st, &fd, err);
  if (r != TCC_OK) {
    free(st);
    return r;
  }
  /* The descriptor becomes the liveness lock's; stop closes it, and must
   * run while the segment is still mapped. Rank 0 removes the name before
   * its lock goes. */
  if (tcc_shm_liveness_start(comm, st, fd, err) != TCC_OK) {
    if (comm->rank == 0) shm_unlink(id.name);
    tcc_shm_liveness_stop(comm, st);
    munmap(st->base, st->bytes);
    free(st);
    return err->code;
  }
  int n = comm->size, got = 0;
  r = tcc_segment_attach(st->base, st->lock_fd, &id, comm->rank, n, deadline, who, &got, err);
  if (r != TCC_OK) {
    tcc_shm_liveness_stop(comm, st);
    munmap(st->base, st->bytes);
    free(st);
    if (r != TCC_ERR_TIMEOUT) return r;
    return tcc_err_set(err, TCC_ERR_TIMEOUT,
                       "%s: timed out after %lld ms: only %d of %d ranks attached to the shared-memory segment",
                       who, (long long)atomic_load(&comm->timeout_ms), got, n);
  }
  st->srcs = calloc((size_t)n, sizeof *st->srcs);
  st->descs = calloc((size_t)n, sizeof *st->descs);
  st->pieces = calloc((size_t)n, sizeof *st->pieces);
  st->reads = calloc((size_t)n, sizeof *st->reads);
  st->part_src = calloc((size_t)n, sizeof *st->part_src);
  st->part_out = calloc((size_t)n, sizeof *st->part_out);
  st->part_len = calloc((size_t)n, sizeof *st->part_len);
  if (!st->srcs || !st->descs || !st->pieces || !st->reads || !st->part_src || !st->part_out ||
      !st->part_len) {
    comm->transport_state = st;
    shm_destroy(comm);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  }
  /* Rank 0's values, checked: never this rank's own environment. */
  st->window = st->hdr->window;
  st->small_bytes = st->hdr->small_bytes;
  comm->transport_state = st;
  comm->ops = &shm_ops;
  return TCC_OK;
}

/* ---- barrier ---------------------------------------------------------- */

static int first_missing(shm_state_t *st, int n, int from, uint64_t stage) {
  for (int j = from; j < n; j++)
    if (atomic_load_explicit(&shm_ctrl(st, j)->arrive, memory_order_acquire) < stage) return j;
  return n;
}

/* The op's timeout is not known here (it may be a per-op one): the engine
 * adds it to the message. */
static tcc_result_t barrier_timeout(tcc_comm_t *comm, shm_state_t *st, const char *what, uint64_t seq,
                                    uint64_t stage, tcc_err_t *err) {
  char missing[256] = "";
  size_t len = 0;
  for (int j = 0; j < comm->size && len < sizeof missing - 16; j++) {
    if (atomic_load(&shm_ctrl(st, j)->arrive) < stage)
      len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%d", len ? ", " : "", j);
  }
  return tcc_err_set(err, TCC_ERR_TIMEOUT,
                     "tccomm %s #%llu on '%s' (rank %d): timed out waiting for rank(s) %s "
                     "(they did not call it, or are stuck in an earlier operation)",
                     what, (unsigned long long)seq, comm->name, comm->rank, missing);
}

tcc_result_t tcc_shm_barrier(tcc_comm_t *comm, shm_state_t *st, int64_t deadline_ns, const char *what,
                             uint64_t seq, tcc_err_t *err) {
  int n = comm->size;
  if (TCC_MUTANT(BARRIER_SKIP_PEER) && strcmp(what, "barrier") == 0) n--; /* MUTATION SITE */
  const uint64_t stage = ++st->stage;
  shm_header_t *h = st->hdr;
  atomic_store(&shm_ctrl(st, comm->rank)->arrive, stage);
  if (atomic_load(&h->barrier_sleepers) > 0) {
    atomic_fetch_add(&h->barrier_futex, 1);
    tcc_futex_wake_all(&h->barrier_futex);
  }
  int j = first_missing(st, n, 0, stage);
  for (int spin = 0; j < n && spin < comm->spin_iters; spin++) {
    tcc_cpu_relax();
    j = first_missing(st, n, j, stage);
  }
  for (int yields = 0; j < n; yields++) {
    if (atomic_load(&comm->aborted)) {
      pthread_mutex_lock(&comm->fail_lock);
      tcc_err_set(err, TCC_ERR_ABORTED, "tccomm %s #%llu on '%s' (rank %d) interrupted: %s", what,
                  (unsigned long long)seq, comm->name, comm->rank, comm->fail_msg);
      pthread_mutex_unlock(&comm->fail_lock);
      return TCC_ERR_ABORTED;
    }
    int64_t now = tcc_now_ns();
    if (now > deadline_ns) {
      /* Leave the stage counter as is: the communicator is failed anyway. */
      return barrier_timeout(comm, st, what, seq, stage, err);
    }
    for (int k = j; k < n; k++) {
      if (atomic_load_explicit(&shm_ctrl(st, k)->arrive, memory_order_acquire) >= stage) continue;
      tcc_result_t gone = tcc_shm_peer_check(comm, st, k, false, what, err);
      if (gone != TCC_OK) return gone;
    }
    if (yields < 64) {
      sched_yield();
    } else {
      atomic_fetch_add(&h->barrier_sleepers, 1);
      unsigned v = atomic_load(&h->barrier_futex);
      if (first_missing(st, n, j, stage) < n) {
        int64_t nap = deadline_ns - now;
        if (nap > 20 * 1000000LL) nap = 20 * 1000000LL;
        tcc_futex_wait(&h->barrier_futex, v, nap);
      }
      atomic_fetch_sub(&h->barrier_sleepers, 1);
    }
    j = first_missing(st, n, j, stage);
  }
  return TCC_OK;
}

/* ---- point-to-point rings --------------------------------------------- */

static void ring_doorbell(shm_state_t *st, int rank) {
  shm_rank_ctrl_t *c = shm_ctrl(st, rank);
  if (atomic_load(&c->doorbell_sleeping)) {
    atomic_fetch_add(&c->doorbell, 1);
    tcc_futex_wake_all(&c->doorbell);
  }
}

static ssize_t shm_p2p_write(tcc_comm_t *comm, int peer, const void *buf, size_t len, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  /* Bytes for a peer that is gone would never be read. */
  if (tcc_shm_peer_check(comm, st, peer, false, "point-to-point stream", err) != TCC_OK) return -1;
  shm_ring_t *ring = ring_of(st, comm->rank, peer);
  const size_t cap = st->hdr->ring_bytes;
  uint64_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_acquire);
  size_t space = cap - (size_t)(head - tail);
  size_t n = len < space ? len : space;
  if (n == 0) return 0;
  size_t at = (size_t)(head % cap);
  size_t first = n < cap - at ? n : cap - at;
  memcpy(ring->data + at, buf, first);
  memcpy(ring->data, (const char *)buf + first, n - first);
  atomic_store_explicit(&ring->head, head + n, memory_order_seq_cst);
  ring_doorbell(st, peer);
  return (ssize_t)n;
}

static ssize_t shm_p2p_read(tcc_comm_t *comm, int peer, void *buf, size_t len, tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  shm_ring_t *ring = ring_of(st, peer, comm->rank);
  const size_t cap = st->hdr->ring_bytes;
  uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  uint64_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
  size_t avail = (size_t)(head - tail);
  size_t n = len < avail ? len : avail;
  if (n == 0) {
    /* What a peer wrote before it went is still read; after that, nothing
     * more can come. The head is read again after the check: bytes written
     * just before the peer went must not be lost. */
    if (tcc_shm_peer_check(comm, st, peer, false, "point-to-point stream", err) == TCC_OK) return 0;
    if (atomic_load_explicit(&ring->head, memory_order_acquire) != head) {
      err->code = TCC_OK;
      err->msg[0] = 0;
      return 0;
    }
    return -1;
  }
  size_t at = (size_t)(tail % cap);
  size_t first = n < cap - at ? n : cap - at;
  memcpy(buf, ring->data + at, first);
  memcpy((char *)buf + first, ring->data, n - first);
  atomic_store_explicit(&ring->tail, tail + n, memory_order_seq_cst);
  ring_doorbell(st, peer); /* the writer may be waiting for space */
  return (ssize_t)n;
}

/* True when some ring can move bytes for us right now. */
static int p2p_ready(tcc_comm_t *comm, shm_state_t *st, const bool *want_write) {
  for (int p = 0; p < comm->size; p++) {
    if (p == comm->rank) continue;
    shm_ring_t *in = ring_of(st, p, comm->rank);
    if (atomic_load(&in->head) != atomic_load(&in->tail)) return 1;
    if (want_write[p]) {
      shm_ring_t *out = ring_of(st, comm->rank, p);
      if (atomic_load(&out->head) - atomic_load(&out->tail) < st->hdr->ring_bytes) return 1;
    }
  }
  return 0;
}

static void shm_p2p_wait(tcc_comm_t *comm, const bool *want_write, int64_t max_ns) {
  shm_state_t *st = shm_of(comm);
  shm_rank_ctrl_t *me = shm_ctrl(st, comm->rank);
  atomic_store(&me->doorbell_sleeping, 1);
  unsigned v = atomic_load(&me->doorbell);
  if (!p2p_ready(comm, st, want_write) && !atomic_load(&comm->aborted))
    tcc_futex_wait(&me->doorbell, v, max_ns);
  atomic_store(&me->doorbell_sleeping, 0);
}

static void shm_p2p_notify(tcc_comm_t *comm) {
  shm_state_t *st = shm_of(comm);
  if (!st) return;
  shm_rank_ctrl_t *me = shm_ctrl(st, comm->rank);
  atomic_fetch_add(&me->doorbell, 1);
  tcc_futex_wake_all(&me->doorbell);
}

static void shm_destroy(tcc_comm_t *comm) {
  shm_state_t *st = shm_of(comm);
  if (!st) return;
  tcc_shm_liveness_stop(comm, st);
  munmap(st->base, st->bytes);
  free(st->srcs);
  free(st->descs);
  free(st->pieces);
  free(st->reads);
  free(st->part_src);
  free(st->part_out);
  free(st->part_len);
  free(st);
  comm->transport_state = NULL;
}

static const tcc_transport_ops_t shm_ops = {
    .name = "shm",
    .run_collective = tcc_shm_run_collective,
    .p2p_write = shm_p2p_write,
    .p2p_read = shm_p2p_read,
    .p2p_wait = shm_p2p_wait,
    .p2p_notify = shm_p2p_notify,
    .destroy = shm_destroy,
};
