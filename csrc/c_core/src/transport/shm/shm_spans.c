/*
 * shm_spans.c - what the shared-memory transport offers the collective
 * algorithms (tcc__spans_ops_t): every rank's staging windows in the
 * segment, and the stage barrier that orders writing and reading them
 * (see shm.h for the layout, transport.h for the stage rule).
 */
#include <stdio.h>
#include <string.h>

#include "core/idle_wait.h"
#include "core/mutation.h"
#include "core/prefetch.h"
#include "transport/shm/shm.h"

/* Whether rank r has reached `stage` (its arrival word of that parity). */
static bool reached(shm_state_t *st, int r, uint64_t stage) {
  return shm_stage_reached(atomic_load_explicit(shm_arrival(st, r, (int)(stage & 1)), memory_order_acquire), stage);
}

static int first_missing(shm_state_t *st, int n, int from, uint64_t stage) {
  for (int j = from; j < n; j++)
    if (!reached(st, j, stage)) return j;
  return n;
}

/* The op's timeout is not known here (it may be a per-op one): the engine
 * adds it to the message. */
static tcc_result_t barrier_timeout(tcc_comm_t *comm, shm_state_t *st, const char *what, uint64_t seq,
                                    uint64_t stage, tcc_err_t *err) {
  char missing[256] = "";
  size_t len = 0;
  for (int j = 0; j < comm->size && len < sizeof missing - 16; j++) {
    if (!reached(st, j, stage))
      len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%d", len ? ", " : "", tcc__rank_label(comm, j));
  }
  return tcc__err_set(err, TCC_ERR_TIMEOUT,
                     "tccomm %s #%llu on '%s' (rank %d): timed out waiting for rank(s) %s "
                     "(they did not call it, or are stuck in an earlier operation)",
                     what, (unsigned long long)seq, comm->name, tcc__self_label(comm), missing);
}

/* One rank's wait at a stage barrier (the idle wait's argument). */
typedef struct arrival {
  tcc_comm_t *comm;
  shm_state_t *st;
  int n;          /* ranks to wait for */
  int first;      /* no rank below it is missing */
  uint64_t stage;
  const char *what;
  uint64_t seq;
  tcc_err_t *err;
  bool shared_cpu; /* a lower rank waited for was seen on this CPU (this rank then moves: cpu_share.h) */
} arrival_t;

static bool all_arrived(void *arg) {
  arrival_t *a = arg;
  a->first = first_missing(a->st, a->n, a->first, a->stage);
  return a->first >= a->n;
}

/* Whether a rank not yet arrived last ran on this CPU (see cpu_share.h). */
static bool missing_rank_here(void *arg) {
  arrival_t *a = arg;
  const int here = tcc__cpu_now();
  if (here < 0) return true;
  for (int k = a->first; k < a->n; k++) {
    const shm_rank_ctrl_t *c = shm_ctrl(a->st, k);
    if (reached(a->st, k, a->stage)) continue;
    const int cpu = atomic_load_explicit(&c->cpu, memory_order_relaxed);
    if (cpu < 0 || cpu == here) {
      a->shared_cpu |= cpu == here && k < a->comm->rank;
      return true;
    }
  }
  return false;
}

/* TCC_ERR_ABORTED, with the cause, once this rank's communicator failed
 * while it waits in op `what` #seq. */
static tcc_result_t failed_while_waiting(tcc_comm_t *comm, const char *what, uint64_t seq, tcc_err_t *err) {
  if (!atomic_load(&comm->aborted)) return TCC_OK;
  char cause[TCC_ERRLEN];
  tcc__comm_failure(comm, cause, sizeof cause);
  return tcc__err_set(err, TCC_ERR_ABORTED, "tccomm %s #%llu on '%s' (rank %d) interrupted: %s", what,
                      (unsigned long long)seq, comm->name, tcc__self_label(comm), cause);
}

/* The communicator failed, or a rank that has not arrived is gone. */
static tcc_result_t arrival_trouble(void *arg, int64_t now_ns) {
  (void)now_ns;
  arrival_t *a = arg;
  tcc_comm_t *comm = a->comm;
  if (failed_while_waiting(comm, a->what, a->seq, a->err) != TCC_OK) return TCC_ERR_ABORTED;
  for (int k = a->first; k < a->n; k++) {
    if (reached(a->st, k, a->stage)) continue;
    tcc_result_t gone = tcc__shm_peer_check(comm, a->st, k, false, a->what, a->err);
    if (gone != TCC_OK) return gone;
  }
  return TCC_OK;
}

/* Publishes the CPU this rank runs on, writing only when it changed: the
 * peers read this line, and a needless write takes it back from them. */
static void note_cpu(shm_rank_ctrl_t *mine) {
  const int cpu = tcc__cpu_now();
  if (atomic_load_explicit(&mine->cpu, memory_order_relaxed) != cpu)
    atomic_store_explicit(&mine->cpu, cpu, memory_order_relaxed);
}

static tcc_result_t stage_barrier(tcc_comm_t *comm, int64_t deadline_ns, const char *what, uint64_t seq,
                                  tcc_err_t *err) {
  shm_state_t *st = shm_of(comm);
  int n = comm->size;
  if (TCC_MUTANT(BARRIER_SKIP_PEER) && strcmp(what, "barrier") == 0) n--; /* MUTATION SITE */
  const uint64_t stage = ++st->stage;
  shm_header_t *h = st->hdr;
  shm_rank_ctrl_t *mine = shm_ctrl(st, comm->rank);
  note_cpu(mine);
  atomic_store(shm_arrival(st, comm->rank, (int)(stage & 1)), (uint32_t)stage);
  if (atomic_load(&h->barrier_sleepers) > 0) {
    atomic_fetch_add(&h->barrier_futex, 1);
    tcc__futex_wake_all(&h->barrier_futex);
  }
  arrival_t a = {comm, st, n, 0, stage, what, seq, err, false};
  const tcc__idle_wait_t w = {.ready = all_arrived, .check = arrival_trouble, .arg = &a,
                              .spins = comm->cpu_share.spins,
                              .peer_here = comm->cpu_share.spin_while_away ? missing_rank_here : NULL,
                              .away_spin_ns = TCC_CPU_AWAY_SPIN_NS, .yields = 64, .max_nap_ns = 20 * 1000000LL,
                              .deadline_ns = deadline_ns, .word = &h->barrier_futex,
                              .sleepers = &h->barrier_sleepers};
  tcc_result_t r = tcc__idle_wait(&w);
  tcc__cpu_share_after_wait(&comm->cpu_share, a.shared_cpu);
  /* Where this rank goes on from: what a peer waiting for it next sees. */
  note_cpu(mine);
  /* On a timeout the stage counter stays as is: the communicator is failed anyway. */
  if (r == TCC_ERR_TIMEOUT) return barrier_timeout(comm, st, what, seq, stage, err);
  return r;
}

/* How much of the input span prefetch_writes takes ahead at most: the
 * small ops whose time the lines' trips are; larger ones are bandwidth. */
#define PREFETCH_WRITES_MAX_BYTES 4096

static void prefetch_writes(tcc_comm_t *comm, int parity, size_t bytes) {
  shm_state_t *st = shm_of(comm);
  /* The whole descriptor slot: past its first line lie an all-to-all's
   * count lists and the single-copy block (written by every all-to-all,
   * since its longest stream is not known before the barrier). */
  tcc__prefetch_write_span(shm_arrival(st, comm->rank, parity), st->hdr->desc_stride);
  const size_t input = bytes < PREFETCH_WRITES_MAX_BYTES ? bytes : PREFETCH_WRITES_MAX_BYTES;
  tcc__prefetch_write_span(shm_in(st, comm->rank, parity), input);
}

/* ---- slot rings --------------------------------------------------------- */

/* One rank's wait on a peer's slot or progress (the idle wait's argument). */
typedef struct slot_waiter {
  tcc_comm_t *comm;
  shm_state_t *st;
  bool (*ready)(void *arg);
  void *arg;
  int peer;
  const char *what;
  uint64_t seq;
  tcc_err_t *err;
} slot_waiter_t;

static bool slot_ready(void *arg) {
  slot_waiter_t *w = arg;
  return w->ready(w->arg);
}

static bool slot_peer_here(void *arg) {
  slot_waiter_t *w = arg;
  const int here = tcc__cpu_now();
  const int cpu = atomic_load_explicit(&shm_ctrl(w->st, w->peer)->cpu, memory_order_relaxed);
  return here < 0 || cpu < 0 || cpu == here;
}

static tcc_result_t slot_trouble(void *arg, int64_t now_ns) {
  (void)now_ns;
  slot_waiter_t *w = arg;
  if (failed_while_waiting(w->comm, w->what, w->seq, w->err) != TCC_OK) return TCC_ERR_ABORTED;
  return tcc__shm_peer_check(w->comm, w->st, w->peer, false, w->what, w->err);
}

static tcc_result_t slot_wait(tcc_comm_t *comm, bool (*ready)(void *arg), void *arg, int peer, int64_t deadline_ns,
                              const char *what, uint64_t seq, tcc_err_t *err) {
  if (ready(arg)) return TCC_OK;
  shm_state_t *st = shm_of(comm);
  shm_header_t *h = st->hdr;
  slot_waiter_t sw = {comm, st, ready, arg, peer, what, seq, err};
  note_cpu(shm_ctrl(st, comm->rank));
  const tcc__idle_wait_t w = {.ready = slot_ready, .check = slot_trouble, .arg = &sw,
                              .spins = comm->cpu_share.spins,
                              .peer_here = comm->cpu_share.spin_while_away ? slot_peer_here : NULL,
                              .away_spin_ns = TCC_CPU_AWAY_SPIN_NS, .yields = 64, .max_nap_ns = 20 * 1000000LL,
                              .deadline_ns = deadline_ns, .word = &h->barrier_futex,
                              .sleepers = &h->barrier_sleepers};
  tcc_result_t r = tcc__idle_wait(&w);
  note_cpu(shm_ctrl(st, comm->rank));
  return r;
}

/* The slot rings share the stage barrier's futex word: a wait in either
 * sleeps there, and every store that may end one wakes it. */
static void slot_wake(tcc_comm_t *comm) {
  shm_header_t *h = shm_of(comm)->hdr;
  if (atomic_load(&h->barrier_sleepers) > 0) {
    atomic_fetch_add(&h->barrier_futex, 1);
    tcc__futex_wake_all(&h->barrier_futex);
  }
}

static bool stage_ahead(tcc_comm_t *comm, int rank) {
  shm_state_t *st = shm_of(comm);
  return reached(st, rank, st->stage + 1);
}

static unsigned slot_count(tcc_comm_t *comm) { return shm_of(comm)->hdr->slot_bytes ? SHM_SLOTS : 0; }
static size_t slot_bytes(tcc_comm_t *comm) { return shm_of(comm)->hdr->slot_bytes; }
static size_t slot_span_bytes(tcc_comm_t *comm) { return shm_of(comm)->hdr->slot_span_bytes; }
static char *slot_at(tcc_comm_t *comm, int rank, uint64_t index) {
  return shm_slot(shm_of(comm), rank, (unsigned)(index % SHM_SLOTS));
}
static atomic_ullong *slot_progress(tcc_comm_t *comm, int rank) { return shm_slot_progress(shm_of(comm), rank); }
static uint32_t *digest_of(tcc_comm_t *comm, int rank, int parity) { return shm_digest(shm_of(comm), rank, parity); }

/* ---- the table -------------------------------------------------------- */

static size_t window_bytes(tcc_comm_t *comm) { return shm_of(comm)->window; }
static size_t one_shot_bytes(tcc_comm_t *comm) { return shm_of(comm)->small_bytes; }
static char *desc_span(tcc_comm_t *comm, int rank, int parity) { return shm_desc(shm_of(comm), rank, parity); }
static char *input_span(tcc_comm_t *comm, int rank, int parity) { return shm_in(shm_of(comm), rank, parity); }
static char *result_span(tcc_comm_t *comm, int rank, int parity) { return shm_res(shm_of(comm), rank, parity); }
static int next_parity(tcc_comm_t *comm) { return (int)((shm_of(comm)->stage + 1) & 1); }
static size_t direct_bytes(tcc_comm_t *comm) { return shm_of(comm)->direct_bytes; }
static size_t direct_agreed_bytes(tcc_comm_t *comm) { return shm_of(comm)->hdr->direct_bytes; }

_Static_assert(SHM_DESC_OFFSET + sizeof(tcc_coll_desc_t) <= TCC_CACHELINE,
               "a rank's arrival, digest and descriptor share a cache line");

const tcc__spans_ops_t tcc__shm_spans = {
    .window_bytes = window_bytes,
    .one_shot_bytes = one_shot_bytes,
    .desc = desc_span,
    .desc_inline_bytes = TCC_CACHELINE - SHM_DESC_OFFSET - sizeof(tcc_coll_desc_t),
    .input = input_span,
    .result = result_span,
    .next_parity = next_parity,
    .barrier = stage_barrier,
    .prefetch_writes = prefetch_writes,
    .direct_bytes = direct_bytes,
    .direct_agreed_bytes = direct_agreed_bytes,
    .peer_read = tcc__shm_peer_read,
    .peer_write = tcc__shm_peer_write,
    .slot_count = slot_count,
    .slot_bytes = slot_bytes,
    .slot_span_bytes = slot_span_bytes,
    .slot = slot_at,
    .slot_progress = slot_progress,
    .slot_wait = slot_wait,
    .slot_wake = slot_wake,
    .stage_ahead = stage_ahead,
    .digest = digest_of,
};
