/*
 * stream_frames.c - the descriptor frames of collectives over streams
 * (stream_frames.h): one exchange with every peer at once, each incoming
 * frame taken in three parts (head, descriptor tail, payload), each part's
 * length and place decided when the one before it is in.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/stream_frames.h"
#include "core/copy.h"

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
  const size_t tables = (size_t)n * (2 * sizeof(uint8_t *) + 2 * sizeof(size_t) + sizeof(void *));
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
  for (int j = 0; j < n; j++) {
    p->out[j] = p->in[j] = NULL;
    p->out_len[j] = p->in_len[j] = 0;
    p->srcs[j] = NULL;
  }
  return true;
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
       * kind before it reads any tail. */
      uint8_t *dst = tail == in->tail_len ? (uint8_t *)(h + 1) : drop_space(x, in, tail, err);
      if (!dst) return TCC_ERR_SYSTEM;
      expect(l, dst, tail);
      return TCC_OK;
    }
    case PART_TAIL: {
      const stream_frames_t *f = in->f;
      const bool wanted = f->in && f->in[peer] && f->in_len[peer] == h->payload;
      uint8_t *dst = wanted ? f->in[peer] : drop_space(x, in, h->payload, err);
      if (!dst) return TCC_ERR_SYSTEM;
      expect(l, dst, h->payload);
      return TCC_OK;
    }
    default:
      l->in_closed = true;
      return TCC_OK;
  }
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
  /* regions, then the descriptors' addresses, then each frame's part */
  uint8_t *mem = calloc(1, (size_t)n * (in.stride + sizeof(void *) + 1));
  if (!mem) {
    char pre[160];
    tcc__stream_xfer_prefix(x, pre, sizeof(pre));
    return tcc__err_set(err, TCC_ERR_SYSTEM, "%s: out of memory", pre);
  }
  in.regions = mem;
  const void **descs = (const void **)(mem + (size_t)n * in.stride);
  in.part = (uint8_t *)(descs + n);
  /* this rank's own frame head and tail, for the check */
  tcc__coll_desc_fill(c, x->seq, n, head_of(&in, me)->desc);

  x->phase = "descriptor exchange";
  memset(x->links, 0, (size_t)n * sizeof(*x->links));
  for (int j = 0; j < n; j++) {
    descs[j] = head_of(&in, j)->desc;
    if (j == me) continue;
    x->links[j] = (stream_link_t){.out_ptr = f->out[j], .out_raw = f->out_len[j]};
    expect(&x->links[j], (uint8_t *)head_of(&in, j), sizeof(stream_frame_head_t));
  }
  x->in_next = next_part;
  x->in_next_ctx = &in;
  tcc_result_t r = tcc__stream_xfer_run(x, deadline, err);
  x->in_next = NULL;
  x->in_next_ctx = NULL;
  if (r == TCC_OK) r = tcc__coll_desc_check(x->comm, c, descs, err);
  if (r == TCC_OK && send_matrix && c->kind == TCC_COLL_ALLTOALL)
    for (int j = 0; j < n; j++) /* the counts the check read, in whichever form a peer sent */
      for (int k = 0; k < n; k++) send_matrix[(size_t)j * (size_t)n + (size_t)k] = tcc__coll_desc_sends(descs[j], k);
  free(in.drop);
  free(mem);
  return r;
}
