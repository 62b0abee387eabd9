/*
 * tccomm.h - the whole public API of the tccomm C core.
 *
 * A communicator (tcc_comm_t) connects `size` ranks. Collectives of one
 * communicator must be issued in the same order on every rank; the engine
 * executes them in that order. Point-to-point messages are matched by
 * (peer, tag, issue order) and progress independently of collectives.
 *
 * Every call returns a tcc_result_t. Every operation is asynchronous and
 * hands back an op handle (tcc_op_t) to test, wait on, or attach a
 * completion callback to. Errors carry a message that names the op, the
 * communicator, this rank, the peer when there is one, and the cause.
 *
 * Bootstrap is done by the caller: every rank opens an endpoint, publishes
 * its blob (TCC_ENDPOINT_BLOB_SIZE bytes) through any key-value store, and
 * passes all blobs, in rank order, to tcc_comm_create().
 */
#ifndef TCCOMM_H
#define TCCOMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TCC_VERSION_MAJOR 0
#define TCC_VERSION_MINOR 1

typedef enum tcc_result {
  TCC_OK = 0,
  TCC_ERR_INVALID = 1,      /* bad argument detected before anything was sent */
  TCC_ERR_MISMATCH = 2,     /* ranks disagree on the op (shape, dtype, root, ...) */
  TCC_ERR_TIMEOUT = 3,      /* a peer did not arrive in time */
  TCC_ERR_ABORTED = 4,      /* the communicator was aborted or has failed */
  TCC_ERR_SYSTEM = 5,       /* an OS call failed (errno in the message) */
  TCC_ERR_UNSUPPORTED = 6,  /* dtype x op combination not supported */
  TCC_ERR_REMOTE = 7,       /* a peer closed its connection or failed */
  TCC_ERR_INPROGRESS = 8    /* tcc_op_wait timed out: the op is still running */
} tcc_result_t;

typedef enum tcc_dtype {
  TCC_FLOAT32 = 0,
  TCC_FLOAT64,
  TCC_FLOAT16,
  TCC_BFLOAT16,
  TCC_INT8,
  TCC_INT16,
  TCC_INT32,
  TCC_INT64,
  TCC_UINT8,
  TCC_BOOL,
  TCC_DTYPE_COUNT
} tcc_dtype_t;

typedef enum tcc_redop {
  TCC_SUM = 0,
  TCC_AVG,
  TCC_PRODUCT,
  TCC_MIN,
  TCC_MAX,
  TCC_BAND,
  TCC_BOR,
  TCC_BXOR,
  TCC_PREMUL_SUM, /* each input multiplied by tcc_op_opts_t.premul_factor, then summed */
  TCC_REDOP_COUNT
} tcc_redop_t;

/* A buffer: `count` elements of `dtype` at `ptr`. device -1 is host memory. */
typedef struct tcc_buf {
  void *ptr;
  size_t count;
  tcc_dtype_t dtype;
  int device;
  void *stream; /* CUDA: the stream the op must be ordered after; NULL on host */
} tcc_buf_t;

/* Per-op options; pass NULL for the defaults. */
typedef struct tcc_op_opts {
  int64_t timeout_ms;    /* <= 0: the communicator's timeout */
  double premul_factor;  /* TCC_PREMUL_SUM only */
  /* TCC_PREMUL_SUM of CUDA buffers: when not NULL, the factor is the one
   * element of the buffers' dtype at this device address, read by the
   * device when the reduction runs (no host sync, legal under graph
   * capture; it must stay valid until the op completes) instead of
   * premul_factor. Ignored on host buffers. */
  const void *premul_device_factor;
} tcc_op_opts_t;

typedef struct tcc_endpoint tcc_endpoint_t;
typedef struct tcc_comm tcc_comm_t;
typedef struct tcc_op tcc_op_t;

/* ---- errors ---------------------------------------------------------- */

/* Errors. Every call that can fail returns a tcc_result_t. When it fails,
 * the reason (naming the call, the group, the rank, the peer when there is
 * one, and the cause) stays readable on the calling thread until that
 * thread's next failing call: tcc_last_error(). An op that fails after it
 * was issued carries its reason itself (tcc_op_error), and a communicator
 * that failed keeps its first cause (tcc_comm_failure). */
const char *tcc_last_error(void);
const char *tcc_result_string(tcc_result_t r);
size_t tcc_dtype_size(tcc_dtype_t dt);
const char *tcc_dtype_name(tcc_dtype_t dt);
const char *tcc_redop_name(tcc_redop_t op);
/* TCC_OK when `op` can reduce `dt`, else TCC_ERR_UNSUPPORTED. */
tcc_result_t tcc_redop_supported(tcc_dtype_t dt, tcc_redop_t op);

/* ---- bootstrap ------------------------------------------------------- */

#define TCC_ENDPOINT_BLOB_SIZE 256

/* Opens a listening socket on all interfaces and writes this process's
 * endpoint blob (hostname, boot id, `advertise_addr`:port, a random token)
 * to blob_out. advertise_addr is the IPv4 address peers on other hosts use
 * to reach this one; NULL or "" means 127.0.0.1. */
tcc_result_t tcc_endpoint_open(const char *advertise_addr, tcc_endpoint_t **ep,
                               uint8_t blob_out[TCC_ENDPOINT_BLOB_SIZE]);
void tcc_endpoint_close(tcc_endpoint_t *ep);

typedef enum tcc_transport {
  TCC_TRANSPORT_AUTO = 0, /* shared memory when every rank is on this host, else TCP */
  TCC_TRANSPORT_SHM,
  TCC_TRANSPORT_TCP,
  /* Shared memory between the ranks of each host, TCP between hosts, with
   * hierarchical collectives: what AUTO chooses when some ranks share a
   * host and others do not. */
  TCC_TRANSPORT_HYBRID
} tcc_transport_t;

typedef struct tcc_comm_config {
  int rank;
  int size;
  int64_t timeout_ms;        /* default per-op timeout; also bounds creation */
  const char *name;          /* for error messages; may be NULL */
  tcc_transport_t transport; /* AUTO honours the TCCOMM_TRANSPORT env variable */
} tcc_comm_config_t;

/* Collective over all ranks. `blobs` holds size * TCC_ENDPOINT_BLOB_SIZE
 * bytes in rank order; `ep` is this rank's endpoint (its blob must be at
 * index rank) and is consumed whatever the result. */
tcc_result_t tcc_comm_create(const tcc_comm_config_t *cfg, tcc_endpoint_t *ep,
                             const uint8_t *blobs, tcc_comm_t **comm);

int tcc_comm_rank(const tcc_comm_t *comm);
int tcc_comm_size(const tcc_comm_t *comm);
const char *tcc_comm_name(const tcc_comm_t *comm);
/* "shm", "tcp" or "shm+tcp" (hybrid) */
const char *tcc_comm_transport_name(const tcc_comm_t *comm);
void tcc_comm_set_timeout(tcc_comm_t *comm, int64_t timeout_ms);
/* Number of collectives issued so far. */
uint64_t tcc_comm_collective_count(const tcc_comm_t *comm);
/* TCC_OK while usable; after a timeout, an abort or a dead peer every new
 * op fails with the code returned here, and tcc_comm_failure() says why
 * (the first cause; "" while usable). */
tcc_result_t tcc_comm_status(const tcc_comm_t *comm);
const char *tcc_comm_failure(const tcc_comm_t *comm);

/* Fails every pending and future op with TCC_ERR_ABORTED and wakes every
 * waiter; does not free. Safe from any thread. */
void tcc_comm_abort(tcc_comm_t *comm);
/* Fails the ops still pending with TCC_ERR_ABORTED (threads waiting on
 * them return at once), stops the engine threads and releases the
 * communicator's threads, sockets and shared memory. `comm` is invalid
 * after; its op handles stay valid until released. Peers that wait on this
 * rank fail soon, saying it destroyed its communicator. Safe while other
 * threads wait on its ops; not while another thread issues ops on it. */
void tcc_comm_destroy(tcc_comm_t *comm);

/* ---- collectives ----------------------------------------------------- */
/* `recvs` / `sends` arrays hold `size` buffers, index = peer rank.
 * Arrays only used on the root may be NULL elsewhere. In-place is allowed
 * where send and recv are the same memory. */
/* Every op below returns an op handle in *op, to wait on and release.
 * With op NULL the call is blocking instead: it returns once the op has
 * finished, with the op's result (its reason in tcc_last_error()), as an
 * issue followed by tcc_op_wait(op, -1) would. A collective on host memory
 * then runs in the calling thread whenever nothing issued before it is
 * still queued, without the op's bookkeeping, and so does a small send or
 * receive on host memory when nothing issued before it goes to or could
 * take its message: what a program that waits at once should use. */

tcc_result_t tcc_broadcast(tcc_comm_t *comm, tcc_buf_t buf, int root,
                           const tcc_op_opts_t *opts, tcc_op_t **op);
tcc_result_t tcc_allreduce(tcc_comm_t *comm, tcc_buf_t send, tcc_buf_t recv,
                           tcc_redop_t redop, const tcc_op_opts_t *opts, tcc_op_t **op);
tcc_result_t tcc_reduce(tcc_comm_t *comm, tcc_buf_t send, tcc_buf_t recv,
                        tcc_redop_t redop, int root, const tcc_op_opts_t *opts,
                        tcc_op_t **op);
tcc_result_t tcc_allgather(tcc_comm_t *comm, tcc_buf_t send, const tcc_buf_t *recvs,
                           const tcc_op_opts_t *opts, tcc_op_t **op);
tcc_result_t tcc_gather(tcc_comm_t *comm, tcc_buf_t send, const tcc_buf_t *recvs,
                        int root, const tcc_op_opts_t *opts, tcc_op_t **op);
tcc_result_t tcc_scatter(tcc_comm_t *comm, const tcc_buf_t *sends, tcc_buf_t recv,
                         int root, const tcc_op_opts_t *opts, tcc_op_t **op);
tcc_result_t tcc_reduce_scatter(tcc_comm_t *comm, const tcc_buf_t *sends, tcc_buf_t recv,
                                tcc_redop_t redop, const tcc_op_opts_t *opts,
                                tcc_op_t **op);
/* Each sends[j] / recvs[j] may have its own count (all-to-all-v). */
tcc_result_t tcc_alltoall(tcc_comm_t *comm, const tcc_buf_t *sends, const tcc_buf_t *recvs,
                          const tcc_op_opts_t *opts, tcc_op_t **op);
tcc_result_t tcc_barrier(tcc_comm_t *comm, const tcc_op_opts_t *opts, tcc_op_t **op);

/* ---- point to point -------------------------------------------------- */

tcc_result_t tcc_send(tcc_comm_t *comm, tcc_buf_t buf, int peer, uint64_t tag,
                      const tcc_op_opts_t *opts, tcc_op_t **op);
/* peer TCC_ANY_SOURCE receives the first message with `tag` from any
 * rank; tcc_op_peer tells which once the receive completed. A message
 * goes to the earliest-posted receive it matches, specific or not. */
#define TCC_ANY_SOURCE (-1)
tcc_result_t tcc_recv(tcc_comm_t *comm, tcc_buf_t buf, int peer, uint64_t tag,
                      const tcc_op_opts_t *opts, tcc_op_t **op);

/* ---- op handles ------------------------------------------------------ */

/* 1 when finished (successfully or not), 0 while running. Never blocks. */
int tcc_op_test(tcc_op_t *op);
/* Blocks until the op finishes or timeout_ms passes (< 0: no limit; the op's
 * own timeout still applies). Returns the op's result, or
 * TCC_ERR_INPROGRESS if timeout_ms passed first: the op keeps running
 * under its own deadline and a later wait can still see it complete. */
tcc_result_t tcc_op_wait(tcc_op_t *op, int64_t timeout_ms);
/* The op's result: TCC_ERR_INPROGRESS while running. */
tcc_result_t tcc_op_result(const tcc_op_t *op);
/* The failure message; "" on success or while running. */
const char *tcc_op_error(const tcc_op_t *op);
/* A point-to-point op's peer: for a TCC_ANY_SOURCE receive, the rank whose
 * message it received once it completed (TCC_ANY_SOURCE before); -1 for a
 * collective. */
int tcc_op_peer(const tcc_op_t *op);
/* 1 once the op began running (a collective reached the front of its
 * communicator's queue, a point-to-point op reached the engine, a device op
 * was enqueued on its stream) or finished; 0 while it waits behind others.
 * Never blocks: what a flight recorder reports as "started". */
int tcc_op_started(const tcc_op_t *op);
/* Makes sure the op makes progress although no thread waits on it. Without
 * it, an op nobody waits on may start a few milliseconds late (the engine
 * does not wake a thread per submit). Call it when the op is handed to code
 * that will not wait on it, e.g. a future or a completion poll. */
void tcc_op_start(tcc_op_t *op);
/* Calls fn(op, arg) exactly once when the op finishes, on the engine thread,
 * or at once on the calling thread if it already has. The callback must
 * not block on other ops of the same communicator: hand anything that may
 * (user continuations) to tcc_run_detached. An op takes one callback:
 * TCC_OK, or TCC_ERR_INVALID (fn will not run) when it has one already. */
typedef void (*tcc_op_callback_t)(tcc_op_t *op, void *arg);
tcc_result_t tcc_op_on_complete(tcc_op_t *op, tcc_op_callback_t fn, void *arg);
void tcc_op_retain(tcc_op_t *op);
void tcc_op_release(tcc_op_t *op);

/* Runs fn(arg) soon on one of the core's callback threads, never on a
 * thread that progresses ops, so fn may block, even on later ops of the
 * communicator whose completion scheduled it (a continuation that waits for
 * the next collective). A task that finds every callback thread busy gets
 * a new thread, so blocked tasks never hold up later ones. TCC_ERR_SYSTEM
 * when no thread can be started (fn is then not called). */
tcc_result_t tcc_run_detached(void (*fn)(void *arg), void *arg);

/* ---- windows (one-sided RMA over shared memory) ----------------------- */
/* A window gives every rank of a communicator a buffer that every other
 * rank can write (put) and read (a mapped view) without the owner taking
 * part, plus per-pair signal counters to say "my puts are done". It lives in
 * one shared-memory segment, so it needs ranks on one host: creation fails
 * with TCC_ERR_UNSUPPORTED on a communicator that uses TCP.
 *
 * Ordering: puts and signals from one rank to another are seen in the order
 * they were made; a wait_signal that returns guarantees that every put the
 * peer made before the matching signal is visible. */

typedef struct tcc_window tcc_window_t;

/* `bytes` of a rank that cannot take part (its caller rejected the buffer):
 * creation then fails on every rank at once, naming it, instead of leaving
 * the others to wait for their timeout. */
#define TCC_WINDOW_DECLINE SIZE_MAX

/* Collective over `comm` (every rank calls it, in the same order relative
 * to the communicator's collectives). Each rank asks for `bytes` of its own
 * (they may differ); the buffers start zeroed. Blocks until every rank has
 * mapped the window, bounded by timeout_ms (<= 0: the communicator's).
 * The window does not keep `comm`: it stays valid after the communicator
 * is destroyed. */
tcc_result_t tcc_window_create(tcc_comm_t *comm, size_t bytes, int64_t timeout_ms, tcc_window_t **win);
int tcc_window_rank(const tcc_window_t *win);
int tcc_window_size(const tcc_window_t *win);
/* The mapped buffer of `rank` (this rank's own included) and its size in
 * bytes; NULL for a rank out of range. Valid until tcc_window_destroy. */
void *tcc_window_buffer(tcc_window_t *win, int rank, size_t *bytes);
/* Copies `bytes` from src into the buffer of dst_rank at byte `offset`.
 * Done when the call returns. */
tcc_result_t tcc_window_put(tcc_window_t *win, const void *src, size_t bytes, int dst_rank,
                            size_t offset);
/* Bumps the counter this rank owns at dst_rank and wakes a waiter there. */
tcc_result_t tcc_window_signal(tcc_window_t *win, int dst_rank);
/* Waits until `peer` has signalled this rank once more than the signals
 * already consumed, and consumes it. TCC_ERR_TIMEOUT after timeout_ms
 * (<= 0: the window's default, the communicator's timeout at creation). */
tcc_result_t tcc_window_wait_signal(tcc_window_t *win, int peer, int64_t timeout_ms);
/* Unmaps this rank's view; local, never blocks. The memory itself lives
 * until every rank has destroyed its window. */
void tcc_window_destroy(tcc_window_t *win);

/* ---- CUDA ------------------------------------------------------------ */
/* A buffer with device >= 0 is CUDA memory on that device; `stream` (a
 * cudaStream_t, NULL = the legacy default stream) is the caller's stream.
 * All buffers of one op must be on the same device, and a communicator
 * uses one device. Such an op runs through NCCL on a stream of the core
 * (tcc_op_cuda_stream), which first waits for the caller's stream; the op
 * is complete when that work is (tcc_op_test / tcc_op_wait observe it from
 * the host, tcc_op_stream_wait makes another stream wait for it).
 *
 * The group's NCCL communicator is created at the first CUDA collective or
 * group (every rank must issue it) or by tcc_comm_cuda_init; a send/recv
 * outside a group uses a two-rank NCCL communicator with its peer, created
 * at their first one, with a stream of its own (an irecv waiting for its
 * peer holds up no collective). NCCL communicators are nonblocking: every
 * NCCL step is bounded by the op's timeout, and tcc_comm_abort releases a
 * thread waiting in one. Unlike host collectives, CUDA collectives are not
 * cross-checked between ranks, and point-to-point tags are ignored (NCCL
 * matches sends and receives by order per peer).
 *
 * Ops enqueued while the caller's stream is capturing a CUDA graph are
 * complete at once from the host's view (the graph replays them); their
 * events are never queried and no host callback is tied to them. */

/* Where the core gets the device memory it stages through (list-form
 * allgather / reduce_scatter whose per-peer buffers are not one block):
 * alloc returns `bytes` usable in order on `stream` (a cudaStream_t) of
 * `device`, or NULL; free gives them back, in order on that stream. The
 * torch shim passes torch's caching allocator, so the memory is reused,
 * counted by torch.cuda.memory_*, and taken from a graph's private pool
 * under capture. Without one (or with NULL), cudaMallocAsync and
 * cudaFreeAsync. Process-wide; set it before the first CUDA op. */
typedef struct tcc_device_allocator {
  void *(*alloc)(void *ctx, size_t bytes, int device, void *stream);
  void (*free)(void *ctx, void *ptr, int device, void *stream);
  void *ctx;
} tcc_device_allocator_t;
void tcc_set_device_allocator(const tcc_device_allocator_t *allocator);

/* 1 when this build of the core has the CUDA path (the NCCL executor
 * of src/nccl/), else 0: CUDA buffers are then rejected. */
int tcc_cuda_built(void);
/* The NCCL_VERSION_CODE of the nccl.h the core was built with (0 without CUDA). */
int tcc_nccl_header_version(void);
/* Loads NCCL (the copy already in the process when there is one) and
 * returns its version in *version. */
tcc_result_t tcc_nccl_runtime_version(int *version);
/* Creates the NCCL communicator for `device` now rather than at the first
 * CUDA op. Collective: every rank calls it. */
tcc_result_t tcc_comm_cuda_init(tcc_comm_t *comm, int device);
/* Gives `child` its NCCL communicator by splitting `parent`'s
 * (ncclCommSplit, NCCL >= 2.18): it shares the parent's setup instead of
 * bootstrapping a new one at its first collective, as ProcessGroupNCCL's
 * split does. Collective over every rank of `parent`, issued in order with
 * the parent's ops: a rank outside every child passes child = NULL and
 * color TCC_SPLIT_NOCOLOR. `color` (>= 0) is the same on the members of one
 * child and differs between children; the child's ranks order them. Does
 * nothing (TCC_OK, on every rank alike) while the parent has no NCCL
 * communicator yet or the NCCL found has no split: the child then sets up
 * its own at its first CUDA collective. *split_done (may be NULL) says
 * which. */
#define TCC_SPLIT_NOCOLOR (-1)
tcc_result_t tcc_comm_cuda_split(tcc_comm_t *parent, int color, tcc_comm_t *child, int *split_done);
/* The communicator's CUDA device and the stream (cudaStream_t) of its
 * collectives; -1 / NULL before its group NCCL communicator exists. */
int tcc_comm_cuda_device(const tcc_comm_t *comm);
void *tcc_comm_cuda_stream(const tcc_comm_t *comm);
/* Blocks until the device finished every CUDA op issued on the
 * communicator so far (its NCCL streams are idle), or timeout_ms (<= 0: the
 * communicator's) passed: TCC_ERR_TIMEOUT. What a barrier does before it
 * meets the other ranks, so that it orders device work as nccl's does.
 * TCC_OK at once when no CUDA op was issued. */
tcc_result_t tcc_comm_cuda_synchronize(tcc_comm_t *comm, int64_t timeout_ms);
/* Brackets ops whose CUDA parts are issued as one NCCL group (one launch).
 * Nestable; start and end must be called on the same thread (and destroy,
 * if it comes first). NCCL's groups are per thread: while any
 * communicator's group is open on a thread, every CUDA op that thread
 * issues, on any communicator, is launched at the thread's outermost group
 * end and completes only after it. Host ops are unaffected. */
tcc_result_t tcc_comm_group_start(tcc_comm_t *comm);
tcc_result_t tcc_comm_group_end(tcc_comm_t *comm);
/* 1 for an op on CUDA buffers. */
int tcc_op_is_cuda(const tcc_op_t *op);
/* The stream (cudaStream_t) a CUDA op's NCCL work runs on: the group's for
 * collectives, the pair's for a send/recv outside a group; NULL for a host
 * op. The caller's tensors are in use on it until the op completes. */
void *tcc_op_cuda_stream(const tcc_op_t *op);
/* Makes `stream` wait (on the device, the host does not block) until the
 * CUDA op completes. TCC_OK at once for host ops. */
tcc_result_t tcc_op_stream_wait(tcc_op_t *op, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TCCOMM_H */
