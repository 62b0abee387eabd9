/*
 * ops_api.c - the public op entry points.
 *
 * Every public op validates its arguments here, before anything is queued,
 * so a bad call fails at once with TCC_ERR_INVALID / TCC_ERR_UNSUPPORTED
 * on the calling rank and never reaches the peers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/executor.h"
#include "core/log.h"

/* Checks shared by every op; `what` names the op in messages. */
static tcc_result_t check_usable(tcc_comm_t *comm, const char *what) {
  if (!atomic_load(&comm->aborted)) return TCC_OK;
  char cause[TCC_ERRLEN];
  tcc_result_t code = tcc__comm_failure(comm, cause, sizeof cause);
  return tcc__fail(code, "tccomm %s on '%s' (rank %d): communicator is no longer usable: %.400s", what,
                comm->name, comm->rank, cause);
}

/* "host memory", or the device executor's name for `device`. */
static void describe_memory(int device, char *out, size_t len) {
  if (device < 0) snprintf(out, len, "%s", tcc__host_executor.memory_name);
  else snprintf(out, len, "%s %d", tcc__device_executor.memory_name, device);
}

/* `dev` is the device of the op's first buffer: one op never mixes host
 * and device memory, nor two devices. */
static tcc_result_t check_buf_fully(tcc_comm_t *comm, const char *what, const char *role, tcc_buf_t b, int dev) {
  if ((unsigned)b.dtype >= TCC_DTYPE_COUNT)
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': %s buffer has an invalid dtype (%d)", what,
                  comm->name, role, (int)b.dtype);
  if (b.device < -1)
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': %s buffer has an invalid device (%d)", what,
                  comm->name, role, b.device);
  if (b.device >= 0 && tcc__device_executor.accepts) {
    tcc_result_t r = tcc__device_executor.accepts(comm, what, role, b.device);
    if (r != TCC_OK) return r;
  }
  if (b.device != dev) {
    char a[48], c[48];
    describe_memory(dev, a, sizeof a);
    describe_memory(b.device, c, sizeof c);
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': the op mixes %s and %s (%s buffer)", what,
                  comm->name, a, c, role);
  }
  if (b.count > 0 && !b.ptr)
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': %s buffer is NULL with %zu elements", what,
                  comm->name, role, b.count);
  return TCC_OK;
}

/* What passes every check of check_buf_fully for host memory, decided
 * inline: the common case of every op takes no call for it. */
static inline bool host_buf_valid(tcc_buf_t b, int dev) {
  return b.device == -1 && dev == -1 && (unsigned)b.dtype < TCC_DTYPE_COUNT && (b.ptr || b.count == 0);
}

static inline tcc_result_t check_buf_on(tcc_comm_t *comm, const char *what, const char *role, tcc_buf_t b,
                                        int dev) {
  return host_buf_valid(b, dev) ? TCC_OK : check_buf_fully(comm, what, role, b, dev);
}

static tcc_result_t check_buf(tcc_comm_t *comm, const char *what, const char *role, tcc_buf_t b) {
  return check_buf_on(comm, what, role, b, b.device);
}

static tcc_result_t check_same_dtype(tcc_comm_t *comm, const char *what, tcc_buf_t a, tcc_buf_t b) {
  if (a.dtype == b.dtype) return TCC_OK;
  return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': dtypes differ (%s vs %s)", what, comm->name,
                tcc_dtype_name(a.dtype), tcc_dtype_name(b.dtype));
}

static tcc_result_t check_count(tcc_comm_t *comm, const char *what, const char *role, size_t got,
                                size_t want) {
  if (got == want) return TCC_OK;
  return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': %s has %zu elements, expected %zu", what,
                comm->name, role, got, want);
}

static tcc_result_t check_root(tcc_comm_t *comm, const char *what, int root) {
  if (root >= 0 && root < comm->size) return TCC_OK;
  return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': root %d is out of range [0, %d)", what,
                comm->name, root, comm->size);
}

static inline tcc_result_t check_redop(tcc_comm_t *comm, const char *what, tcc_dtype_t dt, tcc_redop_t op) {
  /* Sum, product, min and max reduce every dtype: no call for them. */
  const bool any_dtype = (op == TCC_SUM || op == TCC_PRODUCT || op == TCC_MIN || op == TCC_MAX) &&
                         (unsigned)dt < TCC_DTYPE_COUNT;
  if (any_dtype || ((unsigned)op < TCC_REDOP_COUNT && tcc_redop_supported(dt, op) == TCC_OK)) return TCC_OK;
  return tcc__fail(TCC_ERR_UNSUPPORTED, "tccomm %s on '%s': reduce op %s is not supported for %s", what,
                comm->name, tcc_redop_name(op), tcc_dtype_name(dt));
}

static int64_t op_timeout(tcc_comm_t *comm, const tcc_op_opts_t *opts) {
  return opts && opts->timeout_ms > 0 ? opts->timeout_ms : atomic_load(&comm->timeout_ms);
}

static tcc_op_t *op_alloc(tcc_comm_t *comm, tcc_op_kind_t kind, const tcc_op_opts_t *opts) {
  tcc_op_t *op = tcc__op_memory();
  if (!op) return NULL;
  atomic_store_explicit(&op->refs, 1, memory_order_relaxed); /* no other thread has it yet */
  atomic_fetch_add(&comm->refs, 1); /* released with the op */
  op->comm = comm;
  op->kind = kind;
  op->timeout_ms = op_timeout(comm, opts);
  op->result = TCC_ERR_INPROGRESS;
  op->device = -1;
  op->exec = &tcc__host_executor; /* until submit_op picks; releasing an unsubmitted op needs one */
  return op;
}

/* Lays out the per-peer lists of c (pointers, then counts) in `mem`, of
 * 4 * n words, from the buffers the caller passed: every entry written
 * (those of a list not passed are NULL and 0). */
static void fill_arrays(tcc_coll_t *c, uint64_t *mem, int n, const tcc_buf_t *sends, const tcc_buf_t *recvs) {
  _Static_assert(sizeof(void *) <= sizeof(uint64_t) && sizeof(size_t) <= sizeof(uint64_t), "a word holds an entry");
  void **send_ptrs = (void **)mem, **recv_ptrs = (void **)(mem + n);
  size_t *send_counts = (size_t *)(mem + 2 * n), *recv_counts = send_counts + n;
  for (int j = 0; j < n; j++) {
    send_ptrs[j] = sends ? sends[j].ptr : NULL;
    send_counts[j] = sends ? sends[j].count : 0;
    recv_ptrs[j] = recvs ? recvs[j].ptr : NULL;
    recv_counts[j] = recvs ? recvs[j].count : 0;
  }
  c->sends = sends ? send_ptrs : NULL;
  c->recvs = recvs ? recv_ptrs : NULL;
  c->send_counts = send_counts;
  c->recv_counts = recv_counts;
}

/* Lists of more than TCC_OP_INLINE_RANKS ranks: allocated (NULL: out of memory). */
static uint64_t *lists_memory(int n) { return n <= TCC_OP_INLINE_RANKS ? NULL : calloc(4 * (size_t)n, sizeof(uint64_t)); }

/* Copies the per-peer arrays the caller passed so they may be freed as
 * soon as the call returns: into the op itself in small groups, else into
 * one allocation. */
static int own_arrays(tcc_op_t *op, int n, const tcc_buf_t *sends, const tcc_buf_t *recvs) {
  uint64_t *mem = op->in_arrays;
  if (n > TCC_OP_INLINE_RANKS) {
    if (!(mem = lists_memory(n))) return -1;
    op->owned_arrays = mem;
  }
  fill_arrays(&op->coll, mem, n, sends, recvs);
  return 0;
}

static int has_root(tcc_coll_kind_t kind) {
  return kind == TCC_COLL_BROADCAST || kind == TCC_COLL_REDUCE || kind == TCC_COLL_GATHER || kind == TCC_COLL_SCATTER;
}

/* TRACE: one line per op as issued. Reads only what the executor never
 * changes, and a collective's sequence number, which submit assigned in
 * this thread (a p2p op's is the p2p thread's: not read here). */
static void trace_issued(tcc_comm_t *comm, const tcc_op_t *op) {
  char mem[48];
  describe_memory(op->device, mem, sizeof mem);
  if (op->kind != TCC_OP_COLL) {
    char peer[32];
    if (op->peer == TCC_ANY_SOURCE) snprintf(peer, sizeof peer, "any source");
    else snprintf(peer, sizeof peer, "peer %d", op->peer);
    TCC_LOG_TRACE(comm->rank, "%s on '%s': %zu bytes, %s %s tag %llu, %s, executor %s, algorithm %s p2p",
                  tcc__op_name(op), comm->name, op->bytes, op->kind == TCC_OP_SEND ? "to" : "from", peer,
                  (unsigned long long)op->tag, mem, op->exec->name, op->device < 0 ? tcc_comm_transport_name(comm) : op->exec->name);
    return;
  }
  char seq[32] = "";
  if (op->seq) snprintf(seq, sizeof seq, " #%llu", (unsigned long long)op->seq);
  const tcc_coll_t *c = &op->coll;
  size_t count = c->count;
  if (c->kind == TCC_COLL_ALLTOALL) /* per-peer counts: what this rank sends in all */
    for (int j = 0; j < comm->size; j++) count += c->send_counts[j];
  char root[32] = "";
  if (has_root(c->kind)) snprintf(root, sizeof root, ", root %d", c->root);
  /* The device executor's library picks its own algorithm. */
  const char *algorithm = op->device < 0 ? tcc__coll_algorithm(comm, c) : op->exec->name;
  TCC_LOG_TRACE(comm->rank, "%s%s on '%s': %s count %zu (%zu bytes)%s, %s, executor %s, algorithm %s",
                tcc__coll_name(c->kind), seq, comm->name, tcc_dtype_name(c->dtype), count,
                count * tcc__dtype_size(c->dtype), root, mem, op->exec->name, algorithm);
}

/* Hands a built op to its executor: host memory to the host executor,
 * device memory to the device executor; `where` (any buffer of the op)
 * also carries the caller's stream. */
static tcc_result_t submit_op(tcc_comm_t *comm, tcc_op_t *op, tcc_buf_t where, tcc_op_t **out) {
  op->device = where.device;
  op->exec = where.device >= 0 ? &tcc__device_executor : &tcc__host_executor;
  tcc_err_t err;
  tcc__err_reset(&err);
  tcc_result_t r = op->exec->submit(comm, op, where.stream, &err);
  if (r != TCC_OK) {
    tcc_op_release(op);
    return tcc__fail_with(&err, r);
  }
  if (TCC__LOG_ON(TCC__LOG_TRACE)) trace_issued(comm, op);
  *out = op;
  return TCC_OK;
}

#define TRY(expr)                       \
  do {                                  \
    tcc_result_t tcc_try_r_ = (expr);   \
    if (tcc_try_r_ != TCC_OK) return tcc_try_r_; \
  } while (0)

/* A blocking call that could not return: refused before anything is issued. */
static tcc_result_t check_can_block(tcc_comm_t *comm, const char *what, tcc_buf_t where) {
  const tcc__executor_t *exec = where.device >= 0 ? &tcc__device_executor : &tcc__host_executor;
  const char *why = exec->cannot_block ? exec->cannot_block(comm) : NULL;
  if (!why) return TCC_OK;
  return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s' (rank %d): a blocking call (no op handle) cannot be made here: %s",
                   what, comm->name, comm->rank, why);
}

/* The caller of a blocking call (no op handle) waits for its op here,
 * then releases it: the op's result, its reason the thread's last error. */
static tcc_result_t wait_blocking(tcc_op_t *op) {
  const tcc_result_t r = tcc_op_wait(op, -1);
  if (r != TCC_OK) tcc__fail(r, "%s", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}

/* `where` is any buffer of the op: its device (and, for device memory,
 * the caller's stream) decide which executor runs it. Inline in every
 * entry point, so that the compiler writes the entry point's collective
 * straight into the op instead of building it on the stack and copying. */
static inline __attribute__((always_inline)) tcc_result_t issue_coll(tcc_comm_t *comm, const tcc_coll_t *c, const tcc_op_opts_t *opts,
                                const tcc_buf_t *sends, const tcc_buf_t *recvs, tcc_buf_t where,
                                tcc_op_t **out) {
  tcc_op_t *op = op_alloc(comm, TCC_OP_COLL, opts);
  if (!op) return tcc__fail(TCC_ERR_SYSTEM, "tccomm: out of memory");
  op->coll = *c;
  op->coll.premul = opts ? opts->premul_factor : 1.0;
  op->coll.premul_device = opts ? opts->premul_device_factor : NULL;
  op->coll.sends = op->coll.recvs = NULL;
  if ((sends || recvs) && own_arrays(op, comm->size, sends, recvs) != 0) {
    tcc_op_release(op);
    return tcc__fail(TCC_ERR_SYSTEM, "tccomm: out of memory");
  }
  return submit_op(comm, op, where, out);
}

/* A blocking collective (no op handle): run at once by the executor when
 * it can (tcc__executor_t.run_now), else issued and waited for. Not while
 * tracing: the trace shows every op as issued. */
static __attribute__((noinline)) tcc_result_t run_coll_blocking(tcc_comm_t *comm, tcc_coll_t *c,
                                                                const tcc_op_opts_t *opts, const tcc_buf_t *sends,
                                                                const tcc_buf_t *recvs, tcc_buf_t where) {
  const tcc__executor_t *exec = where.device >= 0 ? &tcc__device_executor : &tcc__host_executor;
  if (exec->run_now && !TCC__LOG_ON(TCC__LOG_TRACE)) {
    /* c, the entry point's, is completed in place: issue_coll below
     * copies it and sets these fields again. */
    c->premul = opts ? opts->premul_factor : 1.0;
    c->premul_device = opts ? opts->premul_device_factor : NULL;
    c->sends = c->recvs = NULL;
    uint64_t inline_lists[4 * TCC_OP_INLINE_RANKS], *lists = NULL;
    if (sends || recvs) {
      lists = comm->size <= TCC_OP_INLINE_RANKS ? inline_lists : lists_memory(comm->size);
      if (!lists) return tcc__fail(TCC_ERR_SYSTEM, "tccomm: out of memory");
      fill_arrays(c, lists, comm->size, sends, recvs);
    }
    tcc_err_t err;
    tcc__err_reset(&err);
    tcc_result_t r;
    const bool ran = exec->run_now(comm, c, op_timeout(comm, opts), &r, &err);
    if (lists != inline_lists) free(lists);
    if (ran) return r == TCC_OK ? TCC_OK : tcc__fail_with(&err, r);
  }
  TRY(check_can_block(comm, tcc__coll_name(c->kind), where));
  tcc_op_t *op;
  const tcc_result_t r = issue_coll(comm, c, opts, sends, recvs, where, &op);
  return r == TCC_OK ? wait_blocking(op) : r;
}

static inline __attribute__((always_inline)) tcc_result_t submit_coll(tcc_comm_t *comm, tcc_coll_t *c, const tcc_op_opts_t *opts,
                                const tcc_buf_t *sends, const tcc_buf_t *recvs, tcc_buf_t where,
                                tcc_op_t **out) {
  if (!out) return run_coll_blocking(comm, c, opts, sends, recvs, where);
  return issue_coll(comm, c, opts, sends, recvs, where, out);
}


tcc_result_t tcc_broadcast(tcc_comm_t *comm, tcc_buf_t buf, int root, const tcc_op_opts_t *opts,
                           tcc_op_t **op) {
  const char *w = tcc__coll_name(TCC_COLL_BROADCAST);
  TRY(check_usable(comm, w));
  TRY(check_root(comm, w, root));
  TRY(check_buf(comm, w, "the", buf));
  tcc_coll_t c = {.kind = TCC_COLL_BROADCAST, .dtype = buf.dtype, .root = root, .count = buf.count,
                  .send = buf.ptr, .recv = buf.ptr};
  return submit_coll(comm, &c, opts, NULL, NULL, buf, op);
}

static tcc_result_t reduction(tcc_comm_t *comm, tcc_coll_kind_t kind, tcc_buf_t send, tcc_buf_t recv,
                              tcc_redop_t redop, int root, const tcc_op_opts_t *opts, tcc_op_t **op) {
  const char *w = tcc__coll_name(kind);
  TRY(check_usable(comm, w));
  if (kind == TCC_COLL_REDUCE) TRY(check_root(comm, w, root));
  TRY(check_buf(comm, w, "input", send));
  TRY(check_redop(comm, w, send.dtype, redop));
  int needs_recv = kind == TCC_COLL_ALLREDUCE || comm->rank == root;
  if (needs_recv) {
    TRY(check_buf_on(comm, w, "output", recv, send.device));
    TRY(check_same_dtype(comm, w, send, recv));
    TRY(check_count(comm, w, "the output", recv.count, send.count));
  }
  tcc_coll_t c = {.kind = kind, .dtype = send.dtype, .redop = redop, .root = root,
                  .count = send.count, .send = send.ptr, .recv = needs_recv ? recv.ptr : NULL};
  return submit_coll(comm, &c, opts, NULL, NULL, send, op);
}

tcc_result_t tcc_allreduce(tcc_comm_t *comm, tcc_buf_t send, tcc_buf_t recv, tcc_redop_t redop,
                           const tcc_op_opts_t *opts, tcc_op_t **op) {
  return reduction(comm, TCC_COLL_ALLREDUCE, send, recv, redop, -1, opts, op);
}

tcc_result_t tcc_reduce(tcc_comm_t *comm, tcc_buf_t send, tcc_buf_t recv, tcc_redop_t redop, int root,
                        const tcc_op_opts_t *opts, tcc_op_t **op) {
  return reduction(comm, TCC_COLL_REDUCE, send, recv, redop, root, opts, op);
}

/* Whether a host buffer of a per-rank list passes check_uniform's checks
 * against `like`: decided without the formatting of its name, which cost
 * an snprintf per rank on every call. */
static bool host_buf_like(tcc_buf_t b, tcc_buf_t like) {
  return b.device == -1 && like.device == -1 && (unsigned)b.dtype < TCC_DTYPE_COUNT && b.dtype == like.dtype &&
         b.count == like.count && (b.ptr || b.count == 0);
}

/* check_uniform's checks of every buffer from `first` on, each named. */
static __attribute__((noinline, cold)) tcc_result_t check_uniform_named(tcc_comm_t *comm, const char *w,
                                                                        const char *role, const tcc_buf_t *bufs,
                                                                        tcc_buf_t like, int first) {
  for (int j = first; j < comm->size; j++) {
    char name[64];
    snprintf(name, sizeof name, "%s[%d]", role, j);
    TRY(check_buf_on(comm, w, name, bufs[j], like.device));
    TRY(check_same_dtype(comm, w, like, bufs[j]));
    TRY(check_count(comm, w, name, bufs[j].count, like.count));
  }
  return TCC_OK;
}

/* Checks an array of `size` buffers each of `count` elements of `dt`: a
 * host buffer like `like` passes without its name formatted, and without
 * the stack a name needs (a loop of a few instructions per rank). */
static inline tcc_result_t check_uniform(tcc_comm_t *comm, const char *w, const char *role, const tcc_buf_t *bufs,
                                         tcc_buf_t like) {
  if (!bufs)
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': the %s list is missing", w, comm->name, role);
  for (int j = 0; j < comm->size; j++)
    if (!host_buf_like(bufs[j], like)) return check_uniform_named(comm, w, role, bufs, like, j);
  return TCC_OK;
}

tcc_result_t tcc_allgather(tcc_comm_t *comm, tcc_buf_t send, const tcc_buf_t *recvs,
                           const tcc_op_opts_t *opts, tcc_op_t **op) {
  const char *w = tcc__coll_name(TCC_COLL_ALLGATHER);
  TRY(check_usable(comm, w));
  TRY(check_buf(comm, w, "input", send));
  TRY(check_uniform(comm, w, "output", recvs, send));
  tcc_coll_t c = {.kind = TCC_COLL_ALLGATHER, .dtype = send.dtype, .count = send.count,
                  .send = send.ptr};
  return submit_coll(comm, &c, opts, NULL, recvs, send, op);
}

tcc_result_t tcc_gather(tcc_comm_t *comm, tcc_buf_t send, const tcc_buf_t *recvs, int root,
                        const tcc_op_opts_t *opts, tcc_op_t **op) {
  const char *w = tcc__coll_name(TCC_COLL_GATHER);
  TRY(check_usable(comm, w));
  TRY(check_root(comm, w, root));
  TRY(check_buf(comm, w, "input", send));
  int is_root = comm->rank == root;
  if (is_root) TRY(check_uniform(comm, w, "output", recvs, send));
  tcc_coll_t c = {.kind = TCC_COLL_GATHER, .dtype = send.dtype, .root = root, .count = send.count,
                  .send = send.ptr};
  return submit_coll(comm, &c, opts, NULL, is_root ? recvs : NULL, send, op);
}

tcc_result_t tcc_scatter(tcc_comm_t *comm, const tcc_buf_t *sends, tcc_buf_t recv, int root,
                         const tcc_op_opts_t *opts, tcc_op_t **op) {
  const char *w = tcc__coll_name(TCC_COLL_SCATTER);
  TRY(check_usable(comm, w));
  TRY(check_root(comm, w, root));
  TRY(check_buf(comm, w, "output", recv));
  int is_root = comm->rank == root;
  if (is_root) TRY(check_uniform(comm, w, "input", sends, recv));
  tcc_coll_t c = {.kind = TCC_COLL_SCATTER, .dtype = recv.dtype, .root = root, .count = recv.count,
                  .recv = recv.ptr};
  return submit_coll(comm, &c, opts, is_root ? sends : NULL, NULL, recv, op);
}

tcc_result_t tcc_reduce_scatter(tcc_comm_t *comm, const tcc_buf_t *sends, tcc_buf_t recv,
                                tcc_redop_t redop, const tcc_op_opts_t *opts, tcc_op_t **op) {
  const char *w = tcc__coll_name(TCC_COLL_REDUCE_SCATTER);
  TRY(check_usable(comm, w));
  TRY(check_buf(comm, w, "output", recv));
  TRY(check_uniform(comm, w, "input", sends, recv));
  TRY(check_redop(comm, w, recv.dtype, redop));
  tcc_coll_t c = {.kind = TCC_COLL_REDUCE_SCATTER, .dtype = recv.dtype, .redop = redop,
                  .count = recv.count, .recv = recv.ptr};
  return submit_coll(comm, &c, opts, sends, NULL, recv, op);
}

tcc_result_t tcc_alltoall(tcc_comm_t *comm, const tcc_buf_t *sends, const tcc_buf_t *recvs,
                          const tcc_op_opts_t *opts, tcc_op_t **op) {
  const char *w = tcc__coll_name(TCC_COLL_ALLTOALL);
  TRY(check_usable(comm, w));
  if (!sends || !recvs)
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s': the input and output lists are required", w,
                  comm->name);
  for (int j = 0; j < comm->size; j++) {
    TRY(check_buf_on(comm, w, "input", sends[j], sends[0].device));
    TRY(check_buf_on(comm, w, "output", recvs[j], sends[0].device));
    TRY(check_same_dtype(comm, w, sends[0], sends[j]));
    TRY(check_same_dtype(comm, w, sends[0], recvs[j]));
  }
  if (sends[comm->rank].count != recvs[comm->rank].count)
    return tcc__fail(TCC_ERR_INVALID,
                  "tccomm %s on '%s': rank %d sends %zu elements to itself but expects %zu", w,
                  comm->name, comm->rank, sends[comm->rank].count, recvs[comm->rank].count);
  tcc_coll_t c = {.kind = TCC_COLL_ALLTOALL, .dtype = sends[0].dtype};
  return submit_coll(comm, &c, opts, sends, recvs, sends[0], op);
}

tcc_result_t tcc_barrier(tcc_comm_t *comm, const tcc_op_opts_t *opts, tcc_op_t **op) {
  TRY(check_usable(comm, tcc__coll_name(TCC_COLL_BARRIER)));
  tcc_coll_t c = {.kind = TCC_COLL_BARRIER, .dtype = TCC_UINT8};
  const tcc_buf_t host = {NULL, 0, TCC_UINT8, -1, NULL};
  return submit_coll(comm, &c, opts, NULL, NULL, host, op);
}

static tcc_result_t p2p(tcc_comm_t *comm, tcc_op_kind_t kind, tcc_buf_t buf, int peer, uint64_t tag,
                        const tcc_op_opts_t *opts, tcc_op_t **out) {
  const char *w = kind == TCC_OP_SEND ? "send" : "recv";
  TRY(check_usable(comm, w));
  TRY(check_buf(comm, w, "the", buf));
  const int any = kind == TCC_OP_RECV && peer == TCC_ANY_SOURCE;
  if (!any && (peer < 0 || peer >= comm->size || peer == comm->rank))
    return tcc__fail(TCC_ERR_INVALID, "tccomm %s on '%s' (rank %d): peer rank %d is invalid (%s)", w,
                  comm->name, comm->rank, peer,
                  peer == comm->rank ? "it is this rank" : "out of range");
  if (any && buf.device >= 0)
    return tcc__fail(TCC_ERR_UNSUPPORTED,
                  "tccomm recv on '%s' (rank %d): receiving from any source needs host memory", comm->name,
                  comm->rank);
  const tcc__executor_t *exec = buf.device >= 0 ? &tcc__device_executor : &tcc__host_executor;
  /* A blocking call: run at once by the executor when it can (as a
   * collective is); not while tracing, which shows every op as issued. */
  const bool now = !out && !TCC__LOG_ON(TCC__LOG_TRACE);
  if (!out) TRY(check_can_block(comm, w, buf));
  if (now && exec->p2p_move_now) {
    tcc_err_t err;
    tcc__err_reset(&err);
    tcc_result_t r;
    if (exec->p2p_move_now(comm, kind, buf.ptr, buf.count * tcc__dtype_size(buf.dtype), peer, tag, &r, &err))
      return r == TCC_OK ? TCC_OK : tcc__fail_with(&err, r);
  }
  tcc_op_t *op = op_alloc(comm, kind, opts);
  if (!op) return tcc__fail(TCC_ERR_SYSTEM, "tccomm: out of memory");
  op->peer = peer;
  op->source = peer;
  op->tag = tag;
  op->buf = buf.ptr;
  op->bytes = buf.count * tcc__dtype_size(buf.dtype);
  if (out) return submit_op(comm, op, buf, out);
  if (now && exec->p2p_now && exec->p2p_now(comm, op)) return wait_blocking(op);
  tcc_op_t *issued;
  const tcc_result_t r = submit_op(comm, op, buf, &issued);
  return r == TCC_OK ? wait_blocking(issued) : r;
}

tcc_result_t tcc_send(tcc_comm_t *comm, tcc_buf_t buf, int peer, uint64_t tag,
                      const tcc_op_opts_t *opts, tcc_op_t **op) {
  return p2p(comm, TCC_OP_SEND, buf, peer, tag, opts, op);
}

tcc_result_t tcc_recv(tcc_comm_t *comm, tcc_buf_t buf, int peer, uint64_t tag,
                      const tcc_op_opts_t *opts, tcc_op_t **op) {
  return p2p(comm, TCC_OP_RECV, buf, peer, tag, opts, op);
}

