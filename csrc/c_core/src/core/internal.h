/*
 * internal.h - the communicator and the op, as every part of the core
 * sees them. Nothing here is part of the public API (include/tccomm.h).
 */
#ifndef TCC_INTERNAL_H
#define TCC_INTERNAL_H

#include "coll/coll.h"
#include "core/base.h"
#include "core/cpu_share.h"

/* ---- endpoint blob ---------------------------------------------------- */

#define TCC_BLOB_MAGIC 0x74636331u /* "tcc1" */
#define TCC_TOKEN_BYTES 16
#define TCC_BLOB_CPU_BITS 512

/* Serialized into the TCC_ENDPOINT_BLOB_SIZE bytes of tcc_endpoint_open;
 * fixed little-endian layout (all peers run the same build). */
typedef struct tcc_blob {
  uint32_t magic;
  uint32_t pid;
  uint16_t port;     /* TCP listening port, host order */
  uint16_t cpus;     /* CPUs this process may use (its affinity), at most 65535; 0: unknown */
  uint32_t ipv4;     /* advertised address, network order */
  uint8_t token[TCC_TOKEN_BYTES]; /* random; peers must present it to connect */
  char hostname[64];
  char boot_id[40];
  /* The /dev/shm this process sees (device and inode of the directory):
   * equal on two ranks only when shm_open names mean the same objects to
   * both. 0 when there is no /dev/shm. */
  uint64_t shm_dev;
  uint64_t shm_ino;
  /* TCCOMM_HIER_OVERLAP of this process (tcc__hier_overlap_t); rank 0's
   * counts for a group. */
  uint8_t hier_overlap;
  uint8_t pad[7];
  /* Which of CPUs 0 .. TCC_BLOB_CPU_BITS-1 it may use, a bit each; the
   * whole set when their count is `cpus` (peers count the CPUs that the
   * ranks of a machine share between them, core/cpu_share.h). */
  uint64_t cpu_mask[TCC_BLOB_CPU_BITS / 64];
} tcc_blob_t;
_Static_assert(sizeof(tcc_blob_t) <= TCC_ENDPOINT_BLOB_SIZE, "blob too large");

struct tcc_endpoint {
  int listen_fd;
  tcc_blob_t blob;
};

/* Copies the n endpoint blobs of raw (TCC_ENDPOINT_BLOB_SIZE bytes apart,
 * as gathered from the store) into blobs, checks each one's magic and
 * NUL-terminates its strings. TCC_ERR_INVALID names the first bad rank. */
tcc_result_t tcc__blobs_decode(const uint8_t *raw, int n, tcc_blob_t *blobs, tcc_err_t *err);
/* The transport for a group of cfg->size ranks with these decoded blobs:
 * cfg->transport, else TCCOMM_TRANSPORT, else shared memory when every
 * rank sees the same /dev/shm. TCC_ERR_INVALID when the request cannot be
 * met. Every rank decides alike from the same blobs. */
tcc_result_t tcc__comm_choose_transport(const tcc_comm_config_t *cfg, const tcc_blob_t *blobs,
                                       tcc_transport_t *out, tcc_err_t *err);
/* env_check.c: TCC_ERR_INVALID naming the first on/off switch of the
 * environment (TCCOMM_CMA, ...) whose value none of its readers knows. */
tcc_result_t tcc__env_check_switches(tcc_err_t *err);

/* Fills hostname and boot id of this machine. */
void tcc__host_identity(char hostname[64], char boot_id[40]);
/* Device and inode of the /dev/shm directory this process sees (0, 0 if none). */
void tcc__shm_identity(uint64_t *dev, uint64_t *ino);
/* Fills buf with n cryptographically random bytes (getrandom). */
tcc_result_t tcc__random_bytes(void *buf, size_t n);

/* ---- ops (core/op.c) -------------------------------------------------- */

typedef enum tcc_op_kind { TCC_OP_COLL = 1, TCC_OP_SEND, TCC_OP_RECV } tcc_op_kind_t;

typedef struct tcc__executor tcc__executor_t; /* core/executor.h */

/* The largest group whose per-rank lists an op holds in itself. */
#define TCC_OP_INLINE_RANKS 8

struct tcc_op {
  atomic_int refs;
  tcc_comm_t *comm;
  const tcc__executor_t *exec; /* what runs it, chosen by its buffers' device */
  void *exec_state;            /* that executor's per-op state, or NULL */
  int device;                  /* of its buffers: -1 host memory, else a device of the device executor */
  tcc_op_kind_t kind;
  tcc_coll_t coll;     /* TCC_OP_COLL; arrays below are owned copies */
  void *owned_arrays;  /* one allocation backing coll.sends/recvs/counts, or NULL (in_arrays) */
  /* P2P */
  int peer;            /* TCC_ANY_SOURCE: a receive from any rank */
  int source;          /* the rank a receive matched (set before it finishes) */
  uint64_t tag;
  void *buf;
  size_t bytes;
  size_t done_bytes;   /* p2p progress, header included */
  bool by_ref;         /* a send whose frame is a reference (host/p2p_direct.c) */
  int64_t timeout_ms;
  int64_t deadline_ns; /* set when the op starts (tcc__op_begin) */
  atomic_int started;  /* 1 from then on: read by other threads (tcc_op_started) */
  uint64_t seq;        /* collective sequence number */
  struct tcc_op *next; /* link in one list of its executor */
  /* completion */
  atomic_int finished;        /* 0 running, 1 finished */
  atomic_uint finished_futex; /* waiters sleep here */
  atomic_int finished_sleepers; /* ... this many now: finishing wakes only when some do */
  tcc_result_t result;
  /* The completion callback (op.c): cb_state says who runs it. */
  atomic_int cb_state;
  tcc_op_callback_t cb;
  void *cb_arg;
  char error[TCC_ERRLEN]; /* a new op clears only its first byte (op.c) */
  /* Where coll.sends/recvs/counts live in groups of up to TCC_OP_INLINE_RANKS
   * (ops_api.c): no allocation per op. Never cleared: filled when used. */
  uint64_t in_arrays[4 * TCC_OP_INLINE_RANKS];
};

/* Appends op to a singly linked list (op->next) of ops. */
static inline void tcc__queue_push(tcc_op_t **head, tcc_op_t **tail, tcc_op_t *op) {
  op->next = NULL;
  if (*tail) (*tail)->next = op; else *head = op;
  *tail = op;
}

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
  const struct tcc_transport_ops *ops;
  void *transport_state;
  struct tcc_engine *engine; /* the host executor's state (host/) */
  void *device_state;        /* the device executor's state (core/executor.h) */
  void *coll_scratch;        /* the collective algorithms' (coll/) */
  atomic_ullong coll_issued;   /* collectives issued (sequence numbers) */
  atomic_int aborted;          /* set by abort or a fatal failure */
  tcc_result_t fail_code;      /* why aborted */
  pthread_mutex_t fail_lock;
  char fail_msg[TCC_ERRLEN];
  tcc__cpu_share_t cpu_share; /* set by the transport; zero: not known */
  atomic_int group_depth; /* tcc_comm_group_start nesting */
  pthread_mutex_t group_lock;
  /* A view (core/view.c) is a subset of a communicator's ranks that the
   * hierarchical algorithms run one phase on, over a transport of its own.
   * It has no executors; its parent runs it. members[r]: the parent's rank
   * of view rank r, so messages name ranks as the user knows them. Both
   * NULL for a communicator. */
  tcc_comm_t *parent;
  int *members;
  /* Groups that span hosts (transport/hybrid/): where the ranks are and
   * the views over them; NULL for a group on one transport. */
  struct tcc__topology *topo;
};

/* The rank the user knows rank r of comm by (the parent's, for a view). */
static inline int tcc__rank_label(const tcc_comm_t *comm, int r) {
  return comm->members && r >= 0 && r < comm->size ? comm->members[r] : r;
}
/* This rank, as the user knows it. */
static inline int tcc__self_label(const tcc_comm_t *comm) { return tcc__rank_label(comm, comm->rank); }

/* core/view.c. A view of `size` of parent's ranks (members[r]: parent rank
 * of view rank r; this rank is view rank `rank`), named and timed like the
 * parent, with no transport yet: the caller sets one up, then attaches the
 * algorithms' scratch (tcc__coll_attach). */
tcc_comm_t *tcc__comm_view_new(tcc_comm_t *parent, int rank, int size, const int *members, tcc_err_t *err);
/* Marks the view failed with the parent's cause (the parent failed), so a
 * phase waiting in it returns soon. */
void tcc__comm_view_fail(tcc_comm_t *view);
/* Tears down the view's transport and frees it. */
void tcc__comm_view_free(tcc_comm_t *view);

/* Marks the communicator failed (first failure wins) so later ops fail
 * fast with `code` and `msg`; wakes every thread. */
void tcc__comm_fail(tcc_comm_t *comm, tcc_result_t code, const char *msg);
/* Drops a reference; the last one frees the communicator's memory. */
void tcc__comm_release(tcc_comm_t *comm);
/* The communicator's failure: its code with the message copied into msg,
 * or TCC_OK (msg empty) while it has not failed. */
tcc_result_t tcc__comm_failure(tcc_comm_t *comm, char *msg, size_t len);

/* The allocator of tcc_set_device_allocator, or NULL (core/device_alloc.c). */
const tcc_device_allocator_t *tcc__device_allocator(void);

/* Marks `op` as running from now: its own timeout starts to count, and
 * tcc_op_started() reports it to other threads. Called by the executor
 * that runs it, once. */
static inline void tcc__op_begin(tcc_op_t *op) {
  op->deadline_ns = tcc__coarse_deadline_after_ms(op->timeout_ms);
  atomic_store_explicit(&op->started, 1, memory_order_release);
}

/* Zeroed memory for a new op (NULL: out of memory). */
tcc_op_t *tcc__op_memory(void);
/* Finishes an op: records result/message, runs the callback, wakes waiters. */
void tcc__op_finish(tcc_op_t *op, tcc_result_t result, const char *msg);
/* "allreduce", "send", ... */
const char *tcc__op_name(const tcc_op_t *op);

#endif /* TCC_INTERNAL_H */
