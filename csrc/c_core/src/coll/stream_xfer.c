/*
 * stream_xfer.c - moves the byte streams of one collective phase.
 *
 * All peers progress at once from a single poll loop over the transport's
 * non-blocking streams: a rank never blocks writing to one peer while that
 * peer blocks writing to it, so no pair can deadlock on full buffers. Each
 * stream is a plain byte sequence whose layout (stream_link_t) both ends
 * derive from the same, already agreed, collective descriptor.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll/stream_xfer.h"

#define WAIT_SLICE_MS 100 /* how often a waiting rank looks at `aborted` */
#define SLOT_BUDGET (16u << 20) /* all slots of one reduction together */
#define SEG_MIN (32u << 10)
#define SEG_MAX (1u << 20)
/* Where this host has more ranks than CPUs, a transfer that sees nothing
 * yields this many times before it sleeps: the rank it waits for is most
 * likely queued on this very CPU, and a yield runs it at once where a
 * sleep costs a wake-up too. 4 ranks on 2 CPUs over TCP, allreduce: 8 B
 * 51-61 us against 94-98 sleeping at once, 64 KiB to 1 MiB 1.7-2.7x
 * faster, 4 MiB even (8 to 256 yields measured alike). */
#define OVERSUBSCRIBED_YIELDS 64
/* Up to this many peers to wait on, a look that must not sleep tries their
 * streams directly instead of asking poll first: a poll costs a system call
 * as dear as the receive it would announce, so a spinning rank saw its
 * peer's bytes one call later than it could. With more peers one poll is
 * cheaper than a receive per peer. */
#define DIRECT_LOOK_PEERS 2
/* How long the other links run on after a peer hangs up, for a cause
 * still on its way from them (see "hang-ups" below): far longer than a
 * rank is scheduled out, well inside the 2 s in which the survivors of a
 * killed rank must fail (README, test_fault_injection.py). */
#define HANGUP_GRACE_NS 500000000LL

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

void tcc__stream_xfer_prefix(const stream_xfer_t *x, char *buf, size_t len) {
  snprintf(buf, len, "%s %s #%llu on communicator '%s' rank %d", x->comm->ops->name, x->what,
           (unsigned long long)x->seq, x->comm->name, tcc__self_label(x->comm));
}

/* ---- the reducer ------------------------------------------------------ */

size_t tcc__stream_segment_bytes(int n) {
  size_t seg = SLOT_BUDGET / (2 * (size_t)n);
  if (seg < SEG_MIN) seg = SEG_MIN;
  if (seg > SEG_MAX) seg = SEG_MAX;
  return seg;
}

tcc_result_t tcc__stream_reducer_alloc(stream_xfer_t *x, size_t chunk, bool need_staging,
                               tcc_err_t *err) {
  stream_reducer_t *r = &x->red;
  int n = x->comm->size;
  size_t seg = tcc__stream_segment_bytes(n);
  seg -= seg % r->esize;
  /* small messages need no more than their own size */
  if (chunk < seg) seg = chunk;
  r->chunk = chunk;
  r->seg = seg;
  r->nseg = seg ? (chunk + seg - 1) / seg : 0;
  r->done_seg = 0;
  r->slots = NULL;
  r->staging = NULL;
  r->srcs = calloc((size_t)n, sizeof(*r->srcs));
  if (chunk && n > 1) r->slots = malloc((size_t)n * 2 * seg);
  if (chunk && need_staging) r->staging = malloc(2 * seg);
  if (!r->srcs || (chunk && n > 1 && !r->slots) || (chunk && need_staging && !r->staging)) {
    tcc__stream_reducer_free(r);
    char pre[160];
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory for reduction buffers",
                       pre);
  }
  return TCC_OK;
}

void tcc__stream_reducer_free(stream_reducer_t *r) {
  free(r->slots);
  free(r->staging);
  free(r->srcs);
  r->slots = r->staging = NULL;
  r->srcs = NULL;
}

static uint8_t *slot_of(const stream_reducer_t *r, int peer, size_t seg_index) {
  return r->slots + ((size_t)peer * 2 + (seg_index & 1)) * r->seg;
}

static size_t seg_end(const stream_reducer_t *r, size_t seg_index) {
  return min_size((seg_index + 1) * r->seg, r->chunk);
}

/* Segment done_seg can be reduced once every peer's part is in its slot,
 * and, when it goes to a staging buffer, once that buffer's previous
 * segment (done_seg - 2) has been fully sent. */
static bool reducer_ready(const stream_xfer_t *x) {
  const stream_reducer_t *r = &x->red;
  if (r->done_seg >= r->nseg) return false;
  size_t end = seg_end(r, r->done_seg);
  for (int j = 0; j < x->comm->size; j++) {
    const stream_link_t *l = &x->links[j];
    if (j == x->comm->rank) continue;
    if (l->in_done < end) return false;
    if (!r->out && l->out_red && r->done_seg >= 2) {
      size_t freed = (r->done_seg - 1) * r->seg;
      if (l->out_done < l->out_raw + freed) return false;
    }
  }
  return true;
}

static void reducer_step(stream_xfer_t *x) {
  stream_reducer_t *r = &x->red;
  size_t k = r->done_seg, start = k * r->seg, len = seg_end(r, k) - start;
  for (int j = 0; j < x->comm->size; j++)
    r->srcs[j] = j == x->comm->rank ? (const void *)(r->self_src + start)
                                : (const void *)slot_of(r, j, k);
  uint8_t *dst = r->out ? r->out + start : r->staging + (k & 1) * r->seg;
  tcc__reduce_n(dst, r->srcs, x->comm->size, len / r->esize, r->dtype, r->redop, r->premul);
  r->done_seg++;
}

/* ---- where the next bytes of a stream live ---------------------------- */

/* Bytes that can be sent to `peer` right now, starting at *p. */
static size_t out_span(const stream_xfer_t *x, int peer, const uint8_t **p) {
  const stream_link_t *l = &x->links[peer];
  const stream_reducer_t *r = &x->red;
  if (l->pre_done < l->pre_len) {
    *p = l->out_pre + l->pre_done;
    return l->pre_len - l->pre_done;
  }
  size_t pos = l->out_done;
  if (pos < l->out_raw) {
    *p = l->out_ptr + pos;
    return l->out_raw - pos;
  }
  pos -= l->out_raw;
  if (pos >= l->out_red) return 0;
  size_t ready = min_size(r->done_seg * r->seg, r->chunk);
  if (pos >= ready) return 0;
  if (r->out) {
    *p = r->out + pos;
    return ready - pos;
  }
  size_t k = pos / r->seg; /* staging holds one segment per buffer */
  *p = r->staging + (k & 1) * r->seg + pos % r->seg;
  return min_size(ready, (k + 1) * r->seg) - pos;
}

/* Bytes that can be received from `peer` right now, into *p. */
static size_t in_span(const stream_xfer_t *x, int peer, uint8_t **p) {
  const stream_link_t *l = &x->links[peer];
  const stream_reducer_t *r = &x->red;
  size_t pos = l->in_done;
  if (pos < l->in_slot) {
    size_t k = pos / r->seg;
    if (k >= r->done_seg + 2) return 0; /* both slots still hold unreduced data */
    *p = slot_of(r, peer, k) + pos % r->seg;
    return min_size(l->in_slot, (k + 1) * r->seg) - pos;
  }
  pos -= l->in_slot;
  if (pos >= l->in_raw) return 0;
  *p = l->in_ptr + pos;
  return l->in_raw - pos;
}

static bool in_complete(const stream_link_t *l) { return l->in_done == l->in_slot + l->in_raw; }

static bool link_done(const stream_xfer_t *x, const stream_link_t *l) {
  return l->pre_done == l->pre_len && l->out_done == l->out_raw + l->out_red && in_complete(l) && (!x->in_next || l->in_closed);
}

/* ---- stream I/O ------------------------------------------------------- */

static tcc_result_t peer_failed(stream_xfer_t *x, int peer, const char *how,
                                int errnum, tcc_err_t *err) {
  char pre[160];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  /* A reset or an end of stream is how a peer's death shows over TCP, and
   * how a peer whose communicator failed tells the ranks waiting on it. */
  x->hangup_seen = errnum == ECONNRESET || errnum == EPIPE || errnum == 0;
  if (x->hangup_seen)
    return tcc__err_set(err, TCC_ERR_REMOTE,
                       "%s: the connection to rank %d %s during %s (its process exited, or its "
                       "communicator failed or was destroyed)", pre, tcc__rank_label(x->comm, peer),
                       errnum ? "was reset" : "closed", x->phase);
  return tcc__err_set(err, TCC_ERR_REMOTE, "%s: %s rank %d failed during %s: %s", pre,
                     how, tcc__rank_label(x->comm, peer), x->phase, strerror(errnum));
}

/* Takes what the stream from `peer` holds now, following the link's
 * continuations (x->in_next) as each part completes. */
static tcc_result_t receive(stream_xfer_t *x, int peer, bool *moved, tcc_err_t *err) {
  const tcc__stream_ops_t *io = x->comm->ops->streams;
  stream_link_t *l = &x->links[peer];
  for (;;) {
    uint8_t *p;
    size_t n;
    while ((n = in_span(x, peer, &p)) > 0) {
      ssize_t k = io->recv(x->comm, peer, p, n);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return TCC_OK;
      if (k < 0) return peer_failed(x, peer, "receiving from", errno, err);
      if (k == 0) return peer_failed(x, peer, NULL, 0, err);
      l->in_done += (size_t)k;
      *moved = true;
      if ((size_t)k < n) return TCC_OK; /* drained */
    }
    /* in_span is also 0 while the reducer holds both slots */
    if (!x->in_next || l->in_closed || !in_complete(l)) return TCC_OK;
    tcc_result_t r = x->in_next(x, peer, err);
    if (r != TCC_OK) return r;
  }
}

/* A send to `peer` failed with errnum. A peer that closed its end may
 * have said why before it did (a frame that disagrees with this rank's
 * ops, which failed its communicator): what it sent is read first, and
 * the error found there wins. */
static tcc_result_t send_failed(stream_xfer_t *x, int peer, int errnum, bool *moved, tcc_err_t *err) {
  if (errnum == EPIPE || errnum == ECONNRESET) {
    const tcc_result_t why = receive(x, peer, moved, err);
    if (why == TCC_ERR_MISMATCH) return why;
    if (err) tcc__err_reset(err);
  }
  return peer_failed(x, peer, "sending to", errnum, err);
}

/* Moves what the stream to `peer` takes and gives now. */
static tcc_result_t pump(stream_xfer_t *x, int peer, short revents, bool *moved,
                         tcc_err_t *err) {
  const tcc__stream_ops_t *io = x->comm->ops->streams;
  stream_link_t *l = &x->links[peer];
  if (revents & (POLLOUT | POLLERR | POLLHUP)) {
    const uint8_t *p;
    size_t n;
    while ((n = out_span(x, peer, &p)) > 0) {
      ssize_t k = io->send(x->comm, peer, p, n);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (k < 0) return send_failed(x, peer, errno, moved, err);
      *(l->pre_done < l->pre_len ? &l->pre_done : &l->out_done) += (size_t)k; /* out_span's part */
      *moved = true;
      if ((size_t)k < n) break; /* the stream's buffer is full */
    }
  }
  if (revents & (POLLIN | POLLERR | POLLHUP)) return receive(x, peer, moved, err);
  return TCC_OK;
}

/* Lists the peers this rank still waits for (incomplete incoming streams,
 * else incomplete outgoing ones) into buf. */
static void pending_peers(const stream_xfer_t *x, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (int pass = 0; pass < 2 && used == 0; pass++) {
    for (int j = 0; j < x->comm->size; j++) {
      const stream_link_t *l = &x->links[j];
      bool waiting = pass == 0 ? l->in_done < l->in_slot + l->in_raw
                               : l->pre_done < l->pre_len || l->out_done < l->out_raw + l->out_red;
      if (j == x->comm->rank || !waiting) continue;
      int k = snprintf(buf + used, len - used, "%s%d", used ? ", " : "", tcc__rank_label(x->comm, j));
      if (k < 0 || (size_t)k >= len - used) {
        snprintf(buf + len - 5, 5, "...");
        return;
      }
      used += (size_t)k;
    }
  }
}

static tcc_result_t fail_timeout(const stream_xfer_t *x, tcc_err_t *err) {
  char pre[160], peers[200];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  pending_peers(x, peers, sizeof(peers));
  return tcc__err_set(err, TCC_ERR_TIMEOUT,
                     "%s: timed out during %s waiting for rank(s) %s", pre, x->phase,
                     peers);
}

static tcc_result_t fail_aborted(const stream_xfer_t *x, tcc_err_t *err) {
  char pre[160];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  /* The cause (abort, destroy, a failure elsewhere) is the communicator's. */
  char cause[TCC_ERRLEN];
  tcc__comm_failure(x->comm, cause, sizeof cause);
  return tcc__err_set(err, TCC_ERR_ABORTED, "%s: interrupted during %s: %.300s", pre, x->phase, cause);
}

/* `pump` failed with r: err says why, unless this communicator failed
 * meanwhile. A failed communicator ends its own connections to tell
 * its peers (transport `failed`): then its failure, not the stream's end,
 * is why. */
static tcc_result_t pump_failed(const stream_xfer_t *x, tcc_result_t r, tcc_err_t *err) {
  if (!atomic_load(&x->comm->aborted) || r == TCC_ERR_MISMATCH) return r; /* a disagreement says why itself */
  if (err) err->code = TCC_OK; /* replaced, not kept as the first failure */
  return fail_aborted(x, err);
}

/* ---- hang-ups ----------------------------------------------------------
 * A peer that resets or closes its stream during a frame exchange has
 * died or failed its communicator, most often for a disagreement it found
 * in another rank's frames. The frames that show this rank the same
 * disagreement may still be on their way from that other rank: with 3
 * ranks on 2 CPUs a root can be scheduled out between its sends to its two
 * peers, and the first one finds the mismatch and hangs up on the second
 * before the second has its frame. So the first hang-up is set aside and
 * the other links run on for up to HANGUP_GRACE_NS: a disagreement found
 * there is the error; once they are done, or wait only on the peer that
 * hung up, or the grace is over, the hang-up is. Peers that stay alive
 * send their frames at once, and peers that fail too hang up in turn, so
 * the wait is seldom long. */
typedef struct hangup {
  int peer; /* the first to hang up; -1: none */
  int64_t until;
  tcc_err_t err;
} hangup_t;

/* `pump` on peer failed with r: a hang-up is set aside (TCC_OK: the link
 * is left out from now on); anything else ends the transfer. */
static tcc_result_t set_aside_hangup(stream_xfer_t *x, int peer, tcc_result_t r, hangup_t *h,
                                     int64_t deadline_ns, tcc_err_t *err) {
  /* Only frames (x->in_next) can show a disagreement: in a data phase the
   * ranks agreed already, and what the others owe may wait on the peer
   * that hung up. */
  const bool hangup = r == TCC_ERR_REMOTE && x->hangup_seen && x->in_next;
  x->hangup_seen = false;
  if (!hangup) return pump_failed(x, r, err);
  x->links[peer].hung_up = true;
  if (h->peer < 0) {
    h->peer = peer;
    if (err) h->err = *err;
    const int64_t until = tcc__now_ns() + HANGUP_GRACE_NS;
    h->until = until < deadline_ns ? until : deadline_ns;
  }
  if (err) tcc__err_reset(err);
  return TCC_OK;
}

static tcc_result_t hangup_failed(const stream_xfer_t *x, const hangup_t *h, tcc_err_t *err) {
  if (err) *err = h->err;
  return pump_failed(x, TCC_ERR_REMOTE, err);
}

tcc_result_t tcc__stream_xfer_run(stream_xfer_t *x, int64_t deadline_ns, tcc_err_t *err) {
  tcc_comm_t *comm = x->comm;
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  bool moved = true; /* first poll only looks, it does not sleep */
  /* A transfer may poll without sleeping for its first
   * TCC_CPU_AWAY_SPIN_NS: a small op done by then costs no wake-up of a
   * sleeping thread; a large one then sleeps between its events, as
   * before (core/cpu_share.h says when a spin is allowed). */
  bool spin = tcc__spin_gate_open(&sc->spin_gate, &comm->cpu_share, true);
  const int64_t spin_until = tcc__now_ns() + TCC_CPU_AWAY_SPIN_NS;
  bool spin_saw_progress = false;
  const int yields = comm->cpu_share.spin_while_away ? 0 : OVERSUBSCRIBED_YIELDS;
  int yields_left = yields;
  hangup_t hang = {.peer = -1};
  /* What can go out goes before the first poll: a stream's buffer nearly
   * always takes a small op's frames, and a poll to be told so costs a
   * system call as dear as the send (a small op over TCP made 2.6 polls,
   * 2 receives and 1 send per peer). A send the buffer refuses waits for
   * POLLOUT in the loop, as before. */
  for (int j = 0; j < comm->size; j++) {
    const uint8_t *op;
    if (j == comm->rank || !out_span(x, j, &op)) continue;
    tcc_result_t r = pump(x, j, POLLOUT, &moved, err);
    if (r != TCC_OK && (r = set_aside_hangup(x, j, r, &hang, deadline_ns, err)) != TCC_OK) return r;
  }
  for (;;) {
    while (reducer_ready(x)) {
      reducer_step(x);
      moved = true;
    }
    int npeers = 0;
    bool links_done = true;
    for (int j = 0; j < comm->size; j++) {
      if (j == comm->rank || x->links[j].hung_up || link_done(x, &x->links[j])) continue;
      links_done = false;
      const uint8_t *op;
      uint8_t *ip;
      short ev = (short)((out_span(x, j, &op) ? POLLOUT : 0) | (in_span(x, j, &ip) ? POLLIN : 0));
      if (!ev) continue; /* gated on the reducer, which waits on another peer */
      sc->poll_peers[npeers] = j;
      sc->poll_events[npeers++] = ev;
    }
    if (links_done && hang.peer < 0 && x->red.done_seg == x->red.nseg) return TCC_OK;
    if (!moved && x->before_wait) {
      void (*hook)(stream_xfer_t *) = x->before_wait;
      x->before_wait = NULL;
      hook(x);
      moved = true; /* what it gave the links goes out at the next look */
      continue;
    }
    if (hang.peer >= 0 && (links_done || npeers == 0)) return hangup_failed(x, &hang, err);
    if (atomic_load(&comm->aborted)) return fail_aborted(x, err);
    int64_t now = tcc__now_ns();
    const int64_t until = hang.peer >= 0 ? hang.until : deadline_ns;
    if (now >= until) return hang.peer >= 0 ? hangup_failed(x, &hang, err) : fail_timeout(x, err);
    if (npeers == 0) {
      char pre[160];
      tcc__stream_xfer_prefix(x, pre, sizeof(pre));
      return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: internal error: %s stalled", pre,
                         x->phase);
    }
    /* Rounded up without adding to deadline_ns, which may be INT64_MAX. */
    int64_t left_ms = (until - now - 1) / 1000000 + 1;
    if (spin && now >= spin_until) {
      spin = false;
      if (!spin_saw_progress) tcc__spin_gate_missed(&sc->spin_gate);
    }
    if (moved) yields_left = yields;
    const bool yield_first = !moved && !spin && yields_left > 0;
    if (yield_first) {
      yields_left--;
      sched_yield();
    }
    const bool look_only = moved || spin || yield_first;
    if (look_only && npeers <= DIRECT_LOOK_PEERS) {
      moved = false;
      for (int i = 0; i < npeers; i++) {
        const int j = sc->poll_peers[i];
        tcc_result_t r = pump(x, j, sc->poll_events[i], &moved, err);
        if (r != TCC_OK && (r = set_aside_hangup(x, j, r, &hang, deadline_ns, err)) != TCC_OK) return r;
      }
      spin_saw_progress |= spin && moved;
      continue;
    }
    int timeout = look_only ? 0 : (int)(left_ms < WAIT_SLICE_MS ? left_ms : WAIT_SLICE_MS);
    int rc = comm->ops->streams->poll(comm, npeers, sc->poll_peers, sc->poll_events, sc->poll_revents, timeout);
    if (rc < 0 && errno != EINTR)
      return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: poll failed: %s", comm->ops->name, strerror(errno));
    moved = false;
    for (int i = 0; i < npeers && rc > 0; i++) {
      short rev = sc->poll_revents[i];
      if (!rev) continue;
      if (rev & POLLNVAL)
        return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: the stream to rank %d is closed", comm->ops->name,
                           sc->poll_peers[i]);
      const int j = sc->poll_peers[i];
      tcc_result_t r = pump(x, j, rev, &moved, err);
      if (r != TCC_OK && (r = set_aside_hangup(x, j, r, &hang, deadline_ns, err)) != TCC_OK) return r;
    }
    spin_saw_progress |= spin && moved;
  }
}
