/*
 * fuzz_stream_frames.c - the descriptor frames every collective over
 * streams (TCP) starts with (tcc__stream_frames_exchange): a frame head
 * whose lengths say how much descriptor tail and payload follow, as the
 * peers' byte streams deliver them, in pieces of any size.
 *
 * Input: [n - 2] [rank] [kind] [count] [piece] [payload expected from
 * each peer, u8 each], then each peer's stream in rank order as [u16
 * length] [bytes], the stream ending there, then [earlier] [send-only]:
 * earlier % 4 one-sided broadcasts of count elements from root 0 (#6, #7,
 * #8) this rank listened to no peer in before, whose frames come first
 * from every peer (coll_stream_eager.c), and which peers this op, then
 * one-sided too, does not listen to (bit j: peer j). Every outcome must
 * be a verdict
 * (TCC_OK, a mismatch, a malformed frame or a stream that ended), with a
 * message naming the op, the communicator and this rank, never a read or
 * write outside a buffer; a peer's payload lands only where it was
 * expected, and only at the expected length.
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "coll/stream_frames.h"

#define MAX_RANKS 4

typedef struct peer_stream {
  const uint8_t *p;
  size_t left;
} peer_stream_t;

static peer_stream_t streams[MAX_RANKS];
static size_t piece; /* the most one recv returns */

static ssize_t fake_send(tcc_comm_t *comm, int peer, const void *buf, size_t len) {
  (void)comm, (void)peer, (void)buf;
  return (ssize_t)len; /* the peer takes everything */
}

static ssize_t fake_recv(tcc_comm_t *comm, int peer, void *buf, size_t len) {
  (void)comm;
  peer_stream_t *s = &streams[peer];
  size_t k = len < s->left ? len : s->left;
  if (k > piece) k = piece;
  memcpy(buf, s->p, k);
  s->p += k;
  s->left -= k;
  return (ssize_t)k; /* 0 once the stream is over: the peer closed it */
}

static int fake_poll(tcc_comm_t *comm, int n, const int *peers, const short *events, short *revents, int timeout_ms) {
  (void)comm, (void)peers, (void)timeout_ms;
  for (int i = 0; i < n; i++) revents[i] = events[i];
  return n;
}

static const tcc__stream_ops_t fake_streams = {.send = fake_send, .recv = fake_recv, .poll = fake_poll};
static const struct tcc_transport_ops fake_ops = {.name = "fuzz", .streams = &fake_streams};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  const int n = 2 + fuzz_u8(&in) % (MAX_RANKS - 1);
  const int me = fuzz_u8(&in) % n;
  const tcc_coll_kind_t kind = (tcc_coll_kind_t)(TCC_COLL_BROADCAST + fuzz_u8(&in) % TCC_COLL_BARRIER);
  const size_t count = fuzz_u8(&in);
  piece = 1 + fuzz_u8(&in) % 64;
  size_t in_len[MAX_RANKS] = {0}, out_len[MAX_RANKS] = {0};
  for (int j = 0; j < n; j++) in_len[j] = fuzz_u8(&in);
  uint8_t *streams_mem[MAX_RANKS] = {0};
  for (int j = 0; j < n; j++) {
    uint8_t len[2];
    fuzz_take(&in, len, 2);
    const size_t l = j == me ? 0 : (size_t)len[0] | (size_t)len[1] << 8;
    streams_mem[j] = malloc(l ? l : 1);
    if (!streams_mem[j]) abort();
    fuzz_take(&in, streams_mem[j], l);
    streams[j] = (peer_stream_t){streams_mem[j], l};
  }

  tcc_comm_t *comm = calloc(1, sizeof *comm);
  if (!comm) abort();
  comm->size = n;
  comm->rank = me;
  comm->ops = &fake_ops;
  snprintf(comm->name, sizeof comm->name, "fuzz");
  tcc_err_t err = {TCC_OK, {0}};
  if (tcc__coll_attach(comm, &err) != TCC_OK) abort();
  const unsigned earlier = fuzz_u8(&in) % 4;
  const uint8_t deaf_to = fuzz_u8(&in);
  bool listen[MAX_RANKS];
  for (int j = 0; j < n; j++) listen[j] = j != me && !(deaf_to >> j & 1);
  if (earlier) { /* as after one-sided ops on a group whose streams are its own */
    tcc__coll_scratch_t *sc = coll_scratch_of(comm);
    sc->one_sided_descs = calloc(TCC_STREAM_UNREAD_MAX, sizeof *sc->one_sided_descs);
    sc->unread = calloc((size_t)n, sizeof *sc->unread);
    if (!sc->one_sided_descs || !sc->unread) abort();
    const tcc_coll_t b = {.kind = TCC_COLL_BROADCAST, .dtype = TCC_FLOAT32, .count = count};
    for (unsigned k = 0; k < earlier; k++) tcc__coll_desc_fill(&b, 9 - earlier + k, n, &sc->one_sided_descs[k]);
    sc->one_sided_ops = earlier;
    for (int j = 0; j < n; j++) sc->unread[j] = j == me ? 0 : (uint16_t)earlier;
  }

  /* this rank's op: float32, count elements, root 0, all-to-all counts */
  size_t counts[MAX_RANKS] = {count, count, count, count};
  const tcc_coll_t c = {.kind = kind, .dtype = TCC_FLOAT32, .redop = TCC_SUM, .count = count,
                        .send_counts = counts, .recv_counts = counts};
  uint8_t *frame = malloc(tcc__stream_frame_bytes(&c, n, 0));
  uint8_t *payloads = malloc((size_t)n * 256 + 1);
  uint8_t *outs[MAX_RANKS], *ins[MAX_RANKS];
  if (!frame || !payloads) abort();
  tcc__stream_frame_fill(&c, 9, n, NULL, 0, frame);
  for (int j = 0; j < n; j++) {
    outs[j] = frame;
    out_len[j] = tcc__stream_frame_bytes(&c, n, 0);
    ins[j] = in_len[j] ? payloads + (size_t)j * 256 : NULL;
  }
  memset(payloads, 0xEE, (size_t)n * 256 + 1);
  stream_link_t links[MAX_RANKS];
  stream_xfer_t x = {.comm = comm, .what = tcc__coll_name(kind), .phase = "start", .seq = 9, .links = links};
  const stream_frames_t f = {.out = outs, .out_len = out_len, .in = ins, .in_len = in_len,
                             .listen = earlier ? listen : NULL};
  uint64_t matrix[MAX_RANKS * MAX_RANKS];
  tcc_result_t r = tcc__stream_frames_exchange(&x, &c, &f, INT64_MAX, matrix, &err);
  assert(r == TCC_OK || r == TCC_ERR_MISMATCH || r == TCC_ERR_REMOTE);
  if (r != TCC_OK) {
    char check[32], stream[48];
    snprintf(check, sizeof check, "'fuzz' (rank %d)", me);          /* the descriptors' check */
    snprintf(stream, sizeof stream, "communicator 'fuzz' rank %d:", me); /* a frame or a stream */
    assert(strstr(err.msg, r == TCC_ERR_MISMATCH ? check : stream));
  }
  /* nothing lands past an expected payload, nor where none was expected */
  for (int j = 0; j < n; j++)
    for (size_t i = in_len[j]; i < 256; i++) assert(payloads[(size_t)j * 256 + i] == 0xEE);
  assert(payloads[(size_t)n * 256] == 0xEE);

  tcc__coll_release(comm);
  free(comm);
  free(frame);
  free(payloads);
  for (int j = 0; j < n; j++) free(streams_mem[j]);
  return 0;
}
