/*
 * internal.h - structures shared by the C core's source files.
 * Nothing here is part of the public API (include/tccomm.h).
 */
#ifndef TCC_INTERNAL_H
#define TCC_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "tccomm.h"

#define TCC_ERRLEN 512
#define TCC_MAX_RANKS 1024

/* ---- errors ---------------------------------------------------------- */

typedef struct tcc_err {
  tcc_result_t code;
  char msg[TCC_ERRLEN];
} tcc_err_t;

/* Records code + printf-style message in err (if not NULL and not already
 * set) and returns code. */
tcc_result_t tcc_err_set(tcc_err_t *err, tcc_result_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- time and waiting ------------------------------------------------ */

int64_t tcc_now_ns(void); /* CLOCK_MONOTONIC */
/* tcc_now_ns() + timeout_ms, saturated at INT64_MAX: a huge timeout means
 * "practically never" instead of wrapping into the past. A negative timeout
 * counts as 0 (the deadline is now). */
int64_t tcc_deadline_after_ms(int64_t timeout_ms);

/* Futex on a 32-bit word that may live in process-shared memory. */
void tcc_futex_wait(atomic_uint *word, unsigned expected, int64_t max_ns);
void tcc_futex_wake_all(atomic_uint *word);

static inline void tcc_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* ---- descriptors and fork (forksafe.c) -------------------------------- */

/* Registers fd to be closed in a child made by fork(): its copy would keep
 * a dead parent's connections and liveness lock alive. */
void tcc_fd_close_on_fork(int fd);
/* Closes a registered (or unregistered) fd and forgets it. */
void tcc_fd_close(int fd);

/* ---- reductions (reduce.c) ------------------------------------------- */

/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], applied in
 * that order (so every rank that runs it gets the same bits).
 * AVG divides the sum by nsrc; PREMUL_SUM multiplies each source by
 * premul before summing. float16/bfloat16 accumulate in float32 and round
 * once. dst may be the very same pointer as one of srcs (never a partial
 * overlap). The caller has checked tcc_redop_supported(). */
void tcc_reduce_n(void *dst, const void *const *srcs, int nsrc, size_t count,
                  tcc_dtype_t dtype, tcc_redop_t op, double premul);

/* ---- endpoint blob ---------------------------------------------------- */

#define TCC_BLOB_MAGIC 0x74636331u /* "tcc1" */
#define TCC_TOKEN_BYTES 16

/* Serialized into the TCC_ENDPOINT_BLOB_SIZE bytes of tcc_endpoint_open;
 * fixed little-endian layout (all peers run the same build). */
typedef struct tcc_blob {
  uint32_t magic;
  uint32_t pid;
  uint16_t port;     /* TCP listening port, host order */
  uint16_t reserved;
  uint32_t ipv4;     /* advertised address, network order */
  uint8_t token[TCC_TOKEN_BYTES]; /* random; peers must present it to connect */
  char hostname[64];
  char boot_id[40];
  /* The /dev/shm this process sees (device and inode of the directory):
   * equal on two ranks only when shm_open names mean the same objects to
   * both. 0 when there is no /dev/shm. */
  uint64_t shm_dev;
  uint64_t shm_ino;
} tcc_blob_t;
_Static_assert(sizeof(tcc_blob_t) <= TCC_ENDPOINT_BLOB_SIZE, "blob too large");

struct tcc_endpoint {
  int listen_fd;
  tcc_blob_t blob;
};

/* Copies the n endpoint blobs of raw (TCC_ENDPOINT_BLOB_SIZE bytes apart,
 * as gathered from the store) into blobs, checks each one's magic and
 * NUL-terminates its strings. TCC_ERR_INVALID names the first bad rank. */
tcc_result_t tcc_blobs_decode(const uint8_t *raw, int n, tcc_blob_t *blobs, tcc_err_t *err);
/* The transport for a group of cfg->size ranks with these decoded blobs:
 * cfg->transport, else TCCOMM_TRANSPORT, else shared memory when every
 * rank sees the same /dev/shm. TCC_ERR_INVALID when the request cannot be
 * met. Every rank decides alike from the same blobs. */
tcc_result_t tcc_comm_choose_transport(const tcc_comm_config_t *cfg, const tcc_blob_t *blobs,
                                       tcc_transport_t *out, tcc_err_t *err);

/* Fills hostname and boot id of this machine. */
void tcc_host_identity(char hostname[64], char boot_id[40]);
/* Device and inode of the /dev/shm directory this process sees (0, 0 if none). */
void tcc_shm_identity(uint64_t *dev, uint64_t *ino);
/* Fills buf with n cryptographically random bytes (getrandom). */
tcc_result_t tcc_random_bytes(void *buf, size_t n);

/* ---- collective descriptors (coll.c) ---------------------------------- */

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

const char *tcc_coll_name(tcc_coll_kind_t kind);

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
 * size recv counts (uint64 each). */
typedef struct tcc_coll_desc {
  uint64_t seq;
  uint32_t kind;
  uint32_t dtype;
  uint32_t redop;
  int32_t root;
  uint64_t count;
} tcc_coll_desc_t;

/* Bytes a descriptor takes on a communicator of `size` ranks. */
size_t tcc_coll_desc_bytes(tcc_coll_kind_t kind, int size);
/* Writes this rank's descriptor (tcc_coll_desc_bytes bytes) into out. */
void tcc_coll_desc_fill(const tcc_coll_t *c, uint64_t seq, int size, void *out);
/* Checks the descriptors of all ranks (descs[r] points at rank r's) and
 * returns TCC_OK or TCC_ERR_MISMATCH with a message naming the first
 * disagreement. Deterministic: every rank reaches the same verdict. */
tcc_result_t tcc_coll_desc_check(const tcc_comm_t *comm, const tcc_coll_t *c,
                                 const void *const *descs, tcc_err_t *err);

/* When data arriving for this rank could land on input it still has to
 * send (outputs overlapping inputs, other than exact in-place use, which
 * every algorithm handles), points *staged at a copy of c whose inputs are
 * a private snapshot held in *mem (free it after the collective).
 * Otherwise *staged = *c and *mem = NULL. Returns false when out of memory. */
bool tcc_coll_snapshot_inputs(const tcc_coll_t *c, int n, int me, tcc_coll_t *staged, void **mem);

/* ---- transports ------------------------------------------------------- */

/* A transport carries collectives (run in issue order on the collective
 * thread) and point-to-point byte streams (one per ordered pair of ranks,
 * progressed by the p2p thread). */
typedef struct tcc_transport_ops {
  const char *name;
  /* Runs one collective to completion or failure. deadline_ns is absolute
   * (tcc_now_ns clock). Must return TCC_ERR_ABORTED soon after
   * comm->aborted is set. */
  tcc_result_t (*run_collective)(tcc_comm_t *comm, const tcc_coll_t *c,
                                 uint64_t seq, int64_t deadline_ns, tcc_err_t *err);
  /* Non-blocking byte stream to / from `peer`. Return bytes moved (0 when
   * nothing can move now) or -1 with err set when the channel failed. */
  ssize_t (*p2p_write)(tcc_comm_t *comm, int peer, const void *buf, size_t len,
                       tcc_err_t *err);
  ssize_t (*p2p_read)(tcc_comm_t *comm, int peer, void *buf, size_t len,
                      tcc_err_t *err);
  /* Sleeps until some p2p channel may be able to move bytes, or until
   * tcp_p2p_notify is called, or max_ns passes. want_write[peer] is true
   * for peers with bytes waiting to be written. */
  void (*p2p_wait)(tcc_comm_t *comm, const bool *want_write, int64_t max_ns);
  /* Wakes p2p_wait (new local work or abort). Any thread. */
  void (*p2p_notify)(tcc_comm_t *comm);
  /* Releases transport state (threads are already stopped). */
  void (*destroy)(tcc_comm_t *comm);
} tcc_transport_ops_t;

/* Each transport's setup. `blobs` as in tcc_comm_create; on success sets
 * comm->ops and comm->transport_state. Bounded by comm->timeout_ms. */
tcc_result_t tcc_shm_setup(tcc_comm_t *comm, const tcc_blob_t *blobs, tcc_err_t *err);
tcc_result_t tcc_tcp_setup(tcc_comm_t *comm, tcc_endpoint_t *ep, const tcc_blob_t *blobs,
                           tcc_err_t *err);

/* ---- ops and the engine (engine.c) ------------------------------------ */

typedef enum tcc_op_kind { TCC_OP_COLL = 1, TCC_OP_SEND, TCC_OP_RECV } tcc_op_kind_t;

struct tcc_op {
  atomic_int refs;
  tcc_comm_t *comm;
  tcc_op_kind_t kind;
  tcc_coll_t coll;     /* TCC_OP_COLL; arrays below are owned copies */
  void *owned_arrays;  /* one allocation backing coll.sends/recvs/counts */
  /* P2P */
  int peer;            /* TCC_ANY_SOURCE: a receive from any rank */
  int source;          /* the rank a receive matched (set before it finishes) */
  uint64_t tag;
  void *buf;
  size_t bytes;
  size_t done_bytes;   /* p2p progress, header included */
  int64_t timeout_ms;
  int64_t deadline_ns; /* set when the op starts */
  uint64_t seq;        /* collective sequence number */
  struct tcc_op *next; /* engine queue link */
  /* completion */
  atomic_int finished;        /* 0 running, 1 finished */
  atomic_uint finished_futex; /* waiters sleep here */
  tcc_result_t result;
  char error[TCC_ERRLEN];
  pthread_mutex_t cb_lock;
  tcc_op_callback_t cb;
  void *cb_arg;
  /* CUDA ops only (cuda_comm.c) */
  int cuda_device;         /* -1: a host op */
  _Atomic(void *) cuda_event; /* completion event, published once recorded (other threads test it) */
  void *cuda_tmp;          /* staging memory freed after the NCCL call */
  int cuda_captured;       /* enqueued into a CUDA graph capture: never queried */
  atomic_int cuda_reaped;  /* whoever sets it first finishes the op */
  struct tcc_op *cuda_next; /* watchdog / open group list link */
};

typedef struct tcc_engine tcc_engine_t;

tcc_result_t tcc_engine_start(tcc_comm_t *comm, tcc_err_t *err);
/* Takes a reference on op and queues it. */
void tcc_engine_submit(tcc_comm_t *comm, tcc_op_t *op);
/* Wakes everything (after comm->aborted was set). */
void tcc_engine_wake(tcc_comm_t *comm);
/* Stops the threads once no other thread is inside the engine and the
 * queued ops are finished or failed (destroy fails them first). The engine
 * memory stays until tcc_engine_free: ops that outlive the communicator
 * still reach it. */
void tcc_engine_stop(tcc_comm_t *comm);
void tcc_engine_free(tcc_comm_t *comm);
/* Finishes an op: records result/message, runs the callback, wakes waiters. */
void tcc_op_finish(tcc_op_t *op, tcc_result_t result, const char *msg);

/* ---- communicator ----------------------------------------------------- */

struct tcc_comm {
  /* One reference for the owner (dropped by tcc_comm_destroy) and one per
   * op: an op handle may be waited on or tested after destroy, and a
   * thread may still be inside tcc_op_wait when destroy starts. */
  atomic_int refs;
  pid_t owner_pid; /* the process that created it (not a forked child) */
  int rank;
  int size;
  char name[64];
  atomic_llong timeout_ms;
  const tcc_transport_ops_t *ops;
  void *transport_state;
  tcc_engine_t *engine;
  atomic_ullong coll_issued;   /* collectives issued (sequence numbers) */
  atomic_int aborted;          /* set by abort or a fatal failure */
  tcc_result_t fail_code;      /* why aborted */
  pthread_mutex_t fail_lock;
  char fail_msg[TCC_ERRLEN];
  char last_error[TCC_ERRLEN]; /* last rejected call, for tcc_comm_last_error */
  /* spin budget for waits: large when every rank has its own core */
  int spin_iters;
  /* CUDA path (cuda_comm.c): NULL until the first CUDA op or tcc_comm_cuda_init */
  _Atomic(struct tcc_cuda *) cuda;
  pthread_mutex_t cuda_lock; /* creation of `cuda`, issuing CUDA ops, groups */
  int group_depth;           /* tcc_comm_group_start nesting; under cuda_lock */
};

/* Marks the communicator failed (first failure wins) so later ops fail
 * fast with `code` and `msg`; wakes every thread. */
void tcc_comm_fail(tcc_comm_t *comm, tcc_result_t code, const char *msg);
/* Drops a reference; the last one frees the communicator's memory. */
void tcc_comm_release(tcc_comm_t *comm);

#endif /* TCC_INTERNAL_H */
