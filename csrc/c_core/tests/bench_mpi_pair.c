/*
 * bench_mpi_pair.c - the C core against Open MPI in the same processes, on
 * the same buffers: batches of MPI_Alltoall (or MPI_Allgather) and of
 * tcc_alltoall (tcc_allgather) + tcc_op_wait alternate, the order flipping
 * from pair to pair, so both meet the same minutes of the machine.
 *
 * Usage (optional: needs Open MPI's mpicc and mpirun; make build/bench_mpi_pair):
 *   mpirun --allow-run-as-root --oversubscribe -np N --bind-to none --mca btl self,vader \
 *          build/bench_mpi_pair alltoall|allgather MIN_BYTES MAX_BYTES [pairs]
 * Sizes go up by 4x; a size is the whole output (bench_sizes' convention),
 * float32, page-aligned buffers. Rank 0 prints per size the medians of both
 * and the median (and quartiles) of the pairs' ratios, openmpi / tccomm:
 * above 1, the core is faster. The ranks swap endpoint blobs with
 * MPI_Allgather; the core's transport is shared memory.
 */
#include <mpi.h>
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

static void run_core(tcc_comm_t *comm, int alltoall, float *in, float *out, size_t per) {
  const int n = tcc_comm_size(comm);
  tcc_buf_t sends[MAX_RANKS], recvs[MAX_RANKS];
  for (int j = 0; j < n; j++) {
    sends[j] = (tcc_buf_t){alltoall ? in + (size_t)j * per : in, per, TCC_FLOAT32, -1, NULL};
    recvs[j] = (tcc_buf_t){out + (size_t)j * per, per, TCC_FLOAT32, -1, NULL};
  }
  tcc_op_t *op;
  if ((alltoall ? tcc_alltoall(comm, sends, recvs, NULL, &op) : tcc_allgather(comm, sends[0], recvs, NULL, &op)) !=
      TCC_OK)
    die("issue");
  const tcc_result_t r = tcc_op_wait(op, -1);
  tcc_op_release(op);
  if (r != TCC_OK) die("wait");
}

static void run_mpi(int alltoall, float *in, float *out, size_t per) {
  if (alltoall)
    MPI_Alltoall(in, (int)per, MPI_FLOAT, out, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
  else
    MPI_Allgather(in, (int)per, MPI_FLOAT, out, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
}

/* The slowest rank's microseconds per call over one batch. */
static double batch(tcc_comm_t *comm, int core, int alltoall, float *in, float *out, size_t per, int iters) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; i++) {
    if (core)
      run_core(comm, alltoall, in, out, per);
    else
      run_mpi(alltoall, in, out, per);
  }
  double us = (MPI_Wtime() - t0) / iters * 1e6;
  MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return us;
}

static int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static tcc_comm_t *open_core(int rank, int size) {
  tcc_endpoint_t *ep;
  uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
  if (tcc_endpoint_open(NULL, &ep, blob) != TCC_OK) die("endpoint");
  uint8_t *blobs = malloc((size_t)size * TCC_ENDPOINT_BLOB_SIZE);
  if (!blobs) die("out of memory");
  MPI_Allgather(blob, TCC_ENDPOINT_BLOB_SIZE, MPI_BYTE, blobs, TCC_ENDPOINT_BLOB_SIZE, MPI_BYTE, MPI_COMM_WORLD);
  const tcc_comm_config_t cfg = {rank, size, 60000, "mpi-pair", TCC_TRANSPORT_SHM};
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
  const int pairs = argc > 5 ? atoi(argv[5]) : 21;
  if (argc < 4 || (strcmp(argv[1], "alltoall") != 0 && strcmp(argv[1], "allgather") != 0) || size > MAX_RANKS ||
      pairs < 1 || pairs > MAX_PAIRS) {
    if (rank == 0) fprintf(stderr, "usage: bench_mpi_pair alltoall|allgather MIN_BYTES MAX_BYTES [pairs 1..99]\n");
    MPI_Finalize();
    return 2;
  }
  const int alltoall = strcmp(argv[1], "alltoall") == 0;
  tcc_comm_t *comm = open_core(rank, size);
  for (size_t bytes = strtoull(argv[2], NULL, 10); bytes > 0 && bytes <= strtoull(argv[3], NULL, 10); bytes *= 4) {
    const size_t count = bytes / sizeof(float), per = count / (size_t)size;
    if (per == 0) continue;
    const size_t alloc = (count * sizeof(float) + 4095) / 4096 * 4096;
    float *in = aligned_alloc(4096, alloc), *out = aligned_alloc(4096, alloc);
    if (!in || !out) die("out of memory");
    memset(in, 1, alloc);
    memset(out, 0, alloc);
    int iters = (int)(0.02e9 / ((double)bytes / 4 + 20000));
    if (iters < 3) iters = 3;
    double ratio[MAX_PAIRS], mpi_us[MAX_PAIRS], core_us[MAX_PAIRS];
    for (int p = -1; p < pairs; p++) { /* pair -1 warms both up */
      double us[2];
      for (int k = 0; k < 2; k++) {
        const int core = (p & 1) ^ k; /* which goes first flips from pair to pair */
        us[core] = batch(comm, core, alltoall, in, out, per, iters);
      }
      if (p >= 0) ratio[p] = us[0] / us[1], mpi_us[p] = us[0], core_us[p] = us[1];
    }
    qsort(ratio, (size_t)pairs, sizeof *ratio, by_value);
    qsort(mpi_us, (size_t)pairs, sizeof *mpi_us, by_value);
    qsort(core_us, (size_t)pairs, sizeof *core_us, by_value);
    if (rank == 0)
      printf("%s %zu B, %d ranks: openmpi %.1f us, core %.1f us, openmpi / core %.2f (quartiles %.2f .. %.2f)\n",
             argv[1], bytes, size, mpi_us[pairs / 2], core_us[pairs / 2], ratio[pairs / 2], ratio[pairs / 4],
             ratio[3 * pairs / 4]);
    fflush(stdout);
    free(in);
    free(out);
  }
  tcc_comm_destroy(comm);
  MPI_Finalize();
  return 0;
}
