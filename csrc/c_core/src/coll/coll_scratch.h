/*
 * coll_scratch.h - per-communicator scratch of the collective algorithms,
 * `size` entries per array, allocated with the communicator. Only the
 * thread running the collective queue (one at a time) touches it.
 */
#ifndef TCC_COLL_SCRATCH_H
#define TCC_COLL_SCRATCH_H

#include <poll.h>

#include "transport/transport.h"

/* A contiguous run of a rank's staged stream. */
typedef struct coll_piece {
  const char *ptr;
  size_t len;
} coll_piece_t;

/* What this rank reads from one peer's stream: bytes [off, off+len) into
 * dst; stream: the length of that whole stream (where it was staged). */
typedef struct coll_read {
  size_t off;
  size_t len;
  char *dst;
  size_t stream;
} coll_read_t;

typedef struct tcc__coll_scratch {
  const void **srcs;
  const void **descs;
  coll_piece_t *pieces;
  coll_read_t *reads;  /* what this rank reads from each peer */
  coll_read_t *writes; /* what each peer reads from this rank (single-copy movement) */
  const char **part_src;
  char **part_out;
  size_t *part_len;
  /* stream algorithms: one poll entry per peer */
  int *poll_peers;
  short *poll_events;
  short *poll_revents;
  /* whether transfers poll before they sleep (core/cpu_share.h) */
  tcc__spin_gate_t spin_gate;
  /* hierarchical algorithms: partial results between phases, grown as
   * needed and kept (a fresh buffer per op would fault every page in) */
  void *partials;
  size_t partials_bytes;
  /* float16/bfloat16 allreduces that run in float32 phases: the copy */
  void *widened;
  size_t widened_bytes;
  /* the thread that runs the hierarchical allreduces' cross-host phases
   * (hier_pipe.c), started on first use */
  struct tcc__hier_pipe *pipe;
  /* slot rings (coll_slots.c): the last position an op used, the least
   * progress of the peers last read, the digest of this rank's
   * descriptors of them, and the first and last op numbers among them
   * since the digests were last compared (0: none) */
  uint64_t slot_pos, slot_room, slot_digest, slot_first_seq, slot_last_seq;
  /* ... and the most bytes a sender's part may have there in one slot,
   * and over several, fixed with the transport (tcc__coll_slots_part_max,
   * tcc__coll_slots_span_max; 0: no slot rings, no parts over several) */
  size_t slot_part_max, slot_span_max;
  /* one-sided rooted ops over streams (coll_stream_eager.c): whether they
   * run so here; this rank's descriptors of the last of them (a ring of
   * TCC_STREAM_UNREAD_MAX, by one_sided_ops, how many ran); and per peer
   * ([size]) how many of those ops' frames are still unread in the stream
   * from it (those of the last ones) */
  bool stream_one_sided;
  tcc_coll_desc_t *one_sided_descs;
  uint64_t one_sided_ops;
  uint16_t *unread;
  /* ... and the frames of those ops this rank held back, not yet sent
   * (stream_frames.h): per peer ([size]) a space for TCC_STREAM_HOLD_MAX
   * frames (held_space bytes each), how many bytes of it wait, and how
   * many frames were ever held (for tests); held_any, whether any wait,
   * is read by the collective thread without the queue, to know when
   * there is something to send while idle (tcc__coll_idle) */
  uint8_t *held;
  size_t held_space;
  size_t *held_bytes;
  uint64_t held_frames;
  atomic_bool held_any;
} tcc__coll_scratch_t;

/* hier_pipe.c: a thread that runs posted jobs, one at a time, while the
 * thread that posted them runs the host phases. A job is the cross-host
 * part of one segment of a hierarchical allreduce (tcc__hier_in_segments
 * in coll_hier.c). */
typedef struct tcc__hier_pipe tcc__hier_pipe_t;
typedef struct tcc__hier_job tcc__hier_job_t;
/* Runs `job` on comm; `parts` holds comm->size pointers for its own use. */
typedef tcc_result_t (*tcc__hier_job_fn)(tcc_comm_t *comm, const tcc__hier_job_t *job, void **parts,
                                         tcc_err_t *err);
struct tcc__hier_job {
  tcc__hier_job_fn run;
  /* the caller's op, and what its phases reduce (the op itself, or a float32
   * copy): both stay valid until the caller has waited for the job */
  const tcc_coll_t *out, *sum;
  size_t first, len; /* the segment of the vector, in elements */
  size_t shard;      /* even hosts: elements of each local rank's shard */
  uint64_t seq;
  int64_t deadline;
};
/* The communicator's pipe, started on first use (NULL: no thread). */
tcc__hier_pipe_t *tcc__hier_pipe_of(tcc_comm_t *comm);
/* Tests: while set, this process gets no pipe, as if its thread could not
 * be started. */
extern atomic_bool tcc__hier_pipe_refused;
/* Hands a copy of `job` to the pipe's thread (nothing else in flight). */
void tcc__hier_pipe_post(tcc__hier_pipe_t *p, const tcc__hier_job_t *job);
/* Waits for the posted job: its result, its message into err on failure. */
tcc_result_t tcc__hier_pipe_wait(tcc__hier_pipe_t *p, tcc_err_t *err);
/* Stops and frees a communicator's pipe (NULL: nothing). */
void tcc__hier_pipe_free(tcc__hier_pipe_t *p);

static inline tcc__coll_scratch_t *coll_scratch_of(tcc_comm_t *comm) {
  return (tcc__coll_scratch_t *)comm->coll_scratch;
}

/* coll_direct.c: single-copy movement over spans (see the file). The
 * block goes into this rank's descriptor span at the first stage, unless
 * longest_bound (at least the longest stream of any rank, should the ranks
 * agree on the op) is below the size the group agreed on for direct
 * movement: then no rank reads it. publish returns whether this rank must
 * stage its first window too. */
bool tcc__direct_publish(tcc_comm_t *comm, const tcc_coll_t *c, char *desc_span, const coll_piece_t *pieces, int np,
                         size_t stream_len, size_t longest_bound);
typedef enum {
  TCC__DIRECT_NONE,    /* through the windows */
  TCC__DIRECT_RESTAGE, /* through the windows, the first one staged again */
  TCC__DIRECT_READS,   /* single-copy */
} tcc__direct_plan_t;
/* Every rank's same choice, from every rank's descriptor span (descs)
 * and the longest stream (below the agreed size: NONE, no block read). */
tcc__direct_plan_t tcc__direct_choose(tcc_comm_t *comm, const void *const *descs, size_t longest);
/* Moves the op's data single-copy: reads[j] is what this rank reads from
 * peer j's stream, writes[r] what peer r reads from this rank's (whose
 * pieces this rank's own block lists); where one side of a rooted op would
 * idle, it moves a share of the bytes itself. Then waits at one more stage
 * barrier, so every buffer outlives the copies into and out of it. */
tcc_result_t tcc__direct_move(tcc_comm_t *comm, const tcc_coll_t *c, const void *const *descs,
                              const coll_read_t *reads, const coll_read_t *writes, uint64_t seq, int64_t deadline,
                              tcc_err_t *err);
/* For the op log: whether this rank expects single-copy movement for c
 * (the group may still fall back: it learns the peers' verdicts in the op). */
bool tcc__direct_expected(tcc_comm_t *comm, const tcc_coll_t *c);

/* coll_slots.c: small rooted ops over the slot rings (see the file).
 * fit: whether c goes there (the same answer on every rank that agrees
 * on c). publish: before an op's first stage barrier over the windows,
 * this rank's digest of its slot-ring ops beside its descriptor of
 * `parity`; verify, after it: every rank's digest alike, else
 * TCC_ERR_MISMATCH, naming the op (seq) and the ranks, and the
 * communicator fails. */
bool tcc__coll_slots_fit(tcc_comm_t *comm, const tcc_coll_t *c);
/* The most bytes a sender's part may have (0: no slot rings here), asked
 * of the transport: read once, when the scratch is made (slot_part_max). */
size_t tcc__coll_slots_part_max(tcc_comm_t *comm);
size_t tcc__coll_slots_span_max(tcc_comm_t *comm);
tcc_result_t tcc__coll_slots_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline,
                                 tcc_err_t *err);
void tcc__coll_slots_publish(tcc_comm_t *comm, int parity);
tcc_result_t tcc__coll_slots_verify(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int parity,
                                    tcc_err_t *err);

/* coll_staged.c, coll_stream.c: one collective over each kind of transport offer. */
tcc_result_t tcc__coll_staged_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                  tcc_err_t *err);
tcc_result_t tcc__coll_stream_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                  tcc_err_t *err);
/* coll_stream.c: what every collective over streams starts with (not run
 * on a failed communicator, every rank's descriptor checked by every rank,
 * the root's range), alone: the hierarchical algorithms begin with it, so
 * ranks that disagree fail alike before any phase runs, whichever
 * algorithm each of them chose. For an all-to-all, send_matrix (NULL, or
 * size x size entries) gets every rank's accepted send counts:
 * send_matrix[i * size + j] elements go from rank i to rank j. */
tcc_result_t tcc__coll_stream_agree(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                    uint64_t *send_matrix, tcc_err_t *err);
/* The rest of tcc__coll_stream_run, after tcc__coll_stream_agree accepted c. */
tcc_result_t tcc__coll_stream_run_agreed(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                         tcc_err_t *err);
/* coll_hier.c: collectives on groups that span hosts (comm->topo), in
 * phases on its views; coll_hier_alltoall.c: their all-to-all. */
bool tcc__coll_hier_chosen(const tcc_comm_t *comm, const tcc_coll_t *c);
const char *tcc__coll_hier_algorithm(const tcc_comm_t *comm, const tcc_coll_t *c);
tcc_result_t tcc__coll_hier_run(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                tcc_err_t *err);
tcc_result_t tcc__coll_hier_alltoall(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                     tcc_err_t *err);

/* coll_staged.c: whether a reduction of `bytes` goes one-shot (every rank
 * reduces everything) rather than pipelined, given the spans' one-shot limit. */
bool tcc__coll_staged_one_shot(tcc_coll_kind_t kind, size_t bytes, size_t small_bytes);

#endif /* TCC_COLL_SCRATCH_H */
