/*
 * bench_mpi_pair.c - the C core against Open MPI in the same processes, on
 * the same buffers: batches of an Open MPI collective and of the core's
 * (+ tcc_op_wait) alternate, the order flipping from pair to pair, so both
 * meet the same minutes of the machine.
 *
 * Usage (optional: needs Open MPI's mpicc and mpirun; make build/bench_mpi_pair):
 *   mpirun --allow-run-as-root --oversubscribe -np N --bind-to none --mca btl self,vader \
 *          build/bench_mpi_pair OP MIN_BYTES MAX_BYTES [pairs] [shm|tcp] [fresh|cold] [handles]
 * OP: allreduce, allgather, alltoall, broadcast, reduce, reduce_scatter,
 * gather, scatter (rooted ones from rank 0; reductions sum) or pingpong.
 * Sizes go up by 4x; a size is bench_sizes' (and bench_collectives.py's):
 * the whole tensor of allreduce, broadcast and reduce, the output of
 * allgather and gather, the input of reduce_scatter, alltoall and scatter
 * (each rank's share is size / ranks). float32, page-aligned buffers;
 * allreduce sums in place. Rank 0 prints per
 * size the medians of both and the median (and quartiles) of the pairs'
 * ratios, openmpi / tccomm: above 1, the core is faster, and the median
 * memcpy bandwidth of the size measured between the pairs (every rank at
 * once), which shows the state of the machine. pingpong (2 ranks):
 * round trips of one message of the size, rank 0 sending first, with
 * MPI_Send / MPI_Recv and with tcc_send / tcc_recv + tcc_op_wait. The ranks swap
 * endpoint blobs with MPI_Allgather; the core's transport is shared memory,
 * or TCP with `tcp` (then compare with Open MPI's TCP: --mca btl self,tcp).
 * `fresh` (after the transport): every rank writes its input again before
 * each call, outside the time measured (see batch()). `cold` instead: every
 * rank copies COLD_BYTES through its caches before each call, outside the
 * time measured, as the compute between two collectives of a program
 * does: each library's code and data then come from the far cache.
 * The core's calls are blocking (no op handle), as Open MPI's are;
 * `handles` times them as an op issued, then waited on and released.
 */
#include <mpi.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tccomm.h"

#define MAX_RANKS 64
#define MAX_PAIRS 99

static void die(const char *what) {
  fprintf(stderr, "bench_mpi_pair: %s: %s\n", what, tcc_last_error());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

typedef enum {
  OP_ALLTOALL, OP_ALLGATHER, OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_REDUCE_SCATTER, OP_GATHER, OP_SCATTER,
  OP_PINGPONG, OP_COUNT
} pair_op_t;
static const char *const op_names[OP_COUNT] = {"alltoall", "allgather",      "allreduce", "broadcast", "reduce",
                                               "reduce_scatter", "gather", "scatter",   "pingpong"};

/* Ops whose size is the whole vector (each rank holds all of it). */
static int whole_vector(pair_op_t what) {
  return what == OP_ALLREDUCE || what == OP_BROADCAST || what == OP_REDUCE || what == OP_PINGPONG;
}

static bool handles; /* the core's ops issued with a handle, then waited for */

/* Waits for op and releases it, unless the call was blocking (op NULL). */
static void finish_core(tcc_result_t issued, tcc_op_t *op) {
  if (issued != TCC_OK) die("issue");
  if (!op) return;
  const tcc_result_t r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  if (r != TCC_OK) die("wait");
}

static void p2p_core(tcc_comm_t *comm, int send, float *buf, size_t count) {
  const tcc_buf_t b = {buf, count, TCC_FLOAT32, -1, NULL};
  const int peer = 1 - tcc_comm_rank(comm);
  tcc_op_t *op = NULL, **handle = handles ? &op : NULL;
  const tcc_result_t issued = send ? tcc_send(comm, b, peer, 3, NULL, handle) : tcc_recv(comm, b, peer, 3, NULL, handle);
  finish_core(issued, op); /* op read after the call set it */
}

/* One round trip: rank 0 sends `in` and receives into `out`, rank 1 the other way round. */
static void pingpong_core(tcc_comm_t *comm, float *in, float *out, size_t count) {
  const int first = tcc_comm_rank(comm) == 0;
  p2p_core(comm, first, first ? in : out, count);
  p2p_core(comm, !first, out, count);
}

static void pingpong_mpi(float *in, float *out, int count) {
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    MPI_Send(in, count, MPI_FLOAT, 1, 3, MPI_COMM_WORLD);
    MPI_Recv(out, count, MPI_FLOAT, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  } else {
    MPI_Recv(out, count, MPI_FLOAT, 0, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Send(out, count, MPI_FLOAT, 0, 3, MPI_COMM_WORLD);
  }
}

/* `count` floats in all, `per` = count / ranks: each rank's share. */
static void run_core(tcc_comm_t *comm, pair_op_t what, float *in, float *out, size_t count, size_t per) {
  const int n = tcc_comm_size(comm);
  if (what == OP_PINGPONG) {
    pingpong_core(comm, in, out, count);
    return;
  }
  /* blocks[j]: the j-th share of `in` or of `out`. */
  tcc_buf_t in_blocks[MAX_RANKS], out_blocks[MAX_RANKS];
  for (int j = 0; j < n; j++) {
    in_blocks[j] = (tcc_buf_t){in + (size_t)j * per, per, TCC_FLOAT32, -1, NULL};
    out_blocks[j] = (tcc_buf_t){out + (size_t)j * per, per, TCC_FLOAT32, -1, NULL};
  }
  const tcc_buf_t all_in = {in, count, TCC_FLOAT32, -1, NULL}, all_out = {out, count, TCC_FLOAT32, -1, NULL};
  tcc_op_t *op = NULL, **handle = handles ? &op : NULL;
  tcc_result_t issued = TCC_ERR_INVALID;
  switch (what) {
    case OP_ALLREDUCE: issued = tcc_allreduce(comm, all_in, all_in, TCC_SUM, NULL, handle); break;
    case OP_ALLTOALL: issued = tcc_alltoall(comm, in_blocks, out_blocks, NULL, handle); break;
    case OP_ALLGATHER: issued = tcc_allgather(comm, in_blocks[0], out_blocks, NULL, handle); break;
    case OP_BROADCAST: issued = tcc_broadcast(comm, all_in, 0, NULL, handle); break;
    case OP_REDUCE: issued = tcc_reduce(comm, all_in, all_out, TCC_SUM, 0, NULL, handle); break;
    case OP_REDUCE_SCATTER: issued = tcc_reduce_scatter(comm, in_blocks, out_blocks[0], TCC_SUM, NULL, handle); break;
    case OP_GATHER: issued = tcc_gather(comm, in_blocks[0], out_blocks, 0, NULL, handle); break;
    case OP_SCATTER: issued = tcc_scatter(comm, in_blocks, out_blocks[0], 0, NULL, handle); break;
    default: break;
  }
  finish_core(issued, op);
}

static void run_mpi(pair_op_t what, float *in, float *out, size_t count, size_t per) {
  const int c = (int)count, p = (int)per;
  switch (what) {
    case OP_PINGPONG: pingpong_mpi(in, out, c); break;
    case OP_ALLREDUCE: MPI_Allreduce(MPI_IN_PLACE, in, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case OP_ALLTOALL: MPI_Alltoall(in, p, MPI_FLOAT, out, p, MPI_FLOAT, MPI_COMM_WORLD); break;
    case OP_ALLGATHER: MPI_Allgather(in, p, MPI_FLOAT, out, p, MPI_FLOAT, MPI_COMM_WORLD); break;
    case OP_BROADCAST: MPI_Bcast(in, c, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    case OP_REDUCE: MPI_Reduce(in, out, c, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD); break;
    case OP_REDUCE_SCATTER: MPI_Reduce_scatter_block(in, out, p, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case OP_GATHER: MPI_Gather(in, p, MPI_FLOAT, out, p, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    case OP_SCATTER: MPI_Scatter(in, p, MPI_FLOAT, out, p, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    default: break;
  }
}

enum { BY_MPI, BY_CORE, BY_MEMCPY };

/* Inputs that every call finds as the last write left them: the same
 * bytes as the first fill, written again before each call and outside its
 * time (`fresh`), as a training step writes its gradients; or written once
 * (the default), so that after the first call the peers read lines that
 * no CPU has written since, which costs less than reading what another
 * CPU just wrote whenever traffic between CPUs is dear. */
static bool fresh, cold;
static int fill_byte;
#define COLD_BYTES (2u << 20)
static char *cold_mem; /* COLD_BYTES: copied from its first half to its second */

static void run_one(tcc_comm_t *comm, int by, pair_op_t what, float *in, float *out, size_t count, size_t per) {
  if (by == BY_CORE)
    run_core(comm, what, in, out, count, per);
  else if (by == BY_MPI)
    run_mpi(what, in, out, count, per);
  else
    memcpy(out, in, count * sizeof(float));
}

/* The slowest rank's microseconds per call over one batch: of Open MPI's
 * op, the core's, or a memcpy of the size (every rank at once) on the same
 * buffers, which tells what the memory gives in those minutes: on a shared
 * virtual machine it changes from launch to launch, by up to 4x. */
static double batch(tcc_comm_t *comm, int by, pair_op_t what, float *in, float *out, size_t count, size_t per,
                    int iters) {
  MPI_Barrier(MPI_COMM_WORLD);
  double seconds = 0;
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; i++) {
    if (!fresh && !cold) {
      run_one(comm, by, what, in, out, count, per);
      continue;
    }
    if (fresh) memset(in, fill_byte, count * sizeof(float));
    if (cold) {
      memcpy(cold_mem + COLD_BYTES / 2, cold_mem, COLD_BYTES / 2);
      __asm__ __volatile__("" ::: "memory"); /* the copy is not left out */
    }
    const double t = MPI_Wtime();
    run_one(comm, by, what, in, out, count, per);
    seconds += MPI_Wtime() - t;
  }
  if (!fresh && !cold) seconds = MPI_Wtime() - t0;
  double us = seconds / iters * 1e6;
  MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return us;
}

static int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static tcc_comm_t *open_core(int rank, int size, tcc_transport_t transport) {
  tcc_endpoint_t *ep;
  uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
  if (tcc_endpoint_open(NULL, &ep, blob) != TCC_OK) die("endpoint");
  uint8_t *blobs = malloc((size_t)size * TCC_ENDPOINT_BLOB_SIZE);
  if (!blobs) die("out of memory");
  MPI_Allgather(blob, TCC_ENDPOINT_BLOB_SIZE, MPI_BYTE, blobs, TCC_ENDPOINT_BLOB_SIZE, MPI_BYTE, MPI_COMM_WORLD);
  const tcc_comm_config_t cfg = {rank, size, 60000, "mpi-pair", transport};
  tcc_comm_t *comm;
  if (tcc_comm_create(&cfg, ep, blobs, &comm) != TCC_OK) die("create");
  free(blobs);
  return comm;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int pairs = argc > 4 ? atoi(argv[4]) : 21;
  int what = -1;
  for (int i = 0; argc > 1 && i < OP_COUNT; i++)
    if (strcmp(argv[1], op_names[i]) == 0) what = i;
  const char *transport = argc > 5 ? argv[5] : "shm";
  bool unknown = false;
  for (int i = 6; i < argc; i++) {
    bool *flag = strcmp(argv[i], "fresh") == 0 ? &fresh : strcmp(argv[i], "cold") == 0 ? &cold
                 : strcmp(argv[i], "handles") == 0 ? &handles : NULL;
    if (flag) *flag = true;
    else unknown = true;
  }
  if (argc < 4 || what < 0 || size > MAX_RANKS || pairs < 1 || pairs > MAX_PAIRS || (what == OP_PINGPONG && size != 2) ||
      (strcmp(transport, "shm") != 0 && strcmp(transport, "tcp") != 0) || unknown || (fresh && cold)) {
    if (rank == 0)
      fprintf(stderr, "usage: bench_mpi_pair allreduce|allgather|alltoall|broadcast|reduce|reduce_scatter|gather|scatter|"
                      "pingpong (2 ranks) MIN_BYTES MAX_BYTES [pairs 1..99] [shm|tcp] [fresh|cold] [handles]\n");
    MPI_Finalize();
    return 2;
  }
  if (cold && !(cold_mem = calloc(1, COLD_BYTES))) die("out of memory");
  tcc_comm_t *comm = open_core(rank, size, strcmp(transport, "tcp") == 0 ? TCC_TRANSPORT_TCP : TCC_TRANSPORT_SHM);
  for (size_t bytes = strtoull(argv[2], NULL, 10); bytes > 0 && bytes <= strtoull(argv[3], NULL, 10); bytes *= 4) {
    const size_t count = bytes / sizeof(float), per = count / (size_t)size;
    if (whole_vector((pair_op_t)what) ? count == 0 : per == 0) continue;
    const size_t alloc = (count * sizeof(float) + 4095) / 4096 * 4096;
    float *in = aligned_alloc(4096, alloc), *out = aligned_alloc(4096, alloc);
    if (!in || !out) die("out of memory");
    fill_byte = what == OP_ALLREDUCE ? 0 : 1; /* sums in place stay 0 */
    memset(in, fill_byte, alloc);
    memset(out, 0, alloc);
    int iters = (int)(0.02e9 / ((double)bytes / 4 + 20000));
    if (iters < 3) iters = 3;
    double ratio[MAX_PAIRS], mpi_us[MAX_PAIRS], core_us[MAX_PAIRS], copy_gbs[MAX_PAIRS];
    for (int p = -1; p < pairs; p++) { /* pair -1 warms both up */
      double us[2];
      for (int k = 0; k < 2; k++) {
        const int by = (p & 1) ^ k; /* which goes first flips from pair to pair */
        us[by] = batch(comm, by, (pair_op_t)what, in, out, count, per, iters);
      }
      const double copy_us = batch(comm, BY_MEMCPY, (pair_op_t)what, in, out, count, per, iters);
      if (p >= 0)
        ratio[p] = us[BY_MPI] / us[BY_CORE], mpi_us[p] = us[BY_MPI], core_us[p] = us[BY_CORE],
        copy_gbs[p] = (double)(count * sizeof(float)) / copy_us / 1e3;
    }
    qsort(ratio, (size_t)pairs, sizeof *ratio, by_value);
    qsort(mpi_us, (size_t)pairs, sizeof *mpi_us, by_value);
    qsort(core_us, (size_t)pairs, sizeof *core_us, by_value);
    qsort(copy_gbs, (size_t)pairs, sizeof *copy_gbs, by_value);
    if (rank == 0)
      printf("%s %zu B, %d ranks, %s: openmpi %.3f us, core %.3f us, openmpi / core %.2f (quartiles %.2f .. %.2f); "
             "memcpy %.1f GB/s\n",
             argv[1], bytes, size, transport, mpi_us[pairs / 2], core_us[pairs / 2], ratio[pairs / 2], ratio[pairs / 4],
             ratio[3 * pairs / 4], copy_gbs[pairs / 2]);
    fflush(stdout);
    free(in);
    free(out);
  }
  tcc_comm_destroy(comm);
  MPI_Finalize();
  return 0;
}
