/*
 * coll.h - a collective as issued on one rank (tcc_coll_t), and the
 * descriptors ranks compare before any data moves (coll/coll_desc.c).
 */
#ifndef TCC_COLL_COLL_H
#define TCC_COLL_COLL_H

#include "core/base.h"

typedef enum tcc_coll_kind {
  TCC_COLL_BROADCAST = 1,
  TCC_COLL_ALLREDUCE,
  TCC_COLL_REDUCE,
  TCC_COLL_ALLGATHER,
  TCC_COLL_GATHER,
  TCC_COLL_SCATTER,
  TCC_COLL_REDUCE_SCATTER,
  TCC_COLL_ALLTOALL,
  TCC_COLL_BARRIER
} tcc_coll_kind_t;

/* The op's name in messages; inline, as every entry point asks it. */
static inline const char *tcc__coll_name(tcc_coll_kind_t kind) {
  static const char *const names[TCC_COLL_BARRIER + 1] = {
      [TCC_COLL_BROADCAST] = "broadcast", [TCC_COLL_ALLREDUCE] = "allreduce",
      [TCC_COLL_REDUCE] = "reduce",       [TCC_COLL_ALLGATHER] = "allgather",
      [TCC_COLL_GATHER] = "gather",       [TCC_COLL_SCATTER] = "scatter",
      [TCC_COLL_REDUCE_SCATTER] = "reduce_scatter", [TCC_COLL_ALLTOALL] = "alltoall",
      [TCC_COLL_BARRIER] = "barrier"};
  return (unsigned)kind <= TCC_COLL_BARRIER && names[kind] ? names[kind] : "unknown";
}

/* One collective as issued on this rank. Buffers are host memory.
 * - BROADCAST: send = recv = the buffer (count elements).
 * - ALLREDUCE/REDUCE: send -> recv (count elements each; recv only on
 *   root for REDUCE). May be the same memory.
 * - ALLGATHER/GATHER: send (count) -> recvs[j] (count each).
 * - SCATTER: sends[j] (count each, root) -> recv (count).
 * - REDUCE_SCATTER: sends[j] (count each) -> recv (count).
 * - ALLTOALL: sends[j] -> recvs[j], per-peer counts.
 * - BARRIER: nothing. */
typedef struct tcc_coll {
  tcc_coll_kind_t kind;
  tcc_dtype_t dtype;
  tcc_redop_t redop;
  double premul;
  const void *premul_device; /* CUDA: the factor in device memory, or NULL */
  int root;
  size_t count;       /* elements, see above */
  void *send;
  void *recv;
  void **sends;       /* size entries (or NULL) */
  void **recvs;       /* size entries (or NULL) */
  size_t *send_counts; /* ALLTOALL: elements to each peer */
  size_t *recv_counts; /* ALLTOALL: elements from each peer */
} tcc_coll_t;

/* What every rank publishes before a collective so all ranks can check
 * that they agree. Followed, for ALLTOALL only, by size send counts and
 * size recv counts (uint64 each), unless flags has TCC_DESC_EVEN_COUNTS:
 * then every count is `count` and no list follows (a rank's descriptor
 * and a small stream then share one cache line; see coll_staged.c). */
typedef struct tcc_coll_desc {
  uint64_t seq;
  uint64_t count;
  int32_t root;
  /* A byte each: 24 bytes in all leave a shared-memory rank's line room
   * for 32 bytes of data after its arrival word (shm_spans.c). */
  uint8_t kind;
  uint8_t flags;
  uint8_t dtype;
  uint8_t redop;
} tcc_coll_desc_t;
_Static_assert(sizeof(tcc_coll_desc_t) == 24, "a descriptor's head is 24 bytes, without padding");
_Static_assert(TCC_COLL_BARRIER < 256 && TCC_DTYPE_COUNT <= 256 && TCC_REDOP_COUNT <= 256,
               "kinds, dtypes and reduce ops fit a descriptor's bytes");

/* flags: an all-to-all whose every send and receive count is `count`. */
#define TCC_DESC_EVEN_COUNTS 1u

/* Bytes a descriptor takes on a communicator of `size` ranks, at most
 * (the listed form of an all-to-all's). */
size_t tcc__coll_desc_bytes(tcc_coll_kind_t kind, int size);
/* Bytes of a spans transport's descriptor slot: the largest descriptor
 * and the block of single-copy movement (coll_direct.c). */
size_t tcc__coll_spans_desc_bytes(int size);
/* The largest part a rooted op may lay over consecutive slots of a slot
 * ring of `slots` slots of `slot_bytes` (coll_slots.c): what a spans
 * transport may offer as its slot_span_bytes, at most. */
size_t tcc__coll_slot_span_capacity(unsigned slots, size_t slot_bytes);
/* Writes this rank's descriptor (tcc__coll_desc_bytes bytes) into out. */
void tcc__coll_desc_fill(const tcc_coll_t *c, uint64_t seq, int size, void *out);
/* The same, but an all-to-all whose counts are all equal in the short form
 * (TCC_DESC_EVEN_COUNTS), which writes only the head. For readers that
 * take every descriptor's length from the room it has (shared memory). */
void tcc__coll_desc_fill_short(const tcc_coll_t *c, uint64_t seq, int size, void *out);
/* Whether anything follows the descriptor's head (an all-to-all's lists). */
bool tcc__coll_desc_has_tail(const void *desc);
/* Whether an all-to-all's descriptor is in the short form, every count
 * *count: each read of a count is then that one number. */
bool tcc__coll_desc_even(const void *desc, uint64_t *count);
/* What an all-to-all's descriptor (of a group of `size`) says its rank
 * sends to rank `to`, and expects from rank `from`, in either form. */
uint64_t tcc__coll_desc_sends(const void *desc, int to);
uint64_t tcc__coll_desc_expects(const void *desc, int size, int from);
/* Checks the descriptors of all ranks (descs[r] points at rank r's) and
 * returns TCC_OK or TCC_ERR_MISMATCH with a message naming the first
 * disagreement. Deterministic: every rank reaches the same verdict. */
tcc_result_t tcc__coll_desc_check(const tcc_comm_t *comm, const tcc_coll_t *c,
                                 const void *const *descs, tcc_err_t *err);
/* The same for two descriptors only: this rank's and peer's (whose part
 * this rank is about to take), named as such in the message. */
tcc_result_t tcc__coll_desc_check_peer(const tcc_comm_t *comm, const tcc_coll_t *c, const tcc_coll_desc_t *mine,
                                      const tcc_coll_desc_t *theirs, int peer, tcc_err_t *err);

/* A disagreement found by a rank whose peer did not wait for it (a slot
 * ring's sender, a one-sided op's over streams): the ranks ran different
 * ops, so the op fails with `fmt`'s message and the communicator with it.
 * Returns TCC_ERR_MISMATCH. */
__attribute__((format(printf, 3, 4)))
tcc_result_t tcc__coll_out_of_step(tcc_comm_t *comm, tcc_err_t *err, const char *fmt, ...);

/* When data arriving for this rank could land on input it still has to
 * send (outputs overlapping inputs, other than exact in-place use, which
 * every algorithm handles), points *staged at a copy of c whose inputs are
 * a private snapshot held in *mem (free it after the collective).
 * Otherwise *staged = *c and *mem = NULL. Returns false when out of memory. */
bool tcc__coll_snapshot_inputs(const tcc_coll_t *c, int n, int me, tcc_coll_t *staged, void **mem);
/* The same without copying c when its inputs need no snapshot (the usual
 * case): returns c itself, or *copy pointing at the snapshot; NULL when
 * out of memory. */
const tcc_coll_t *tcc__coll_inputs_safe(const tcc_coll_t *c, int n, int me, tcc_coll_t *copy, void **mem);

/* ---- running collectives (coll_select.c) ------------------------------ */

/* Allocates the algorithms' per-communicator scratch (after the
 * transport is set up); tcc__coll_release frees it. */
tcc_result_t tcc__coll_attach(tcc_comm_t *comm, tcc_err_t *err);
void tcc__coll_release(tcc_comm_t *comm);
/* Runs one collective to completion or failure over the communicator's
 * transport, with the algorithm chosen for it. deadline_ns is absolute
 * (tcc__now_ns clock). Returns TCC_ERR_ABORTED soon after the communicator
 * failed. Only the thread holding the collective queue calls it. */
tcc_result_t tcc__coll_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                           tcc_err_t *err);
/* Before a healthy communicator's transport closes, with no op running:
 * reads what its peers sent it that no op has read yet, for up to
 * grace_ms (coll_stream_eager.c's one-sided ops leave such bytes). */
void tcc__coll_settle(tcc_comm_t *comm, int64_t grace_ms);
/* Whether the algorithms hold output back for a later op (coll_stream_eager.c
 * holds the frames no peer waits for); any thread may ask. With the
 * collective queue held and no op running, tcc__coll_idle sends it, as
 * far as the transport takes it now: the collective thread calls it when
 * no op came for a while, so nothing is held for long. */
bool tcc__coll_holds_output(tcc_comm_t *comm);
void tcc__coll_idle(tcc_comm_t *comm);
/* The name of the algorithm tcc__coll_run will run c with (for logs). */
const char *tcc__coll_algorithm(tcc_comm_t *comm, const tcc_coll_t *c);

#endif /* TCC_COLL_COLL_H */
