/*
 * stream_frames.c - the descriptor frames of collectives over streams
 * (stream_frames.h): one exchange with every peer at once, each incoming
 * frame taken in three parts (head, descriptor tail, payload), each part's
 * length and place decided when the one before it is in.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll/stream_frames.h"
#include "core/copy.h"
#include "core/mutation.h"

#define FRAME_MAGIC 0x54434346u

/* What precedes the descriptor's tail on the wire. desc is the
 * descriptor's head; its tail follows right after it, in memory too. */
typedef struct stream_frame_head {
  uint32_t magic;
  uint32_t desc_len; /* bytes of the whole descriptor, head and tail */
  uint64_t payload;  /* bytes after the descriptor */
  uint8_t desc[sizeof(tcc_coll_desc_t)];
} stream_frame_head_t;

_Static_assert(sizeof(stream_frame_head_t) == 16 + sizeof(tcc_coll_desc_t), "no padding before a tail");

/* The parts of an incoming frame, in order. */
enum { PART_HEAD, PART_TAIL, PART_PAYLOAD, PART_NONE };

/* The receiving side of one exchange: each peer's frame head and tail in a
 * region of its own (head, then as much tail as this rank's descriptor
 * has), so the tail follows the descriptor's head as the check reads it. */
typedef struct frames_in {
  const stream_frames_t *f;
  uint8_t *regions; /* [n][stride] */
  size_t stride;
  size_t tail_len; /* this rank's descriptor's tail */
  size_t desc_max; /* the longest descriptor a rank of this group can send */
  uint8_t *part;   /* [n] the part each peer's frame is in */
  uint8_t *drop;   /* what no one wanted goes here (made when first needed) */
  /* [n] frames of earlier one-sided ops to read from each peer before
   * this op's, and how many of them are read */
  uint16_t *unread, *read;
  const bool *listen; /* NULL: this op's frame is read from every peer */
} frames_in_t;

size_t tcc__stream_frame_bytes(const tcc_coll_t *c, int n, size_t payload) {
  return sizeof(stream_frame_head_t) + tcc__coll_desc_bytes(c->kind, n) - sizeof(tcc_coll_desc_t) + payload;
}

void tcc__stream_frame_fill(const tcc_coll_t *c, uint64_t seq, int n, const void *payload, size_t len,
                            uint8_t *out) {
  stream_frame_head_t *h = (stream_frame_head_t *)out;
  const size_t desc_len = tcc__coll_desc_bytes(c->kind, n);
  h->magic = FRAME_MAGIC;
  h->desc_len = (uint32_t)desc_len;
  h->payload = len;
  tcc__coll_desc_fill(c, seq, n, h->desc); /* the tail lands right after the head */
  if (len) tcc__copy(out + sizeof *h + desc_len - sizeof(tcc_coll_desc_t), payload, len);
}

bool tcc__stream_frame_plan_alloc(stream_frame_plan_t *p, int n, size_t frame_bytes, size_t in_bytes,
                                  size_t extra_bytes) {
  frame_bytes = tcc__stream_round64(frame_bytes);
  in_bytes = tcc__stream_round64(in_bytes);
  extra_bytes = tcc__stream_round64(extra_bytes);
  const size_t tables = (size_t)n * (2 * sizeof(uint8_t *) + 2 * sizeof(size_t) + sizeof(void *) + 2 * sizeof(bool));
  uint8_t *mem = aligned_alloc(64, frame_bytes + in_bytes + extra_bytes + tcc__stream_round64(tables));
  if (!mem) return false;
  p->mem = mem;
  p->frames = mem;
  p->ins = mem + frame_bytes;
  p->extra = p->ins + in_bytes;
  p->out = (uint8_t **)(p->extra + extra_bytes);
  p->in = p->out + n;
  p->out_len = (size_t *)(p->in + n);
  p->in_len = p->out_len + n;
  p->srcs = (const void **)(p->in_len + n);
  p->listen = (bool *)(p->srcs + n);
  p->hold = p->listen + n;
  p->one_sided = false;
  for (int j = 0; j < n; j++) {
    p->out[j] = p->in[j] = NULL;
    p->out_len[j] = p->in_len[j] = 0;
    p->srcs[j] = NULL;
    p->listen[j] = p->hold[j] = false;
  }
  return true;
}

/* ---- frames held back --------------------------------------------------- */

/* A held frame is a descriptor frame with no tail and no payload. */
#define HELD_FRAME_BYTES sizeof(stream_frame_head_t)

bool tcc__stream_held_alloc(tcc__coll_scratch_t *sc, int n) {
  sc->held_space = TCC_STREAM_HOLD_MAX * HELD_FRAME_BYTES;
  sc->held = malloc((size_t)n * sc->held_space);
  sc->held_bytes = calloc((size_t)n, sizeof *sc->held_bytes);
  return sc->held && sc->held_bytes;
}

static uint8_t *held_of(const tcc__coll_scratch_t *sc, int peer) { return sc->held + (size_t)peer * sc->held_space; }

static void note_held(tcc_comm_t *comm, tcc__coll_scratch_t *sc) {
  bool any = false;
  for (int j = 0; j < comm->size && !any; j++) any = sc->held_bytes[j] > 0;
  atomic_store_explicit(&sc->held_any, any, memory_order_relaxed);
}

/* This op's frame to peer (its link just set up): held back where f says
 * it may be and there is room; else the frames held for peer go first. */
static void hold_or_release(stream_xfer_t *x, tcc__coll_scratch_t *sc, const stream_frames_t *f, int peer) {
  stream_link_t *l = &x->links[peer];
  if (!sc->held) return;
  size_t *held = &sc->held_bytes[peer];
  if (f->hold && f->hold[peer] && l->out_raw == HELD_FRAME_BYTES && *held + HELD_FRAME_BYTES <= sc->held_space) {
    memcpy(held_of(sc, peer) + *held, l->out_ptr, HELD_FRAME_BYTES);
    *held += HELD_FRAME_BYTES;
    sc->held_frames++;
    l->out_raw = 0;
    return;
  }
  l->out_pre = held_of(sc, peer);
  l->pre_len = *held;
}

/* stream_xfer_t.before_wait: a rank that waits holds nothing back. */
static void release_before_wait(stream_xfer_t *x) {
  tcc__coll_scratch_t *sc = coll_scratch_of(x->comm);
  for (int j = 0; j < x->comm->size; j++) {
    stream_link_t *l = &x->links[j];
    if (j == x->comm->rank || l->pre_len || !sc->held_bytes[j]) continue;
    l->out_pre = held_of(sc, j);
    l->pre_len = sc->held_bytes[j];
    l->pre_done = 0;
  }
}

/* What went out of the held frames in the transfer is no longer held
 * (and the links no longer send it). */
static void held_sent(stream_xfer_t *x, tcc__coll_scratch_t *sc) {
  if (!sc->held) return;
  for (int j = 0; j < x->comm->size; j++) {
    stream_link_t *l = &x->links[j];
    if (j == x->comm->rank || !l->pre_len) continue;
    const size_t left = sc->held_bytes[j] - l->pre_done;
    memmove(held_of(sc, j), held_of(sc, j) + l->pre_done, left);
    sc->held_bytes[j] = left;
    l->out_pre = NULL;
    l->pre_len = l->pre_done = 0;
  }
  note_held(x->comm, sc);
}

/* Before this rank fails its communicator for a disagreement (which ends
 * its connections): what it held goes out first, so that its peers find
 * the disagreement themselves, not only the connection's end. */
static void send_held_before_failing(stream_xfer_t *x) {
  tcc__coll_scratch_t *sc = coll_scratch_of(x->comm);
  if (!sc->held) return;
  held_sent(x, sc);
  tcc__stream_frames_send_held(x->comm, 0);
}

bool tcc__stream_frames_send_held(tcc_comm_t *comm, int64_t deadline) {
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  if (!sc || !sc->held) return true;
  const tcc__stream_ops_t *io = comm->ops->streams;
  bool all = true;
  for (int j = 0; j < comm->size; j++) {
    size_t done = 0, len = sc->held_bytes[j];
    while (done < len) {
      const ssize_t k = io->send(comm, j, held_of(sc, j) + done, len - done);
      if (k > 0) {
        done += (size_t)k;
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      const int64_t now = tcc__now_ns();
      if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK) || now >= deadline) break;
      const int64_t left_ms = (deadline - now) / 1000000 + 1;
      short events = POLLOUT, revents = 0;
      if (io->poll(comm, 1, &j, &events, &revents, left_ms < 100 ? (int)left_ms : 100) < 0 && errno != EINTR) break;
    }
    memmove(held_of(sc, j), held_of(sc, j) + done, len - done);
    sc->held_bytes[j] = len - done;
    all &= done == len;
  }
  note_held(comm, sc);
  return all;
}

static stream_frame_head_t *head_of(const frames_in_t *in, int peer) {
  return (stream_frame_head_t *)(in->regions + (size_t)peer * in->stride);
}

static void expect(stream_link_t *l, uint8_t *dst, size_t len) {
  l->in_ptr = dst;
  l->in_raw = len;
  l->in_slot = 0;
  l->in_done = 0;
}

static tcc_result_t malformed(const stream_xfer_t *x, int peer, tcc_err_t *err) {
  char pre[160];
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  return tcc__err_set(err, TCC_ERR_REMOTE, "%s: rank %d sent a malformed descriptor (the streams are out of step)",
                      pre, tcc__rank_label(x->comm, peer));
}

/* Where `len` bytes no one will read go (NULL: out of memory). Every
 * peer's unwanted bytes share one buffer, made at the largest size a part
 * may have, so no link's place moves while it fills. */
static uint8_t *drop_space(const stream_xfer_t *x, frames_in_t *in, size_t len, tcc_err_t *err) {
  if (len == 0) return in->regions; /* nothing is written there */
  if (!in->drop) {
    const size_t tail_max = in->desc_max - sizeof(tcc_coll_desc_t);
    in->drop = malloc(tail_max > TCC_STREAM_PAYLOAD_MAX ? tail_max : TCC_STREAM_PAYLOAD_MAX);
  }
  if (!in->drop) {
    char pre[160];
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  return in->drop;
}

/* Whether the frame coming from peer is one of an earlier op that did not
 * read it. */
static bool earlier(const frames_in_t *in, int peer) { return in->read[peer] < in->unread[peer]; }

static bool reads_op(const frames_in_t *in, int peer) { return !in->listen || in->listen[peer]; }

/* An earlier op's frame from peer, against this rank's descriptor of that
 * op. That op returned without hearing from peer, so a disagreement leaves
 * the ranks out of step. */
static tcc_result_t check_earlier(stream_xfer_t *x, const frames_in_t *in, int peer, tcc_err_t *err) {
  if (TCC_MUTANT(UNREAD_FRAMES_UNCHECKED)) return TCC_OK; /* MUTATION SITE */
  const tcc__coll_scratch_t *sc = coll_scratch_of(x->comm);
  const uint64_t k = sc->one_sided_ops - sc->unread[peer] + in->read[peer];
  const tcc_coll_desc_t *mine = &sc->one_sided_descs[k % TCC_STREAM_UNREAD_MAX];
  tcc_coll_desc_t theirs;
  memcpy(&theirs, head_of(in, peer)->desc, sizeof theirs);
  const tcc_coll_t op = {.kind = (tcc_coll_kind_t)mine->kind};
  if (tcc__coll_desc_check_peer(x->comm, &op, mine, &theirs, peer, err) == TCC_OK) return TCC_OK;
  char pre[160], why[TCC_ERRLEN];
  snprintf(why, sizeof why, "%s", err->msg);
  tcc__err_reset(err);
  tcc__stream_xfer_prefix(x, pre, sizeof(pre));
  send_held_before_failing(x);
  return tcc__coll_out_of_step(x->comm, err,
                               "%s: rank %d's frame of %s #%llu, which this rank ran without waiting for it, "
                               "disagrees: %s",
                               pre, tcc__rank_label(x->comm, peer), tcc__coll_name(op.kind),
                               (unsigned long long)mine->seq, why);
}

/* stream_in_next_fn: the head says how long the tail and payload are. */
static tcc_result_t next_part(stream_xfer_t *x, int peer, tcc_err_t *err) {
  frames_in_t *in = x->in_next_ctx;
  stream_link_t *l = &x->links[peer];
  const stream_frame_head_t *h = head_of(in, peer);
  switch (in->part[peer]++) {
    case PART_HEAD: {
      if (h->magic != FRAME_MAGIC || h->desc_len < sizeof(tcc_coll_desc_t) || h->desc_len > in->desc_max ||
          h->payload > TCC_STREAM_PAYLOAD_MAX)
        return malformed(x, peer, err);
      const size_t tail = h->desc_len - sizeof(tcc_coll_desc_t);
      /* Another tail length means another kind of op: the check fails on the
       * kind before it reads any tail. An earlier op (a rooted one) has none. */
      uint8_t *dst = tail == in->tail_len && !earlier(in, peer) ? (uint8_t *)(h + 1) : drop_space(x, in, tail, err);
      if (!dst) return TCC_ERR_SYSTEM;
      expect(l, dst, tail);
      return TCC_OK;
    }
    case PART_TAIL: {
      const stream_frames_t *f = in->f;
      const bool wanted = !earlier(in, peer) && f->in && f->in[peer] && f->in_len[peer] == h->payload;
      uint8_t *dst = wanted ? f->in[peer] : drop_space(x, in, h->payload, err);
      if (!dst) return TCC_ERR_SYSTEM;
      expect(l, dst, h->payload);
      return TCC_OK;
    }
    default:
      if (earlier(in, peer)) {
        tcc_result_t r = check_earlier(x, in, peer, err);
        if (r != TCC_OK) return r;
        in->read[peer]++;
        if (earlier(in, peer) || reads_op(in, peer)) { /* the next frame */
          in->part[peer] = PART_HEAD;
          expect(l, (uint8_t *)head_of(in, peer), sizeof(stream_frame_head_t));
          return TCC_OK;
        }
      }
      l->in_closed = true;
      return TCC_OK;
  }
}

/* Exactly len bytes from peer into dst (NULL: read and dropped), by the
 * deadline; false if the stream ends, fails or the deadline passes. */
static bool settle_read(tcc_comm_t *comm, int peer, void *dst, size_t len, int64_t deadline) {
  const tcc__stream_ops_t *io = comm->ops->streams;
  uint8_t dropped[4096];
  while (len) {
    const size_t want = dst ? len : (len < sizeof dropped ? len : sizeof dropped);
    const ssize_t k = io->recv(comm, peer, dst ? dst : dropped, want);
    if (k > 0) {
      len -= (size_t)k;
      if (dst) dst = (uint8_t *)dst + k;
      continue;
    }
    if (k == 0) return false;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    const int64_t now = tcc__now_ns();
    if (now >= deadline) return false;
    const int64_t left_ms = (deadline - now) / 1000000 + 1;
    short events = POLLIN, revents = 0;
    if (io->poll(comm, 1, &peer, &events, &revents, left_ms < 100 ? (int)left_ms : 100) < 0 && errno != EINTR)
      return false;
  }
  return true;
}

void tcc__stream_frames_settle(tcc_comm_t *comm, int64_t deadline) {
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  if (!sc || !sc->unread) return;
  /* what this rank held back first: its peers' settle reads it */
  tcc__stream_frames_send_held(comm, deadline);
  const size_t desc_max = tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, comm->size);
  for (int j = 0; j < comm->size; j++) {
    for (; j != comm->rank && sc->unread[j] > 0; sc->unread[j]--) {
      stream_frame_head_t h;
      if (!settle_read(comm, j, &h, sizeof h, deadline) || h.magic != FRAME_MAGIC ||
          h.desc_len < sizeof(tcc_coll_desc_t) || h.desc_len > desc_max || h.payload > TCC_STREAM_PAYLOAD_MAX)
        break;
      if (!settle_read(comm, j, NULL, h.desc_len - sizeof(tcc_coll_desc_t) + h.payload, deadline)) break;
    }
  }
}

/* After a one-sided op: its descriptor is kept, and one more frame from
 * every peer it did not listen to is waiting. */
static void record_one_sided(tcc_comm_t *comm, const bool *listen, const void *mine) {
  tcc__coll_scratch_t *sc = coll_scratch_of(comm);
  memcpy(&sc->one_sided_descs[sc->one_sided_ops++ % TCC_STREAM_UNREAD_MAX], mine, sizeof(tcc_coll_desc_t));
  for (int j = 0; j < comm->size; j++)
    if (j != comm->rank && !listen[j]) sc->unread[j]++;
}

/* A one-sided op: each frame read against this rank's descriptor. */
static tcc_result_t check_listened(stream_xfer_t *x, const tcc_coll_t *c, const frames_in_t *in, tcc_err_t *err) {
  const int me = x->comm->rank;
  tcc_coll_desc_t mine, theirs;
  memcpy(&mine, head_of(in, me)->desc, sizeof mine);
  for (int j = 0; j < x->comm->size; j++) {
    if (j == me || !in->listen[j]) continue;
    memcpy(&theirs, head_of(in, j)->desc, sizeof theirs);
    if (tcc__coll_desc_check_peer(x->comm, c, &mine, &theirs, j, err) == TCC_OK) continue;
    char why[TCC_ERRLEN];
    snprintf(why, sizeof why, "%s", err->msg);
    tcc__err_reset(err);
    send_held_before_failing(x);
    return tcc__coll_out_of_step(x->comm, err, "%s", why); /* its senders went on */
  }
  return TCC_OK;
}

tcc_result_t tcc__stream_frames_exchange(stream_xfer_t *x, const tcc_coll_t *c, const stream_frames_t *f,
                                         int64_t deadline, uint64_t *send_matrix, tcc_err_t *err) {
  const int n = x->comm->size, me = x->comm->rank;
  const size_t head = sizeof(tcc_coll_desc_t), mine_len = tcc__coll_desc_bytes(c->kind, n);
  frames_in_t in = {.f = f,
                    .stride = sizeof(stream_frame_head_t) + mine_len - head,
                    .tail_len = mine_len - head,
                    .desc_max = tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, n)};
  in.stride = (in.stride + 7) & ~(size_t)7; /* every region's head 8-byte aligned */
  /* regions, then the descriptors' addresses, the earlier frames to read
   * and read, then each frame's part */
  uint8_t *mem = calloc(1, (size_t)n * (in.stride + sizeof(void *) + 2 * sizeof(uint16_t) + 1));
  if (!mem) {
    char pre[160];
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  in.regions = mem;
  const void **descs = (const void **)(mem + (size_t)n * in.stride);
  in.unread = (uint16_t *)(descs + n);
  in.read = in.unread + n;
  in.part = (uint8_t *)(in.read + n);
  in.listen = f->listen;
  tcc__coll_scratch_t *sc = coll_scratch_of(x->comm);
  /* this rank's own frame head and tail, for the check */
  tcc__coll_desc_fill(c, x->seq, n, head_of(&in, me)->desc);

  x->phase = "descriptor exchange";
  memset(x->links, 0, (size_t)n * sizeof(*x->links));
  for (int j = 0; j < n; j++) {
    descs[j] = head_of(&in, j)->desc;
    if (j == me) continue;
    x->links[j] = (stream_link_t){.out_ptr = f->out[j], .out_raw = f->out_len[j]};
    hold_or_release(x, sc, f, j);
    /* A peer this op does not listen to: its earlier frames are read only
     * when as many as a stream may hold wait (TCC_STREAM_UNREAD_MAX). */
    const uint16_t unread = sc->unread ? sc->unread[j] : 0;
    in.unread[j] = !reads_op(&in, j) && unread < TCC_STREAM_UNREAD_MAX ? 0 : unread;
    if (in.unread[j] || reads_op(&in, j)) expect(&x->links[j], (uint8_t *)head_of(&in, j), sizeof(stream_frame_head_t));
    else x->links[j].in_closed = true;
  }
  x->in_next = next_part;
  x->in_next_ctx = &in;
  x->before_wait = sc->held ? release_before_wait : NULL;
  tcc_result_t r = tcc__stream_xfer_run(x, deadline, err);
  x->in_next = NULL;
  x->in_next_ctx = NULL;
  x->before_wait = NULL;
  held_sent(x, sc);
  if (sc->unread)
    for (int j = 0; j < n; j++) sc->unread[j] = (uint16_t)(sc->unread[j] - in.read[j]);
  if (r == TCC_OK) r = f->listen ? check_listened(x, c, &in, err) : tcc__coll_desc_check(x->comm, c, descs, err);
  if (r == TCC_OK && f->listen) record_one_sided(x->comm, f->listen, head_of(&in, me)->desc);

  if (r == TCC_OK && send_matrix && c->kind == TCC_COLL_ALLTOALL)
    for (int j = 0; j < n; j++) /* the counts the check read, in whichever form a peer sent */
      for (int k = 0; k < n; k++) send_matrix[(size_t)j * (size_t)n + (size_t)k] = tcc__coll_desc_sends(descs[j], k);
  free(in.drop);
  free(mem);
  return r;
}
