/*
 * gen_corpus.c - writes the seed corpus of every fuzz target into
 * tests/fuzz/corpus/<name>/ (make fuzz-corpus). Valid inputs are built
 * with the core's own functions where it has them and checked against the
 * core's own checks, so a layout change that breaks a seed fails here
 * rather than silently leaving the fuzzers without a valid starting point.
 * Near-valid inputs differ from a valid one in a single field.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_ring.h"
#include "coll/coll.h"
#include "coll/stream_frames.h"
#include "host/p2p_frame.h"
#include "transport/shm/shm.h"
#include "transport/tcp/tcp.h"
#include "window/window.h"

typedef struct out {
  uint8_t buf[16384];
  size_t len;
} out_t;

static void put(out_t *o, const void *p, size_t n) {
  assert(o->len + n <= sizeof o->buf);
  memcpy(o->buf + o->len, p, n);
  o->len += n;
}
static void put8(out_t *o, uint8_t v) { put(o, &v, 1); }

/* Where the seeds go: tests/fuzz/corpus, or the directory given as the
 * first argument (the fuzz target's check that the committed seeds are
 * what this program makes). */
static const char *out_root = "tests/fuzz/corpus";

static void save(const char *target, const char *name, const out_t *o) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s/%s", out_root, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(o->buf, 1, o->len, f) != o->len) {
    fprintf(stderr, "gen_corpus: cannot write %s (run from csrc/c_core, directories made)\n", path);
    exit(1);
  }
  fclose(f);
}

/* ---- endpoint blobs ---- */

static void blob(out_t *o, const char *host, uint32_t magic, uint64_t shm_dev) {
  uint8_t raw[TCC_ENDPOINT_BLOB_SIZE] = {0};
  tcc_blob_t b = {.magic = magic, .pid = 100, .port = 29500, .ipv4 = 0x0100007f, .shm_dev = shm_dev, .shm_ino = 7};
  memset(b.token, 0x5a, sizeof b.token);
  snprintf(b.hostname, sizeof b.hostname, "%s", host);
  snprintf(b.boot_id, sizeof b.boot_id, "00000000-0000-0000-0000-000000000001");
  if (!strcmp(host, "unterminated")) memset(b.hostname, 'x', sizeof b.hostname);
  memcpy(raw, &b, sizeof b);
  put(o, raw, sizeof raw);
}

static void gen_blob(void) {
  const struct {
    const char *name, *host1;
    uint8_t want;
    uint32_t magic1;
    uint64_t dev1;
  } seeds[] = {
      {"same-host-auto", "host-a", 0, TCC_BLOB_MAGIC, 3},     {"two-hosts-auto", "host-b", 0, TCC_BLOB_MAGIC, 3},
      {"two-hosts-shm", "host-b", 1, TCC_BLOB_MAGIC, 3},      {"other-shm-dir", "host-a", 0, TCC_BLOB_MAGIC, 4},
      {"bad-magic", "host-a", 2, TCC_BLOB_MAGIC ^ 1, 3},      {"unterminated-host", "unterminated", 0, TCC_BLOB_MAGIC, 3},
  };
  for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
    out_t o = {.len = 0};
    put8(&o, 1); /* two ranks */
    put8(&o, seeds[i].want);
    blob(&o, "host-a", TCC_BLOB_MAGIC, 3);
    blob(&o, seeds[i].host1, seeds[i].magic1, seeds[i].dev1);
    save("blob", seeds[i].name, &o);
  }
  /* Two ranks share a host, the third is elsewhere: auto picks hybrid. */
  out_t o = {.len = 0};
  put8(&o, 2); /* three ranks */
  put8(&o, 0);
  blob(&o, "host-a", TCC_BLOB_MAGIC, 3);
  blob(&o, "host-b", TCC_BLOB_MAGIC, 3);
  blob(&o, "host-b", TCC_BLOB_MAGIC, 3);
  save("blob", "hybrid-auto", &o);
}

/* ---- TCP handshake ---- */

static void gen_tcp_hello(void) {
  const struct {
    const char *name;
    uint32_t magic, rank, chan, size;
    uint8_t claim;
  } seeds[] = {
      {"hello", TCP_HELLO_MAGIC, 2, 1, 4, 0},     {"ack", TCP_ACK_MAGIC, 0, 1, 4, 0},
      {"hello-rank-too-big", TCP_HELLO_MAGIC, 4, 0, 4, 0}, {"hello-bad-chan", TCP_HELLO_MAGIC, 3, 2, 4, 0},
      {"hello-claimed", TCP_HELLO_MAGIC, 2, 1, 4, 1},      {"hello-lower-rank", TCP_HELLO_MAGIC, 0, 0, 4, 0},
  };
  uint8_t token[TCC_TOKEN_BYTES];
  memset(token, 0x11, sizeof token);
  for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++) {
    out_t o = {.len = 0};
    put8(&o, 3); /* n = 4 */
    put8(&o, 1); /* me */
    put8(&o, 0); /* the ack is expected from rank 0 ... */
    put8(&o, 1); /* ... on the p2p channel */
    for (int k = 0; k < 8; k++) put8(&o, seeds[i].claim && k == 2 * 2 + 1);
    put(&o, token, sizeof token);
    tcp_hello_t h = {seeds[i].magic, seeds[i].rank, seeds[i].chan, seeds[i].size, {0}};
    memcpy(h.token, token, sizeof token);
    put(&o, &h, sizeof h);
    save("tcp_hello", seeds[i].name, &o);
  }
}

/* ---- collective descriptors ---- */

static void coll_seed(const char *name, int n, tcc_coll_kind_t kind, uint64_t bad_rank_seq, size_t bad_split) {
  size_t sends[3][3] = {{1, 2, 3}, {4, 5, 6}, {7, 8, 9}}, recvs[3][3];
  for (int j = 0; j < 3; j++)
    for (int k = 0; k < 3; k++) recvs[k][j] = sends[j][k];
  out_t o = {.len = 0};
  put8(&o, (uint8_t)(n - 1));
  put8(&o, 1);
  put8(&o, (uint8_t)(kind - TCC_COLL_BROADCAST));
  for (int r = 0; r < n; r++) {
    tcc_coll_t c = {.kind = kind, .dtype = TCC_FLOAT32, .redop = TCC_SUM, .root = 0, .count = 10,
                    .send_counts = sends[r], .recv_counts = recvs[r]};
    uint8_t d[256] = {0};
    size_t len = tcc__coll_desc_bytes(kind, n);
    assert(len <= sizeof d);
    tcc__coll_desc_fill(&c, r == 2 ? bad_rank_seq : 5, n, d);
    if (bad_split && r == 2) d[sizeof(tcc_coll_desc_t)] ^= 1;
    put(&o, d, len);
  }
  save("coll_desc", name, &o);
}

/* An all-to-all where rank 0's counts are all 2 (the short form, as
 * shared memory publishes it) and the others' are listed. */
static void coll_seed_short(const char *name) {
  enum { N = 3 };
  size_t sends[N][N], recvs[N][N];
  for (int j = 0; j < N; j++)
    for (int k = 0; k < N; k++) sends[j][k] = j == 0 || k == 0 ? 2 : 1 + (size_t)((j + k) & 1);
  for (int j = 0; j < N; j++)
    for (int k = 0; k < N; k++) recvs[k][j] = sends[j][k];
  out_t o = {.len = 0};
  put8(&o, N - 1);
  put8(&o, 1);
  put8(&o, (uint8_t)(TCC_COLL_ALLTOALL - TCC_COLL_BROADCAST));
  for (int r = 0; r < N; r++) {
    tcc_coll_t c = {.kind = TCC_COLL_ALLTOALL, .dtype = TCC_FLOAT32, .send_counts = sends[r], .recv_counts = recvs[r]};
    uint8_t d[256] = {0};
    tcc__coll_desc_fill_short(&c, 5, N, d);
    put(&o, d, tcc__coll_desc_bytes(TCC_COLL_ALLTOALL, N));
  }
  save("coll_desc", name, &o);
}

static void gen_coll_desc(void) {
  coll_seed_short("alltoall-short-and-listed");
  coll_seed("allreduce", 3, TCC_COLL_ALLREDUCE, 5, 0);
  coll_seed("broadcast", 3, TCC_COLL_BROADCAST, 5, 0);
  coll_seed("alltoall", 3, TCC_COLL_ALLTOALL, 5, 0);
  coll_seed("alltoall-split-mismatch", 3, TCC_COLL_ALLTOALL, 5, 1);
  coll_seed("allreduce-seq-mismatch", 3, TCC_COLL_ALLREDUCE, 6, 0);
}

/* ---- descriptor frames over streams ---- */

/* One peer's frame, as tcc__stream_frame_fill writes it, with its u16 length first. */
typedef struct frame_spec {
  tcc_coll_kind_t kind;
  uint8_t count, payload;
  int corrupt; /* flips a bit of the magic */
} frame_spec_t;

/* Rank `me` of n expects `expect` payload bytes from each peer; every peer
 * sends `usual`, peer `odd` sends `other` (a mismatch, or a malformed head). */
static void frames_seed(const char *name, int n, int me, frame_spec_t usual, uint8_t expect, int odd,
                        frame_spec_t other) {
  out_t o = {.len = 0};
  put8(&o, (uint8_t)(n - 2));
  put8(&o, (uint8_t)me);
  put8(&o, (uint8_t)(usual.kind - TCC_COLL_BROADCAST));
  put8(&o, usual.count);
  put8(&o, 6); /* pieces of 7 bytes: every part arrives split */
  for (int j = 0; j < n; j++) put8(&o, j == me ? 0 : expect);
  for (int j = 0; j < n; j++) {
    if (j == me) {
      put(&o, "\0\0", 2);
      continue;
    }
    const frame_spec_t fs = j == odd ? other : usual;
    size_t counts[4];
    for (int k = 0; k < 4; k++) counts[k] = fs.count;
    const tcc_coll_t c = {.kind = fs.kind, .dtype = TCC_FLOAT32, .redop = TCC_SUM, .count = fs.count,
                          .send_counts = counts, .recv_counts = counts};
    uint8_t data[256], frame[1024];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 7 + j);
    const size_t len = tcc__stream_frame_bytes(&c, n, fs.payload);
    assert(len <= sizeof frame);
    tcc__stream_frame_fill(&c, 9, n, data, fs.payload, frame);
    if (fs.corrupt) frame[0] ^= 1;
    const uint8_t l16[2] = {(uint8_t)len, (uint8_t)(len >> 8)};
    put(&o, l16, 2);
    put(&o, frame, len);
  }
  save("stream_frames", name, &o);
}

/* Rank 0 of 2, the root of `earlier` one-sided broadcasts of 4 elements
 * (#6 ..) before this allreduce (#9): its peer's frames of those come
 * first, the first of them naming root `root_of_first`. deaf_to: the
 * peers this op, one-sided too, does not listen to (bit j: peer j). */
static void earlier_seed(const char *name, int earlier, int root_of_first, uint8_t deaf_to) {
  out_t o = {.len = 0};
  put8(&o, 0); /* 2 ranks */
  put8(&o, 0); /* rank 0 */
  put8(&o, (uint8_t)(TCC_COLL_ALLREDUCE - TCC_COLL_BROADCAST));
  put8(&o, 4);
  put8(&o, 6);
  put8(&o, 0);
  put8(&o, 16); /* the allreduce's payload from rank 1 */
  put(&o, "\0\0", 2);
  uint8_t stream[1024], data[16];
  size_t len = 0;
  for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 5 + 1);
  for (int k = 0; k < earlier; k++) {
    const tcc_coll_t b = {.kind = TCC_COLL_BROADCAST, .dtype = TCC_FLOAT32, .count = 4, .root = k ? 0 : root_of_first};
    tcc__stream_frame_fill(&b, (uint64_t)(9 - earlier + k), 2, NULL, 0, stream + len);
    len += tcc__stream_frame_bytes(&b, 2, 0);
  }
  const tcc_coll_t a = {.kind = TCC_COLL_ALLREDUCE, .dtype = TCC_FLOAT32, .redop = TCC_SUM, .count = 4};
  tcc__stream_frame_fill(&a, 9, 2, data, sizeof data, stream + len);
  len += tcc__stream_frame_bytes(&a, 2, sizeof data);
  assert(len <= sizeof stream);
  const uint8_t l16[2] = {(uint8_t)len, (uint8_t)(len >> 8)};
  put(&o, l16, 2);
  put(&o, stream, len);
  put8(&o, (uint8_t)earlier);
  put8(&o, deaf_to);
  save("stream_frames", name, &o);
}

static void gen_stream_frames(void) {
  const frame_spec_t none = {TCC_COLL_BARRIER, 0, 0, 0};
  frames_seed("allreduce", 2, 0, (frame_spec_t){TCC_COLL_ALLREDUCE, 2, 8, 0}, 8, -1, none);
  frames_seed("allgather-3", 3, 1, (frame_spec_t){TCC_COLL_ALLGATHER, 5, 20, 0}, 20, -1, none);
  frames_seed("alltoall-4", 4, 2, (frame_spec_t){TCC_COLL_ALLTOALL, 3, 0, 0}, 0, -1, none);
  /* an all-to-all's small blocks in the frames, and one of another length */
  frames_seed("alltoall-blocks-4", 4, 1, (frame_spec_t){TCC_COLL_ALLTOALL, 3, 12, 0}, 12, -1, none);
  frames_seed("alltoall-block-length", 3, 0, (frame_spec_t){TCC_COLL_ALLTOALL, 3, 12, 0}, 12, 2,
              (frame_spec_t){TCC_COLL_ALLTOALL, 4, 16, 0});
  frames_seed("barrier", 3, 0, none, 0, -1, none);
  frames_seed("count-mismatch", 3, 0, (frame_spec_t){TCC_COLL_ALLREDUCE, 4, 16, 0}, 16, 2,
              (frame_spec_t){TCC_COLL_ALLREDUCE, 5, 20, 0});
  frames_seed("bad-magic", 2, 1, (frame_spec_t){TCC_COLL_BROADCAST, 4, 16, 0}, 16, 0,
              (frame_spec_t){TCC_COLL_BROADCAST, 4, 16, 1});
  /* an unexpected tail, then a longer unexpected payload: both dropped */
  frames_seed("drop-tail-then-payload", 3, 2, (frame_spec_t){TCC_COLL_ALLREDUCE, 50, 200, 0}, 8, 0,
              (frame_spec_t){TCC_COLL_ALLTOALL, 2, 0, 0});
  /* the frames of earlier one-sided ops first: agreeing, one naming
   * another root, and an op that reads none of them */
  earlier_seed("earlier-one-sided", 3, 0, 0);
  earlier_seed("earlier-root-mismatch", 2, 1, 0);
  earlier_seed("earlier-send-only", 1, 0, 2);
}

/* ---- shared-memory transport header ---- */

static uint64_t align_to(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* The layout shm_setup.c lays out, recomputed; the check below proves it right. */
static void shm_layout(shm_header_t *h, int n, uint64_t window, uint64_t slot_bytes) {
  memset(h, 0, sizeof *h);
  h->size = (uint32_t)n;
  h->window = window;
  h->small_bytes = window < 32768 ? window : 32768;
  h->ring_bytes = n <= 4 ? (1u << 20) : align_to((4u << 20) / (uint64_t)n, 4096);
  if (h->ring_bytes < (64u << 10)) h->ring_bytes = 64u << 10;
  h->slot_bytes = slot_bytes;
  h->desc_stride = align_to(SHM_DESC_OFFSET + tcc__coll_spans_desc_bytes(n), TCC_CACHELINE);
  h->ctrl_off = TCC_SEGMENT_HEAD_BYTES;
  h->desc_off = align_to(h->ctrl_off + (uint64_t)n * sizeof(shm_rank_ctrl_t), TCC_CACHELINE);
  h->data_off = align_to(h->desc_off + (uint64_t)n * 2 * h->desc_stride, 4096);
  h->ring_off = h->data_off + (uint64_t)n * 4 * window;
  h->slots_off = h->ring_off + (uint64_t)n * n * align_to(sizeof(shm_ring_t) + h->ring_bytes, 4096);
  h->seg.total_bytes = h->slots_off + (slot_bytes ? align_to(n * (TCC_CACHELINE + SHM_SLOTS * slot_bytes), 4096) : 0);
}

static void shm_seed(const char *name, int n, uint64_t window, uint64_t slot_bytes, int broken_field) {
  shm_header_t h;
  shm_layout(&h, n, window, slot_bytes);
  h.slot_span_bytes = slot_bytes ? tcc__coll_slot_span_capacity(SHM_SLOTS, slot_bytes) : 0; /* the default */
  tcc_err_t err = {TCC_OK, {0}};
  if (tcc__shm_check_header(&h, n, h.seg.total_bytes, "gen", &err) != TCC_OK) {
    fprintf(stderr, "gen_corpus: %s\n", err.msg);
    exit(1);
  }
  if (broken_field == 1) h.data_off += 4096;
  if (broken_field == 2) h.small_bytes = window + 1;
  if (broken_field == 3) h.slot_bytes += 8;
  if (broken_field == 4) h.slot_span_bytes = tcc__coll_slot_span_capacity(SHM_SLOTS, slot_bytes) + 1;
  out_t o = {.len = 0};
  uint16_t n16 = (uint16_t)(n - 1);
  uint64_t bytes = h.seg.total_bytes;
  put(&o, &n16, sizeof n16);
  put(&o, &bytes, sizeof bytes);
  put(&o, &h, sizeof h);
  save("shm_header", name, &o);
}

static void gen_shm_header(void) {
  shm_seed("two-ranks", 2, 512 * 1024, 0, 0);
  shm_seed("five-ranks-small-window", 5, 4096, 0, 0);
  shm_seed("three-ranks-slots", 3, 512 * 1024, 512, 0);
  shm_seed("bad-data-off", 2, 512 * 1024, 0, 1);
  shm_seed("small-over-window", 2, 4096, 0, 2);
  shm_seed("slot-not-whole-lines", 2, 4096, 512, 3);
  shm_seed("span-past-ring", 2, 4096, 512, 4);
}

/* ---- windows ---- */

static void window_seed(const char *name, uint64_t b0, uint64_t b1, int broken) {
  win_hello_t hellos[2] = {{b0, {0}}, {b1, {0}}};
  size_t off[2], bytes[2];
  tcc_window_t win = {.rank = 1, .size = 2, .off = off, .bytes = bytes};
  tcc_err_t err = {TCC_OK, {0}};
  win_header_t h;
  memset(&h, 0, sizeof h);
  if (tcc__window_check_hellos(&win, hellos, &err) == TCC_OK) {
    tcc__window_layout(&win, hellos);
    h.size = 2;
    h.ctrl_stride = win.ctrl_stride;
    h.data_off = win.off[0];
    h.seg.total_bytes = win.total;
    assert(tcc__window_check_header(&win, &h, win.total, "gen", &err) == TCC_OK);
  }
  if (broken) h.ctrl_stride += 64;
  uint64_t mapped = win.total;
  out_t o = {.len = 0};
  put8(&o, 1);
  put8(&o, 1);
  put(&o, hellos, sizeof hellos);
  put(&o, &h, sizeof h);
  put(&o, &mapped, sizeof mapped);
  save("window", name, &o);
}

static void gen_window(void) {
  window_seed("two-ranks", 4096, 100, 0);
  window_seed("empty-buffer", 0, 65536, 0);
  window_seed("bad-ctrl-stride", 4096, 100, 1);
  window_seed("declined", 4096, UINT64_MAX, 0);
  window_seed("too-big", (uint64_t)1 << 47, 100, 0);
}

/* ---- segments ---- */

static void segment_seed(const char *name, uint8_t flags, uint16_t mode, uint32_t size, uint32_t state,
                         const char *reason) {
  out_t o = {.len = 0};
  put8(&o, flags);
  put(&o, &mode, sizeof mode);
  put(&o, &size, sizeof size);
  tcc_segment_head_t head;
  memset(&head, 0, sizeof head);
  atomic_store(&head.state, state);
  head.total_bytes = size;
  snprintf(head.reason, sizeof head.reason, "%s", reason);
  put(&o, &head, sizeof head);
  save("segment", name, &o);
}

static void gen_segment(void) {
  /* flags: 1 secret, 2 ready, 4 total = size, 8 reserve, mode in bits 4-5 */
  segment_seed("ready-one-page", 0x0f, 0, 4096, 0, "");
  segment_seed("ready-two-pages", 0x0f, 0, 8192, 0, "");
  segment_seed("wrong-secret", 0x0e, 0, 4096, 0, "");
  segment_seed("not-reserved", 0x07, 0, 8192, 0, "");
  segment_seed("failed", 0x0d, 0, 4096, 0x7463666cu, "no room"); /* the state shm_segment.c writes on failure */
  segment_seed("no-room-mode", 0x1f, 0, 8192, 0, "");
  segment_seed("group-readable", 0x2f, 0, 4096, 0, "");
  segment_seed("short", 0x0f, 0, 100, 0, "");
  segment_seed("not-ready", 0x0d, 0, 4096, 0, "");
}

/* ---- point-to-point frame headers ---- */

/* A stream of three frames of `kind`, each with a reference after it, the
 * last one damaged (`broken_field`: 1 its magic, 2 its length but not its
 * check word, 3 an impossible length, 4 the reference's address but not
 * its check word, 5 a done frame with a length). */
static void frame_seed(const char *name, tcc_p2p_kind_t kind, uint64_t tag, uint64_t bytes, int broken_field) {
  out_t o = {.len = 0};
  tcc_p2p_frame_t f;
  tcc_p2p_ref_t r;
  for (int i = 0; i < 3; i++) {
    tcc__p2p_frame_make(&f, kind, tag + (uint64_t)i, kind == TCC_P2P_DONE ? 0 : bytes);
    tcc__p2p_ref_make(&r, 0x7f0000001000ull + (uint64_t)i * 4096, tag + (uint64_t)i);
    if (i == 2 && broken_field == 1) f.magic ^= 1;
    if (i == 2 && broken_field == 2) f.bytes += 1;
    if (i == 2 && broken_field == 3) tcc__p2p_frame_make(&f, kind, tag, TCC_P2P_FRAME_MAX_BYTES + 1);
    if (i == 2 && broken_field == 4) r.addr += 8;
    if (i == 2 && broken_field == 5) tcc__p2p_frame_make(&f, TCC_P2P_DONE, tag, 8);
    put(&o, &f, sizeof f);
    put(&o, &r, sizeof r);
  }
  save("p2p_frame", name, &o);
}

static void gen_p2p_frame(void) {
  frame_seed("valid", TCC_P2P_DATA, 7, 1024, 0);
  frame_seed("empty-payloads", TCC_P2P_DATA, 0, 0, 0);
  frame_seed("bad-magic", TCC_P2P_DATA, 7, 1024, 1);
  frame_seed("damaged-length", TCC_P2P_DATA, 7, 1024, 2);
  frame_seed("impossible-length", TCC_P2P_DATA, 7, 1024, 3);
  frame_seed("references", TCC_P2P_REF, 7, 1 << 20, 0);
  frame_seed("damaged-reference", TCC_P2P_REF, 7, 1 << 20, 4);
  frame_seed("dones", TCC_P2P_DONE, 40, 0, 0);
  frame_seed("done-with-length", TCC_P2P_DONE, 40, 0, 5);
}

/* ---- shared-memory ring records ---- */

/* A ring whose writer wrote records of `sizes` (0-ended) from line
 * `start_line` on, one header then damaged (`broken`: 1 its mark, 2 a
 * length of 0, 3 a length past the ring), then reads of `reads` bytes
 * (0-ended). */
static void ring_seed(const char *name, uint8_t start_line, const size_t *sizes, int broken, const uint16_t *reads) {
  fake_ring_t *w = fake_ring_new(1);
  assert(w);
  shm_ring_t *ring = shm_ring_of(&w->st, 1, 0);
  const uint64_t start = (uint64_t)start_line * 64;
  atomic_store(&ring->head, start);
  atomic_store(&ring->tail, start);
  w->tail_seen[0] = start;
  uint8_t msg[2048];
  uint64_t second = 0;
  for (int i = 0; sizes[i]; i++) {
    if (i == 1) second = atomic_load(&ring->head);
    for (size_t k = 0; k < sizes[i]; k++) msg[k] = (uint8_t)(k + 13 * (size_t)i);
    const struct iovec iov = {msg, sizes[i]};
    tcc_err_t err = {TCC_OK, {0}};
    assert(tcc__shm_p2p_write(&w->comm, 0, &iov, 1, &err) == (ssize_t)sizes[i]);
  }
  _Atomic uint64_t *h = (_Atomic uint64_t *)(void *)(ring->data + second % FAKE_RING_BYTES);
  if (broken == 1) atomic_store(h, atomic_load(h) ^ (1ull << 40));
  if (broken == 2) atomic_store(h, atomic_load(h) & ~0xffffffffull);
  if (broken == 3) atomic_store(h, atomic_load(h) | 0xfffff000u);
  out_t o = {.len = 0};
  put8(&o, start_line);
  put(&o, ring->data, FAKE_RING_BYTES);
  for (int i = 0; reads[i]; i++) put(&o, &reads[i], sizeof reads[i]);
  save("shm_ring", name, &o);
  fake_ring_free(w);
}

static void gen_shm_ring(void) {
  const size_t mixed[] = {32, 56, 100, 1000, 0}, wrapping[] = {32, 600, 56, 0}, one[] = {1000, 0};
  const uint16_t whole[] = {1023, 1023, 1023, 1023, 1023, 0}, parts[] = {9, 99, 999, 1023, 0};
  ring_seed("records", 0, mixed, 0, whole);
  ring_seed("wrapping", 60, wrapping, 0, whole);
  ring_seed("read-in-parts", 3, one, 0, parts);
  ring_seed("bad-mark", 0, mixed, 1, whole);
  ring_seed("no-length", 0, mixed, 2, whole);
  ring_seed("length-past-the-ring", 0, mixed, 3, whole);
}

int main(int argc, char **argv) {
  if (argc > 1) out_root = argv[1];
  gen_blob();
  gen_tcp_hello();
  gen_coll_desc();
  gen_stream_frames();
  gen_shm_header();
  gen_window();
  gen_segment();
  gen_p2p_frame();
  gen_shm_ring();
  return 0;
}
