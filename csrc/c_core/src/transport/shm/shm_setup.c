/*
 * shm_setup.c - the shared-memory transport's segment: its layout, setup
 * and teardown, and the transport's table. The layout is described in
 * shm.h; the stage barrier is in shm_spans.c, the rings in shm_p2p.c.
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

#include "core/log.h"
#include "core/mutation.h"
#include "transport/shm/shm.h"

#define HEADER_BYTES TCC_SEGMENT_HEAD_BYTES
#define DEFAULT_WINDOW (512u * 1024u)
#define MAX_WINDOW (64u << 20)
#define DEFAULT_SMALL (32u * 1024u)
/* Below this, staging one window costs less than the second barrier and
 * the system calls of single-copy reads (csrc/c_core/tests/bench_sizes.c:
 * at 2 ranks on 2 CPUs an all_gather of 64 KiB takes 3.6 us single-copy
 * from 16 KiB streams, 7.0 us staged). When the group has more ranks than
 * CPUs, that barrier and the system calls often wait for a time slice, and
 * staging was the faster at every size measured, on hosts where it is not
 * with CPUs of their own (4 ranks on 2 CPUs, through torch: all_to_all
 * 128 KiB-16 MiB 0.47-1.18 of Open MPI's speed single-copy, 0.94-1.59
 * staged; broadcast 2-16 MiB 1.03-1.61 against 2.45-4.74; bench/README,
 * "Single copy when ranks share CPUs"): there data moves single-copy only
 * when TCCOMM_SHM_DIRECT_BYTES asks for it. */
#define DEFAULT_DIRECT_OWN_CPUS (16u * 1024u)
#define DEFAULT_DIRECT_SHARED_CPUS SIZE_MAX
/* Point-to-point messages from this size go by reference, read once from
 * the sender's buffer, instead of through the ring (host/p2p_direct.c;
 * TCCOMM_P2P_DIRECT_BYTES, rank 0's, as the other sizes). bench_mpi_pair
 * pingpong, Open MPI / core: 256 KiB 0.81 -> 0.91, 4 MiB 0.73 -> 1.02;
 * from 16 KiB to 64 KiB either way is within noise (1.06-1.18). */
#define DEFAULT_P2P_DIRECT (64u * 1024u)
/* A rooted op's part larger than a slot fills several consecutive slots
 * of its sender's ring, by default up to what the ring holds (about
 * 32 slots' worth), rather than going by single-copy reads or the
 * windows: the sender writes it and goes on, and never waits for its
 * receivers (bench/README, "Parts over several slots": at 4 ranks on 2
 * CPUs a 256 KiB broadcast through torch 54 -> 18 us, at 2 ranks 14 -> 7
 * us). TCCOMM_SHM_SLOT_SPAN_BYTES lowers it; 0: one slot at most. */
/* A slot of the slot rings holds its op number, its descriptor and the
 * payload; 0 turns the slot rings off. A rooted op over them takes a
 * fraction of what a stage exchange costs, and more so when ranks share
 * CPUs (bench/README, "The slot rings": at 4 ranks on 2 CPUs a 8 KiB
 * broadcast 2.4 us against 7.2 in C, 35-39 us against 71-77 through torch).
 * By default the rings of a group take at most 8 MiB of its segment: slots
 * of 64 KiB up to 4 ranks, halved as the group doubles, never below 8 KiB
 * (the segment of 8 ranks stays inside a container's default 64 MB
 * /dev/shm). */
#define SLOT_RINGS_BUDGET (8u << 20)
#define DEFAULT_SLOT_BYTES_MIN (8u * 1024u)
#define MIN_SLOT_BYTES 64u
#define MAX_SLOT_BYTES (64u * 1024u)

_Static_assert(sizeof(shm_header_t) <= HEADER_BYTES, "the header must fit the segment's first page");

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* A byte count from the environment: `dflt` when unset or empty; else a
 * decimal count from lo to hi, or TCC_ERR_INVALID naming the variable, its
 * value and the range (a value silently taken for the default would have
 * its user measure something other than what they set). */
static tcc_result_t env_bytes(const char *who, const char *name, size_t dflt, size_t lo, size_t hi, size_t *out,
                              tcc_err_t *err) {
  const char *s = getenv(name);
  *out = dflt;
  if (!s || !*s) return TCC_OK;
  char *end;
  errno = 0;
  const unsigned long long v = strtoull(s, &end, 10);
  if (*s == '-' || *end != 0 || errno == ERANGE || v < lo || v > hi) {
    if (hi == SIZE_MAX)
      return tcc__err_set(err, TCC_ERR_INVALID, "%s: %s='%s' is not a byte count of %zu or more", who, name, s, lo);
    return tcc__err_set(err, TCC_ERR_INVALID, "%s: %s='%s' is not a byte count from %zu to %zu", who, name, s, lo,
                        hi);
  }
  *out = (size_t)v;
  return TCC_OK;
}

/* ---- layout ----------------------------------------------------------- */

/* Each stage gives every rank at least a cache line of the window. */
static size_t min_window(int n) { return align_up((size_t)n * TCC_CACHELINE, 4096); }

/* The slot size a group of n ranks gets by default (see SLOT_RINGS_BUDGET). */
static size_t default_slot_bytes(int n) {
  size_t b = MAX_SLOT_BYTES;
  while (b > DEFAULT_SLOT_BYTES_MIN && (size_t)n * SHM_SLOTS * b > SLOT_RINGS_BUDGET) b /= 2;
  return b;
}

/* The tunables, from this rank's environment and its view of the CPUs
 * (own_cpus: no more ranks on the host than CPUs they may use between
 * them). Every rank reads them, so that a bad value fails each rank that
 * has it; rank 0's choice is the group's (the header carries it). */
typedef struct shm_sizes {
  size_t window, small, direct, slot, slot_span, p2p_direct;
} shm_sizes_t;

/* The most a part may span over slots of `slot_bytes` (0: no rings). */
static size_t span_capacity(size_t slot_bytes) {
  return slot_bytes ? tcc__coll_slot_span_capacity(SHM_SLOTS, slot_bytes) : 0;
}

static tcc_result_t choose_sizes(const char *who, int n, bool own_cpus, shm_sizes_t *z, tcc_err_t *err) {
  size_t w, s, sb;
  if (env_bytes(who, "TCCOMM_SHM_WINDOW_BYTES", DEFAULT_WINDOW, 4096, MAX_WINDOW, &w, err) != TCC_OK)
    return err->code;
  w = align_up(w, 4096);
  if (w < min_window(n)) w = min_window(n);
  if (env_bytes(who, "TCCOMM_SHM_SMALL_BYTES", DEFAULT_SMALL, 0, w, &s, err) != TCC_OK ||
      env_bytes(who, "TCCOMM_SHM_DIRECT_BYTES", own_cpus ? DEFAULT_DIRECT_OWN_CPUS : DEFAULT_DIRECT_SHARED_CPUS, 0,
                SIZE_MAX, &z->direct, err) != TCC_OK ||
      env_bytes(who, "TCCOMM_SHM_SLOT_BYTES", default_slot_bytes(n), 0, MAX_SLOT_BYTES, &sb, err) != TCC_OK ||
      env_bytes(who, "TCCOMM_P2P_DIRECT_BYTES", DEFAULT_P2P_DIRECT, 0, SIZE_MAX, &z->p2p_direct, err) != TCC_OK)
    return err->code;
  z->window = w;
  z->small = s < w ? s : w; /* the default may exceed a small window */
  z->slot = sb == 0 ? 0 : align_up(sb < MIN_SLOT_BYTES ? MIN_SLOT_BYTES : sb, TCC_CACHELINE);
  const size_t most = span_capacity(z->slot);
  return env_bytes(who, "TCCOMM_SHM_SLOT_SPAN_BYTES", most, 0, most, &z->slot_span, err);
}

static bool slot_bytes_valid(uint64_t b) {
  return b == 0 || (b >= MIN_SLOT_BYTES && b <= MAX_SLOT_BYTES && b % TCC_CACHELINE == 0);
}

/* Everything else follows from the group size and the window: rank 0 lays
 * the segment out with it, the other ranks recompute it to check the
 * header. With n <= TCC_MAX_RANKS and window <= MAX_WINDOW nothing here
 * comes near overflow. */
static void layout(shm_header_t *h, int n, uint64_t window, uint64_t slot_bytes) {
  h->size = (uint32_t)n;
  h->window = window;
  h->ring_bytes = n <= 4 ? (1u << 20) : align_up((4u << 20) / (size_t)n, 4096);
  if (h->ring_bytes < (64u << 10)) h->ring_bytes = 64u << 10;
  h->slot_bytes = slot_bytes;
  h->desc_stride = align_up(SHM_DESC_OFFSET + tcc__coll_spans_desc_bytes(n), TCC_CACHELINE);
  h->ctrl_off = HEADER_BYTES;
  h->desc_off = align_up(h->ctrl_off + (size_t)n * sizeof(shm_rank_ctrl_t), TCC_CACHELINE);
  h->data_off = align_up(h->desc_off + (size_t)n * 2 * h->desc_stride, 4096);
  h->ring_off = h->data_off + (size_t)n * 2 * 2 * h->window;
  h->slots_off = h->ring_off + (size_t)n * (size_t)n * shm_ring_stride(h);
  h->seg.total_bytes = h->slots_off + (slot_bytes ? align_up((size_t)n * shm_slots_stride(h), 4096) : 0);
}

/* ---- setup ------------------------------------------------------------ */

/* Rank 0: the segment, laid out for this group, then published. *fd: the
 * creating descriptor, with rank 0's lock. */
static tcc_result_t create_segment(tcc_comm_t *comm, const tcc_segment_id_t *id, const char *who,
                                   const shm_sizes_t *z, shm_state_t *st, int *fd, tcc_err_t *err) {
  shm_header_t h;
  memset(&h, 0, sizeof h);
  layout(&h, comm->size, z->window, z->slot);
  void *base;
  tcc_result_t r = tcc__segment_create(id, h.seg.total_bytes, comm->size, who, &base, fd, err);
  if (r != TCC_OK) return r;
  /* Fresh tmpfs pages are zero: counters, rings and doorbells start at 0. */
  shm_header_t *hdr = base;
  hdr->size = h.size;
  hdr->window = h.window;
  hdr->small_bytes = z->small;
  hdr->direct_bytes = z->direct;
  hdr->p2p_direct_bytes = z->p2p_direct;
  hdr->ring_bytes = h.ring_bytes;
  hdr->slot_bytes = h.slot_bytes;
  hdr->slot_span_bytes = z->slot_span;
  hdr->desc_stride = h.desc_stride;
  hdr->ctrl_off = h.ctrl_off;
  hdr->desc_off = h.desc_off;
  hdr->data_off = h.data_off;
  hdr->ring_off = h.ring_off;
  hdr->slots_off = h.slots_off;
  tcc__segment_publish(base);
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
  return tcc__err_set(err, TCC_ERR_INVALID, "%s: the shared-memory segment's header is inconsistent: %s: not trusted",
                     who, why);
}

/* The other ranks: rank 0's header against the layout recomputed from its
 * published tunables and this group's size, field by field. `bytes`: the
 * verified size of the mapping, of which only the first page is read. */
tcc_result_t tcc__shm_check_header(const shm_header_t *h, int n, size_t bytes, const char *who, tcc_err_t *err) {
  if (h->size != (uint32_t)n) return bad_header(who, err, "it is laid out for %u ranks, this group has %d", h->size, n);
  if (h->window < min_window(n) || h->window > MAX_WINDOW || h->window % 4096 != 0)
    return bad_header(who, err, "window of %llu bytes is not a multiple of 4096 in [%zu, %u]",
                      (unsigned long long)h->window, min_window(n), MAX_WINDOW);
  if (h->small_bytes > h->window)
    return bad_header(who, err, "small-message threshold of %llu bytes exceeds the %llu-byte window",
                      (unsigned long long)h->small_bytes, (unsigned long long)h->window);
  if (!slot_bytes_valid(h->slot_bytes))
    return bad_header(who, err, "slot of %llu bytes is neither 0 nor a multiple of %d in [%u, %u]",
                      (unsigned long long)h->slot_bytes, TCC_CACHELINE, MIN_SLOT_BYTES, MAX_SLOT_BYTES);
  if (h->slot_span_bytes > span_capacity(h->slot_bytes))
    return bad_header(who, err, "parts of up to %llu bytes over several slots exceed the %zu bytes a slot ring holds",
                      (unsigned long long)h->slot_span_bytes, span_capacity(h->slot_bytes));
  shm_header_t want;
  memset(&want, 0, sizeof want);
  layout(&want, n, h->window, h->slot_bytes);
  const struct {
    const char *what;
    uint64_t got, want;
  } fields[] = {
      {"ring_bytes", h->ring_bytes, want.ring_bytes}, {"desc_stride", h->desc_stride, want.desc_stride},
      {"ctrl_off", h->ctrl_off, want.ctrl_off},       {"desc_off", h->desc_off, want.desc_off},
      {"data_off", h->data_off, want.data_off},       {"ring_off", h->ring_off, want.ring_off},
      {"slots_off", h->slots_off, want.slots_off},
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
  tcc_result_t r = tcc__segment_open(id, comm->rank, comm->size, deadline, who, &base, &st->bytes, fd, err);
  if (r != TCC_OK) return r;
  r = tcc__shm_check_header(base, comm->size, st->bytes, who, err);
  if (r != TCC_OK) {
    munmap(base, st->bytes);
    tcc__fd_close(*fd);
    return r;
  }
  st->base = base;
  st->hdr = base;
  return TCC_OK;
}

static const tcc_transport_ops_t shm_ops;
static void shm_destroy(tcc_comm_t *comm);

static void free_state(shm_state_t *st) {
  free(st->tail_seen);
  free(st->rec_read);
  free(st);
}

tcc_result_t tcc__shm_setup(tcc_comm_t *comm, const tcc_blob_t *blobs, tcc_err_t *err) {
  /* What killed processes left behind goes first (shm_reap.c). */
  tcc__shm_reap_once();
  shm_state_t *st = calloc(1, sizeof *st);
  if (st) st->tail_seen = calloc((size_t)comm->size, sizeof *st->tail_seen);
  if (st) st->rec_read = calloc((size_t)comm->size, sizeof *st->rec_read);
  if (!st || !st->tail_seen || !st->rec_read) {
    if (st) free_state(st);
    return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm: out of memory");
  }
  tcc_segment_id_t id;
  char who[160];
  tcc__segment_id("", blobs[0].token, &id);
  snprintf(who, sizeof who, "tccomm '%s' (rank %d)", comm->name, tcc__self_label(comm));
  const int64_t deadline = tcc__deadline_after_ms(atomic_load(&comm->timeout_ms));
  /* Before the segment: rank 0's sizes depend on it. */
  char cpu_why[160];
  tcc__cpu_share_init(&comm->cpu_share, comm->size, tcc__blobs_cpus(blobs, comm->size, NULL), cpu_why,
                      sizeof cpu_why);
  shm_sizes_t sizes;
  tcc_result_t r = choose_sizes(who, comm->size, comm->cpu_share.spin_while_away, &sizes, err);
  if (r != TCC_OK) {
    free_state(st);
    return r;
  }
  int fd = -1;
  r = comm->rank == 0 ? create_segment(comm, &id, who, &sizes, st, &fd, err)
                      : open_segment(comm, &id, deadline, who, st, &fd, err);
  if (r != TCC_OK) {
    free_state(st);
    return r;
  }
  /* The descriptor becomes the liveness lock's; stop closes it, and must
   * run while the segment is still mapped. Rank 0 removes the name before
   * its lock goes. */
  if (tcc__shm_liveness_start(comm, st, fd, err) != TCC_OK) {
    if (comm->rank == 0) shm_unlink(id.name);
    tcc__shm_liveness_stop(comm, st);
    munmap(st->base, st->bytes);
    free_state(st);
    return err->code;
  }
  tcc__shm_cma_publish(comm, st);
  atomic_store(&shm_ctrl(st, comm->rank)->cpu, -1);
  TCC_LOG_INFO(comm->rank, "communicator '%s' shared memory: %s", comm->name, cpu_why);
  int n = comm->size, got = 0;
  r = tcc__segment_attach(st->base, st->lock_fd, &id, comm->rank, n, deadline, who, &got, err);
  if (r != TCC_OK) {
    tcc__shm_liveness_stop(comm, st);
    munmap(st->base, st->bytes);
    free_state(st);
    if (r != TCC_ERR_TIMEOUT) return r;
    return tcc__err_set(err, TCC_ERR_TIMEOUT,
                       "%s: timed out after %lld ms: only %d of %d ranks attached to the shared-memory segment",
                       who, (long long)atomic_load(&comm->timeout_ms), got, n);
  }
  /* Rank 0's values, checked: never this rank's own environment. */
  st->window = st->hdr->window;
  st->small_bytes = st->hdr->small_bytes;
  tcc__shm_cma_probe(comm, st);
  comm->transport_state = st;
  comm->ops = &shm_ops;
  return TCC_OK;
}

static void shm_destroy(tcc_comm_t *comm) {
  shm_state_t *st = shm_of(comm);
  if (!st) return;
  tcc__shm_liveness_stop(comm, st);
  munmap(st->base, st->bytes);
  free_state(st);
  comm->transport_state = NULL;
}

static const tcc_transport_ops_t shm_ops = {
    .name = "shm",
    .caps = TCC__TRANSPORT_SHARES_MEMORY,
    .spans = &tcc__shm_spans,
    .p2p_write = tcc__shm_p2p_write,
    .p2p_read = tcc__shm_p2p_read,
    .p2p_wait = tcc__shm_p2p_wait,
    .p2p_notify = tcc__shm_p2p_notify,
    .p2p_fits = tcc__shm_p2p_fits,
    .p2p_direct = tcc__shm_p2p_direct,
    .p2p_peer_read = tcc__shm_p2p_peer_read,
    .peer_cpu = tcc__shm_peer_cpu,
    .destroy = shm_destroy,
    .failed = tcc__shm_failed,
};
