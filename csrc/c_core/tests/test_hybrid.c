/*
 * test_hybrid.c - groups that span hosts: ranks forked on this machine
 * claim simulated hosts (group.h), so auto chooses shared memory between
 * the ranks of each host and TCP between hosts, and large allreduces and
 * broadcasts run hierarchically.
 *
 * Every op is checked against a reference computed here: integer-valued
 * data for every op and dtype (any order gives the same value), and
 * fractional float data for the documented order of a hierarchical sum
 * (over each host's ranks in rank order, then over the hosts in the order
 * of their lowest rank), bit for bit on every rank; float16/bfloat16
 * allreduces as that sum in float32, rounded once.
 */
#include <math.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "group.h"
#include "tccomm.h"
#include "coll/coll.h"          /* the algorithm an op takes */
#include "coll/coll_scratch.h"  /* the pipe's thread, refused */
#include "host/host.h"           /* the bytes sent by reference, to see which way p2p went */
#include "transport/shm/shm.h" /* the local view's rings, likewise */

/* Messages from this size on run hierarchically (coll/coll_hier.c), all_gather
 * from the second. */
#define HIER_BYTES (64u << 10)
#define HIER_GATHER_BYTES (256u << 10)
/* On uneven hosts all_gather (output) and reduce_scatter (input) run
 * hierarchically from this size, reduce_scatter only where the leaders'
 * exchange relieves the links (leaders_relieve_links). */
#define HIER_UNEVEN_BYTES (2u << 20)
/* Sharded allreduces of two of these or more run in pipelined segments. */
#define HIER_SEGMENT_BYTES (4u << 20)
/* all-to-alls whose blocks are all below this go through the hosts' leaders
 * (coll/coll_hier_alltoall.c). */
#define AGG_MAX_BLOCK_BYTES (2u << 10)

static const char *spec; /* the layout of the group being run */

static tcc_buf_t host_buf(void *p, size_t count, tcc_dtype_t dt) { return (tcc_buf_t){p, count, dt, -1, NULL}; }

static tcc_result_t finish(tcc_result_t r, tcc_op_t *op, char *msg, size_t len) {
  if (r != TCC_OK) {
    if (msg) snprintf(msg, len, "%s", tcc_last_error());
    return r;
  }
  r = tcc_op_wait(op, -1);
  if (msg) snprintf(msg, len, "%s", tcc_op_error(op));
  tcc_op_release(op);
  return r;
}
#define RUN(call) ({ tcc_op_t *op = NULL; tcc_result_t r_ = (call); finish(r_, op, NULL, 0); })

/* ---- integer-valued data: every op, every dtype ------------------------ */

static int small_value(int r, size_t i, tcc_redop_t op) {
  if (op == TCC_PRODUCT) return ((i + (size_t)r) % 5 == 0) ? -1 : 1; /* stays in range */
  return (int)((i * 7 + (size_t)r * 3) % 11) - 5;
}

static double ref_value(int n, size_t i, tcc_dtype_t dt, tcc_redop_t op, double premul) {
  double acc = 0;
  long long bits = 0;
  for (int r = 0; r < n; r++) {
    int v = small_value(r, i, op);
    if (dt == TCC_BOOL) v = v > 0;
    if (dt == TCC_UINT8) v &= 0x7f;
    if (r == 0) {
      acc = op == TCC_PREMUL_SUM ? v * premul : v;
      bits = v;
      continue;
    }
    switch (op) {
      case TCC_SUM: case TCC_AVG: acc += v; break;
      case TCC_PREMUL_SUM: acc += v * premul; break;
      case TCC_PRODUCT: acc *= v; break;
      case TCC_MIN: acc = v < acc ? v : acc; break;
      case TCC_MAX: acc = v > acc ? v : acc; break;
      case TCC_BAND: bits &= v; break;
      case TCC_BOR: bits |= v; break;
      case TCC_BXOR: bits ^= v; break;
      default: break;
    }
  }
  if (op == TCC_BAND || op == TCC_BOR || op == TCC_BXOR) return (double)bits;
  if (dt == TCC_BOOL && op == TCC_SUM) return acc != 0;
  if (op == TCC_AVG && dt == TCC_FLOAT32) return (double)((float)acc / (float)n);
  if (op == TCC_AVG) return dt == TCC_FLOAT64 ? acc / n : (double)((long long)acc / n);
  return acc;
}

static void put(void *buf, tcc_dtype_t dt, size_t i, double v) {
  switch (dt) {
    case TCC_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case TCC_FLOAT64: ((double *)buf)[i] = v; break;
    case TCC_INT8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case TCC_INT16: ((int16_t *)buf)[i] = (int16_t)v; break;
    case TCC_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case TCC_INT64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case TCC_UINT8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case TCC_BOOL: ((uint8_t *)buf)[i] = v != 0; break;
    default: break;
  }
}

static double get(const void *buf, tcc_dtype_t dt, size_t i) {
  switch (dt) {
    case TCC_FLOAT32: return ((const float *)buf)[i];
    case TCC_FLOAT64: return ((const double *)buf)[i];
    case TCC_INT8: return ((const int8_t *)buf)[i];
    case TCC_INT16: return ((const int16_t *)buf)[i];
    case TCC_INT32: return ((const int32_t *)buf)[i];
    case TCC_INT64: return (double)((const int64_t *)buf)[i];
    case TCC_UINT8: return ((const uint8_t *)buf)[i];
    case TCC_BOOL: return ((const uint8_t *)buf)[i];
    default: return NAN;
  }
}

static const size_t counts[] = {0, 1, 7, 1001, 70001, 1u << 18};

static void test_allreduce_ops(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const struct { tcc_dtype_t dt; tcc_redop_t op; } cases[] = {
      {TCC_FLOAT32, TCC_SUM}, {TCC_FLOAT64, TCC_SUM}, {TCC_INT32, TCC_SUM}, {TCC_INT8, TCC_SUM},
      {TCC_INT64, TCC_PRODUCT}, {TCC_FLOAT32, TCC_MIN}, {TCC_INT32, TCC_MAX}, {TCC_INT32, TCC_BAND},
      {TCC_UINT8, TCC_BOR}, {TCC_INT64, TCC_BXOR}, {TCC_FLOAT64, TCC_PREMUL_SUM}, {TCC_FLOAT32, TCC_AVG},
      {TCC_INT32, TCC_AVG}, {TCC_INT8, TCC_AVG}, {TCC_FLOAT64, TCC_AVG}, {TCC_BOOL, TCC_SUM}, {TCC_BOOL, TCC_MIN}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
    const tcc_dtype_t dt = cases[k].dt;
    const tcc_redop_t rop = cases[k].op;
    const size_t es = tcc_dtype_size(dt);
    for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
      const size_t count = counts[ci];
      for (int inplace = 0; inplace < 2; inplace++) {
        char *in = malloc(count * es + 1), *out = malloc(count * es + 1);
        for (size_t i = 0; i < count; i++) {
          int v = small_value(me, i, rop);
          if (dt == TCC_UINT8) v &= 0x7f;
          if (dt == TCC_BOOL) v = v > 0;
          put(in, dt, i, v);
        }
        char *dst = inplace ? in : out;
        tcc_op_opts_t opts = {.premul_factor = 0.5};
        tcc_result_t r = RUN(tcc_allreduce(comm, host_buf(in, count, dt), host_buf(dst, count, dt), rop, &opts, &op));
        CHECK(r == TCC_OK, "%s: allreduce %s %s count %zu: %s", spec, tcc_dtype_name(dt), tcc_redop_name(rop), count,
              tcc_last_error());
        size_t bad = 0;
        for (size_t i = 0; i < count && r == TCC_OK; i++) {
          double want = ref_value(n, i, dt, rop, 0.5);
          if (dt == TCC_INT8) want = (double)(int8_t)(long long)want;
          if (get(dst, dt, i) != want && bad++ < 3)
            CHECK(0, "%s: allreduce %s %s count %zu%s: element %zu is %g, expected %g", spec, tcc_dtype_name(dt),
                  tcc_redop_name(rop), count, inplace ? " in place" : "", i, get(dst, dt, i), want);
        }
        free(in);
        free(out);
      }
    }
  }
}

/* ---- the documented order of a hierarchical float sum ------------------ */

/* Magnitudes that differ from rank to rank, so that the order of the sum
 * shows in the rounding of most elements. */
static float frac_value(int r, size_t i) {
  return (float)(1.0 / (double)(3 + r + (i % 17))) * (r % 2 ? 1.0f : 4096.0f) * (float)(1 + (i % 5));
}

/* An order of summing over the ranks: ranks[] in blocks, block b ending
 * before end[b]; each block summed in its order, then the blocks' sums in
 * block order. */
typedef struct sum_order {
  int ranks[8], end[8], nblocks;
} sum_order_t;

/* Rank order (one block), or (by_host) the documented order of a
 * hierarchical sum: hosts in the order of their lowest rank, each host's
 * ranks in rank order. */
static sum_order_t order_of(int n, bool by_host) {
  sum_order_t o = {.nblocks = 0};
  int k = 0;
  for (int h0 = 0; h0 < n; h0++) {
    bool lowest = true;
    for (int q = 0; q < h0; q++) lowest &= group_fake_host(spec, q) != group_fake_host(spec, h0);
    if (by_host && !lowest) continue;
    for (int q = h0; q < n; q++)
      if (!by_host ? q == h0 : group_fake_host(spec, q) == group_fake_host(spec, h0)) o.ranks[k++] = q;
    if (by_host) o.end[o.nblocks++] = k;
  }
  if (!by_host) o.end[o.nblocks++] = k;
  return o;
}

/* The float32 sum over ranks of value(q, i) in order o. */
static float ordered_sum_of(const sum_order_t *o, size_t i, float (*value)(int, size_t)) {
  float want = 0;
  for (int b = 0, k = 0; b < o->nblocks; b++) {
    float block = value(o->ranks[k], i);
    for (k++; k < o->end[b]; k++) block += value(o->ranks[k], i);
    want = b == 0 ? block : want + block;
  }
  return want;
}

/* What a fractional SUM or AVG over order o gives for element i: AVG
 * divides the sum once, in float32, as the flat AVG does. */
static float ordered_result(const sum_order_t *o, size_t i, tcc_redop_t op, int n) {
  const float sum = ordered_sum_of(o, i, frac_value);
  return op == TCC_AVG ? sum / (float)n : sum;
}

static bool is_hybrid(tcc_comm_t *comm) { return strcmp(tcc_comm_transport_name(comm), "shm+tcp") == 0; }

/* Whether every host of the group has the same number of ranks. */
static bool hosts_uniform(int n) {
  int per_host[8] = {0};
  for (int r = 0; r < n; r++) per_host[group_fake_host(spec, r) < 0 ? 0 : group_fake_host(spec, r)]++;
  for (int h = 1; h < 8; h++)
    if (per_host[h] && per_host[h] != per_host[0]) return false;
  return true;
}

/* Fractional sums and averages bit for bit: at a hierarchical size that
 * is not a multiple of the ranks per host, and at sizes that run in
 * pipelined segments (exactly two, and two and a half plus an odd tail),
 * in place and out of place. */
static void test_sum_order(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t counts_[] = {70001, 2 * HIER_SEGMENT_BYTES / 4, 5 * HIER_SEGMENT_BYTES / 8 + 7};
  for (int avg = 0; avg < 2; avg++)
  for (size_t ci = 0; ci < sizeof counts_ / sizeof *counts_; ci++)
    for (int inplace = 0; inplace < 2; inplace++) {
      const size_t count = counts_[ci];
      const tcc_redop_t rop = avg ? TCC_AVG : TCC_SUM;
      float *buf = malloc(count * sizeof *buf), *out = malloc(count * sizeof *out);
      for (size_t i = 0; i < count; i++) buf[i] = frac_value(me, i);
      float *dst = inplace ? buf : out;
      tcc_result_t r = RUN(tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(dst, count, TCC_FLOAT32),
                                         rop, NULL, &op));
      CHECK(r == TCC_OK, "%s: fractional allreduce of %zu: %s", spec, count, tcc_last_error());
      const sum_order_t order = order_of(n, is_hybrid(comm));
      size_t bad = 0;
      for (size_t i = 0; i < count && r == TCC_OK; i++) {
        float want = ordered_result(&order, i, rop, n);
        if (memcmp(&dst[i], &want, sizeof want) != 0 && bad++ < 3)
          CHECK(0, "%s: fractional %s of %zu%s: element %zu is %.9g, expected %.9g (bit for bit)", spec,
                tcc_redop_name(rop), count, inplace ? " in place" : "", i, dst[i], want);
      }
      free(buf);
      free(out);
    }
}

static uint64_t tcp_bytes_queued(void);
static int local_index_of(int q);

/* Whether, on uneven hosts, every host's link carries fewer blocks in the
 * leaders' reduce_scatter exchange (its blocks to each other host, every
 * other rank's block in) than the n - 1 of a flat ring. */
static bool leaders_relieve_links(int n) {
  int per_host[8] = {0}, hosts = 0;
  for (int r = 0; r < n; r++) hosts += per_host[group_fake_host(spec, r)]++ == 0;
  for (int h = 0; h < hosts; h++)
    if (per_host[h] * (hosts - 1) >= n - 1 || n - per_host[h] >= n - 1) return false;
  return true;
}

/* reduce_scatter, hierarchical from HIER_BYTES of input (through the hosts'
 * leaders on uneven hosts, from HIER_UNEVEN_BYTES where that relieves the
 * links): integer-valued data for several dtype x op pairs, exact;
 * fractional floats bit for bit in the order that applies. */
static void test_reduce_scatter(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const struct { tcc_dtype_t dt; tcc_redop_t op; } cases[] = {
      {TCC_INT32, TCC_SUM}, {TCC_INT64, TCC_PRODUCT}, {TCC_FLOAT32, TCC_MAX}, {TCC_FLOAT64, TCC_PREMUL_SUM},
      {TCC_UINT8, TCC_BXOR}, {TCC_INT16, TCC_AVG}, {TCC_FLOAT32, TCC_SUM}, {TCC_FLOAT32, TCC_AVG}};
  const size_t blocks[] = {0, 5, HIER_BYTES / 4 / 8, HIER_BYTES / 4 / (size_t)n + 3, 50001, 110001};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
    for (size_t bi = 0; bi < sizeof blocks / sizeof *blocks; bi++) {
      const tcc_dtype_t dt = cases[k].dt;
      const tcc_redop_t rop = cases[k].op;
      const size_t es = tcc_dtype_size(dt), count = blocks[bi], total = count * (size_t)n;
      const bool fractional = dt == TCC_FLOAT32 && (rop == TCC_SUM || rop == TCC_AVG);
      char *in = malloc(total * es + 1), *out = malloc(count * es + 1);
      tcc_buf_t sends[8];
      for (size_t i = 0; i < total; i++) {
        int v = small_value(me, i, rop);
        if (dt == TCC_UINT8) v &= 0x7f;
        if (fractional) ((float *)in)[i] = frac_value(me, i);
        else put(in, dt, i, v);
      }
      for (int j = 0; j < n; j++) sends[j] = host_buf(in + (size_t)j * count * es, count, dt);
      tcc_op_opts_t opts = {.premul_factor = 0.5};
      const uint64_t tcp0 = tcp_bytes_queued();
      tcc_result_t r = RUN(tcc_reduce_scatter(comm, sends, host_buf(out, count, dt), rop, &opts, &op));
      const uint64_t tcp_sent = tcp_bytes_queued() - tcp0;
      CHECK(r == TCC_OK, "%s: reduce_scatter %s %s block %zu: %s", spec, tcc_dtype_name(dt), tcc_redop_name(rop), count,
            tcc_last_error());
      const bool hier = is_hybrid(comm) && (hosts_uniform(n) ? total * es >= HIER_BYTES
                                                             : total * es >= HIER_UNEVEN_BYTES && leaders_relieve_links(n));
      /* On uneven hosts only the leaders send data across (on even ones
       * every rank does, by its local index). */
      if (hier && !hosts_uniform(n) && local_index_of(me) != 0)
        CHECK(tcp_sent < count * es / 2 + 1, "%s: reduce_scatter of %zu B blocks: rank %d sent %llu B over TCP", spec,
              count * es, me, (unsigned long long)tcp_sent);
      const sum_order_t order = order_of(n, hier);
      size_t bad = 0;
      for (size_t i = 0; i < count && r == TCC_OK; i++) {
        const size_t at = (size_t)me * count + i; /* the element of the input this one sums */
        if (fractional) {
          float want = ordered_result(&order, at, rop, n);
          if (memcmp(&((float *)out)[i], &want, sizeof want) != 0 && bad++ < 3)
            CHECK(0, "%s: reduce_scatter fractional %s, block %zu, element %zu is %.9g, expected %.9g", spec,
                  tcc_redop_name(rop), count, i, ((float *)out)[i], want);
          continue;
        }
        double want = ref_value(n, at, dt, rop, 0.5);
        if (get(out, dt, i) != want && bad++ < 3)
          CHECK(0, "%s: reduce_scatter %s %s block %zu: element %zu is %g, expected %g", spec, tcc_dtype_name(dt),
                tcc_redop_name(rop), count, i, get(out, dt, i), want);
      }
      free(in);
      free(out);
    }
}

/* ---- broadcast from every root, other collectives, p2p ----------------- */

static void test_broadcast(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t sizes[] = {3, HIER_BYTES / 4 + 5, 1u << 19};
  for (size_t si = 0; si < 3; si++)
    for (int root = 0; root < n; root++) {
      const size_t count = sizes[si];
      int32_t *buf = malloc(count * sizeof *buf);
      for (size_t i = 0; i < count; i++) buf[i] = me == root ? (int32_t)(i * 31 + (size_t)root) : -1;
      tcc_result_t r = RUN(tcc_broadcast(comm, host_buf(buf, count, TCC_INT32), root, NULL, &op));
      CHECK(r == TCC_OK, "%s: broadcast from %d: %s", spec, root, tcc_last_error());
      size_t bad = 0;
      for (size_t i = 0; i < count && r == TCC_OK; i++)
        if (buf[i] != (int32_t)(i * 31 + (size_t)root) && bad++ < 3)
          CHECK(0, "%s: broadcast from %d, count %zu: element %zu is %d", spec, root, count, i, buf[i]);
      free(buf);
    }
}

/* Bytes this process has handed to all its TCP connections so far: what the
 * peer acknowledged (TCP_INFO) plus what still waits in the send queue
 * (SIOCOUTQ), so a test can tell which ranks' data crossed TCP in an op.
 * Not the bytes the kernel has transmitted (tcpi_bytes_sent): an op that
 * returns once its last write is queued leaves bytes that go out during the
 * next op, and were counted against it. */
static uint64_t tcp_bytes_queued(void) {
  uint64_t sum = 0;
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL) {
    const int fd = atoi(e->d_name);
    for (;;) { /* an acknowledgement between the two reads moves bytes from one to the other */
      struct tcp_info before, after;
      socklen_t len = sizeof before;
      int queued = 0;
      memset(&before, 0, sizeof before);
      memset(&after, 0, sizeof after);
      if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &before, &len) != 0) break;
      if (ioctl(fd, SIOCOUTQ, &queued) != 0) queued = 0; /* not connected (a listener) */
      len = sizeof after;
      if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &after, &len) != 0) break;
      if (before.tcpi_bytes_acked != after.tcpi_bytes_acked) continue;
      sum += after.tcpi_bytes_acked + (uint64_t)queued;
      break;
    }
  }
  if (d) closedir(d);
  return sum;
}

/* Rank q's position among the ranks of its (simulated) host. */
static int local_index_of(int q) {
  int l = 0;
  for (int p = 0; p < q; p++) l += group_fake_host(spec, p) == group_fake_host(spec, q);
  return l;
}

/* reduce to every root, hierarchical from HIER_BYTES (through the hosts' leaders
 * on uneven hosts): integer-valued data for several dtype x op pairs, exact;
 * fractional floats bit for bit in the order that applies. Only the root's
 * output is written. */
static void test_reduce(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const struct { tcc_dtype_t dt; tcc_redop_t op; } cases[] = {
      {TCC_INT32, TCC_SUM}, {TCC_FLOAT64, TCC_PREMUL_SUM}, {TCC_FLOAT32, TCC_MIN}, {TCC_INT64, TCC_AVG},
      {TCC_FLOAT32, TCC_SUM}, {TCC_FLOAT32, TCC_AVG}};
  const size_t counts_[] = {0, 5, HIER_BYTES / 4 - 1, HIER_BYTES / 4 + 3, 100003};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
    for (size_t ci = 0; ci < sizeof counts_ / sizeof *counts_; ci++)
      for (int root = 0; root < n; root++) {
        const tcc_dtype_t dt = cases[k].dt;
        const tcc_redop_t rop = cases[k].op;
        const size_t es = tcc_dtype_size(dt), count = counts_[ci];
        const bool fractional = dt == TCC_FLOAT32 && (rop == TCC_SUM || rop == TCC_AVG);
        char *in = malloc(count * es + 1), *out = malloc(count * es + 1);
        memset(out, 0x5a, count * es + 1);
        for (size_t i = 0; i < count; i++) {
          if (fractional) ((float *)in)[i] = frac_value(me, i);
          else put(in, dt, i, small_value(me, i, rop));
        }
        tcc_op_opts_t opts = {.premul_factor = 0.5};
        const uint64_t tcp0 = tcp_bytes_queued();
        tcc_result_t r = RUN(tcc_reduce(comm, host_buf(in, count, dt), host_buf(out, count, dt), rop, root, &opts, &op));
        const uint64_t tcp_sent = tcp_bytes_queued() - tcp0;
        CHECK(r == TCC_OK, "%s: reduce %s %s count %zu to %d: %s", spec, tcc_dtype_name(dt), tcc_redop_name(rop),
              count, root, tcc_last_error());
        const bool hier = is_hybrid(comm) && count * es >= HIER_BYTES;
        /* The path: only each host's collector (its rank of the root's local
         * index on even hosts, its first rank on uneven ones) sends data
         * across; the others send their descriptor. */
        const int collector = hosts_uniform(n) ? local_index_of(root) : 0;
        if (hier && me != root && local_index_of(me) != collector)
          CHECK(tcp_sent < count * es / 2, "%s: reduce of %zu B to %d: rank %d sent %llu B over TCP", spec, count * es,
                root, me, (unsigned long long)tcp_sent);
        const sum_order_t order = order_of(n, hier);
        size_t bad = 0;
        for (size_t i = 0; i < count && r == TCC_OK && me == root; i++) {
          if (fractional) {
            float want = ordered_result(&order, i, rop, n);
            if (memcmp(&((float *)out)[i], &want, sizeof want) != 0 && bad++ < 3)
              CHECK(0, "%s: reduce fractional %s of %zu to %d: element %zu is %.9g, expected %.9g", spec,
                    tcc_redop_name(rop), count, root, i, ((float *)out)[i], want);
            continue;
          }
          double want = ref_value(n, i, dt, rop, 0.5);
          if (get(out, dt, i) != want && bad++ < 3)
            CHECK(0, "%s: reduce %s %s count %zu to %d: element %zu is %g, expected %g", spec, tcc_dtype_name(dt),
                  tcc_redop_name(rop), count, root, i, get(out, dt, i), want);
        }
        if (me != root && count > 0)
          CHECK((unsigned char)out[0] == 0x5a, "%s: reduce to %d wrote rank %d's output", spec, root, me);
        free(in);
        free(out);
      }
}

/* allgather around the hierarchical threshold (HIER_GATHER_BYTES of
 * output), out of place and in place, every element of every block
 * checked. On uneven hosts only the leaders send data across. */
static void test_allgather_and_p2p(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t blocks[] = {0, 3, HIER_GATHER_BYTES / 4 / 8, HIER_GATHER_BYTES / 4 / (size_t)n + 1, 20000, 131075, 262147};
  for (size_t bi = 0; bi < sizeof blocks / sizeof *blocks; bi++)
    for (int inplace = 0; inplace < 2; inplace++) {
      const size_t count = blocks[bi];
      int32_t *mine = malloc(count * sizeof *mine + 1), *all = malloc((size_t)n * count * sizeof *all + 1);
      tcc_buf_t recvs[8];
      for (size_t i = 0; i < (size_t)n * count; i++) all[i] = -1;
      int32_t *src = inplace ? all + (size_t)me * count : mine;
      for (size_t i = 0; i < count; i++) src[i] = (int32_t)(i * 3 + (size_t)me * 1000003);
      for (int j = 0; j < n; j++) recvs[j] = host_buf(all + (size_t)j * count, count, TCC_INT32);
      const uint64_t tcp0 = tcp_bytes_queued();
      tcc_result_t r = RUN(tcc_allgather(comm, host_buf(src, count, TCC_INT32), recvs, NULL, &op));
      const uint64_t tcp_sent = tcp_bytes_queued() - tcp0;
      CHECK(r == TCC_OK, "%s: allgather block %zu: %s", spec, count, tcc_last_error());
      if (is_hybrid(comm) && !hosts_uniform(n) && (size_t)n * count * 4 >= HIER_UNEVEN_BYTES && local_index_of(me) != 0)
        CHECK(tcp_sent < count * 4 / 2, "%s: allgather of %zu B blocks: rank %d sent %llu B over TCP", spec, count * 4,
              me, (unsigned long long)tcp_sent);
      size_t bad = 0;
      for (int j = 0; j < n && r == TCC_OK; j++)
        for (size_t i = 0; i < count; i++)
          if (all[(size_t)j * count + i] != (int32_t)(i * 3 + (size_t)j * 1000003) && bad++ < 3)
            CHECK(0, "%s: allgather block %zu%s: element %zu of rank %d's block is %d", spec, count,
                  inplace ? " in place" : "", i, j, all[(size_t)j * count + i]);
      free(mine);
      free(all);
    }
  /* A ring of sends: within a host over the group's connections, and across. */
  if (n > 1) {
    int32_t got[4] = {0}, sent[4] = {me, me * 2, me * 3, 77};
    tcc_op_t *s = NULL, *rv = NULL;
    CHECK(tcc_recv(comm, host_buf(got, 4, TCC_INT32), (me + n - 1) % n, 5, NULL, &rv) == TCC_OK, "recv");
    CHECK(tcc_send(comm, host_buf(sent, 4, TCC_INT32), (me + 1) % n, 5, NULL, &s) == TCC_OK, "send");
    CHECK(finish(TCC_OK, s, NULL, 0) == TCC_OK && finish(TCC_OK, rv, NULL, 0) == TCC_OK, "%s: ring", spec);
    int from = (me + n - 1) % n;
    CHECK(got[0] == from && got[2] == from * 3 && got[3] == 77, "%s: ring got %d %d", spec, got[0], got[2]);
  }
}

/* ---- all-to-all ---------------------------------------------------------- */

/* Elements rank i sends rank j at a scale: uneven, some empty. */
static size_t a2a_count(int i, int j, size_t scale) {
  if (scale == 0 || (i + 2 * j) % 4 == 3) return 0;
  return scale + (size_t)((i * 5 + j * 3) % 7);
}

static int32_t a2a_value(int i, int j, size_t k) { return (int32_t)((size_t)i * 1000003u + (size_t)j * 7919u + k); }

/* all_to_all_v with uneven and empty blocks, on both sides of the block
 * size that decides aggregation, in place and not: every element checked.
 * A rank other than its host's leader sends its data over shared memory
 * when the blocks are aggregated, over TCP otherwise: its TCP byte count
 * says which way the op went. */
static void test_alltoall(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  bool leader = true;
  for (int r = 0; r < me; r++) leader &= group_fake_host(spec, r) != group_fake_host(spec, me);
  const size_t agg_edge = AGG_MAX_BLOCK_BYTES / 4 - 7; /* the largest block at this scale is just below */
  const size_t scales[] = {0, 1, 100, agg_edge, agg_edge + 1, 20000};
  for (size_t si = 0; si < sizeof scales / sizeof *scales; si++)
    for (int inplace = 0; inplace < 2; inplace++) {
      const size_t scale = scales[si];
      tcc_buf_t sends[8], recvs[8];
      int32_t *in[8], *out[8];
      size_t max_block = 0, off_me = 0;
      for (int j = 0; j < n; j++) {
        const size_t cs = a2a_count(me, j, scale), cr = a2a_count(j, me, scale);
        in[j] = malloc(cs * 4 + 1);
        out[j] = inplace && j == me ? in[j] : malloc(cr * 4 + 1);
        for (size_t k = 0; k < cs; k++) in[j][k] = a2a_value(me, j, k);
        for (size_t k = 0; k < cr && out[j] != in[j]; k++) out[j][k] = -1;
        sends[j] = host_buf(in[j], cs, TCC_INT32);
        recvs[j] = host_buf(out[j], cr, TCC_INT32);
        if (j != me) off_me += cs * 4;
        for (int i = 0; i < n; i++) max_block = a2a_count(i, j, scale) > max_block ? a2a_count(i, j, scale) : max_block;
      }
      const uint64_t tcp0 = tcp_bytes_queued();
      tcc_result_t r = RUN(tcc_alltoall(comm, sends, recvs, NULL, &op));
      const uint64_t tcp_sent = tcp_bytes_queued() - tcp0;
      CHECK(r == TCC_OK, "%s: alltoall scale %zu: %s", spec, scale, tcc_last_error());
      size_t bad = 0;
      for (int j = 0; j < n && r == TCC_OK; j++)
        for (size_t k = 0; k < a2a_count(j, me, scale); k++)
          if (out[j][k] != a2a_value(j, me, k) && bad++ < 3)
            CHECK(0, "%s: alltoall scale %zu%s: element %zu from rank %d is %d", spec, scale,
                  inplace ? " in place" : "", k, j, out[j][k]);
      const bool aggregated = max_block * 4 < AGG_MAX_BLOCK_BYTES;
      /* From agg_edge the data outweighs the descriptors (with every
       * rank's counts) that every rank sends every other over TCP first. */
      if (r == TCC_OK && !leader && scale >= agg_edge && is_hybrid(comm))
        CHECK(aggregated ? tcp_sent < off_me : tcp_sent >= off_me,
              "%s: alltoall scale %zu: rank %d sent %llu bytes over TCP for %zu bytes of data (%s expected)", spec,
              scale, me, (unsigned long long)tcp_sent, off_me, aggregated ? "aggregated" : "direct");
      for (int j = 0; j < n; j++) {
        if (out[j] != in[j]) free(out[j]);
        free(in[j]);
      }
    }
}

/* ---- point-to-point: rings within a host, TCP across -------------------- */

static int32_t p2p_value(int from, int to, size_t i) { return (int32_t)(i * 7 + (size_t)from * 1000 + (size_t)to); }

/* Bytes this rank has ever sent to group rank `peer` over shared memory
 * (written into its ring, or read by the peer from this rank's memory),
 * or -1 when the peer is on another host (no ring). */
static long long ring_bytes_to(tcc_comm_t *comm, int peer) {
  const tcc__topology_t *t = comm->topo;
  if (!t || !t->local || t->host_of[peer] != t->host) return -1;
  shm_state_t *st = shm_of(t->local);
  pthread_mutex_lock(&comm->engine->p2p_progress);
  const long long by_ref = (long long)comm->engine->peers[peer].ref_bytes_sent;
  pthread_mutex_unlock(&comm->engine->p2p_progress);
  return (long long)atomic_load(&shm_ring_of(st, t->local->rank, t->local_index[peer])->head) + by_ref;
}

/* Every rank sends to every other at once (sizes from one element to 3
 * MiB, several times a ring's capacity), then receives from any source:
 * every byte checked, and the bytes to each peer of this host counted in
 * its ring (so they did not go through TCP), none for the other hosts. */
static void test_p2p_paths(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t sizes[] = {1, 2500, 3u << 18};
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    const size_t count = sizes[si];
    int32_t *out = malloc((size_t)n * count * sizeof *out), *in = malloc((size_t)n * count * sizeof *in);
    tcc_op_t *ops[16];
    long long before[8];
    int k = 0;
    for (int q = 0; q < n; q++) {
      before[q] = q == me ? -1 : ring_bytes_to(comm, q);
      for (size_t i = 0; i < count; i++) {
        out[(size_t)q * count + i] = p2p_value(me, q, i);
        in[(size_t)q * count + i] = -1;
      }
    }
    for (int q = 0; q < n; q++)
      if (q != me)
        CHECK(tcc_recv(comm, host_buf(in + (size_t)q * count, count, TCC_INT32), q, 40 + si, NULL, &ops[k++]) ==
                  TCC_OK, "%s: recv", spec);
    for (int q = 0; q < n; q++)
      if (q != me)
        CHECK(tcc_send(comm, host_buf(out + (size_t)q * count, count, TCC_INT32), q, 40 + si, NULL, &ops[k++]) ==
                  TCC_OK, "%s: send", spec);
    for (int j = 0; j < k; j++)
      CHECK(finish(TCC_OK, ops[j], NULL, 0) == TCC_OK, "%s: p2p of %zu elements: %s", spec, count, tcc_last_error());
    for (int q = 0; q < n; q++) {
      if (q == me) continue;
      size_t bad = 0;
      for (size_t i = 0; i < count; i++)
        if (in[(size_t)q * count + i] != p2p_value(q, me, i) && bad++ < 3)
          CHECK(0, "%s: %zu elements from rank %d: element %zu is %d", spec, count, q, i, in[(size_t)q * count + i]);
      long long after = ring_bytes_to(comm, q);
      if (before[q] < 0)
        CHECK(after < 0, "%s: rank %d is on another host but has a ring", spec, q);
      else
        CHECK(after - before[q] >= (long long)(count * sizeof(int32_t)),
              "%s: %zu bytes sent to rank %d of this host, %lld through shared memory", spec,
              count * sizeof(int32_t), q, after - before[q]);
    }
    free(out);
    free(in);
  }
  /* Any source: rank 0 takes one message from every other rank, whichever
   * way each comes. */
  int32_t got = -1;
  if (me == 0) {
    bool seen[8] = {false};
    for (int j = 1; j < n; j++) {
      tcc_op_t *op = NULL;
      CHECK(tcc_recv(comm, host_buf(&got, 1, TCC_INT32), TCC_ANY_SOURCE, 77, NULL, &op) == TCC_OK, "any recv");
      const tcc_result_t r = tcc_op_wait(op, -1);
      const int from = tcc_op_peer(op);
      tcc_op_release(op);
      CHECK(r == TCC_OK && from > 0 && from < n && got == p2p_value(from, 0, 0) && !seen[from],
            "%s: any-source receive %d: %d from %d", spec, j, got, from);
      if (from > 0 && from < n) seen[from] = true;
    }
  } else {
    int32_t v = p2p_value(me, 0, 0);
    CHECK(RUN(tcc_send(comm, host_buf(&v, 1, TCC_INT32), 0, 77, NULL, &op)) == TCC_OK, "%s: send to 0", spec);
  }
}

/* Ranks that disagree on a hierarchical allreduce fail alike, and the
 * group stays usable. */
static void test_mismatch(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t count = (1u << 16) + (me == n - 1 ? 4 : 0);
  float *buf = calloc(count, sizeof *buf);
  char msg[TCC_ERRLEN] = "";
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(buf, count, TCC_FLOAT32), TCC_SUM,
                                 NULL, &op);
  r = finish(r, op, msg, sizeof msg);
  CHECK(r == TCC_ERR_MISMATCH && strstr(msg, "size mismatch") && strstr(msg, "hybrid-group"),
        "%s: mismatch gave %s: %s", spec, tcc_result_string(r), msg);
  CHECK(tcc_comm_status(comm) == TCC_OK, "%s: the group must stay usable after a mismatch", spec);
  free(buf);
}

/* ---- float16 / bfloat16 allreduce ---------------------------------------- */

/* v rounded to nearest even at `bits` significant bits (11: float16, 8:
 * bfloat16), in double arithmetic that shares nothing with the core's
 * conversions. The values here stay clear of both formats' subnormals and
 * overflow. */
static float round_to_bits(float v, int bits) {
  if (v == 0) return v;
  const double scale = ldexp(1.0, bits - 1 - ilogb(v));
  return (float)(nearbyint((double)v * scale) / scale);
}

/* The half format's bits of v, which it holds exactly (normal or zero). */
static uint16_t half_bits(float v, tcc_dtype_t dt) {
  if (dt == TCC_BFLOAT16) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (uint16_t)(u >> 16);
  }
  const uint16_t sign = signbit(v) ? 0x8000u : 0;
  const double a = fabs((double)v);
  if (a == 0) return sign;
  const int e = ilogb(a);
  return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)((a / ldexp(1.0, e) - 1.0) * 1024.0));
}

static tcc_dtype_t half_dt; /* the format half_value rounds to */

/* Rank r's element i: a fraction of either sign, exact in half_dt. */
static float half_value(int r, size_t i) {
  const float v = frac_value(r, i) * ((i + (size_t)r) % 3 == 0 ? -1.0f : 1.0f);
  return round_to_bits(v, half_dt == TCC_FLOAT16 ? 11 : 8);
}

/* Whether a float16/bfloat16 allreduce runs hierarchically in float32 on
 * this layout: when the busiest host's link carries less that way (in
 * units of the vector's bytes: 3 (H - 1) / H on even hosts, 4 (H - 1) / H
 * through the leaders) than in the flat exchange (2 L (n - L) / n). */
static bool widening_pays(int n) {
  int per_host[8] = {0}, hosts = 0;
  for (int r = 0; r < n; r++) hosts += per_host[group_fake_host(spec, r)]++ == 0;
  const long hier = hosts_uniform(n) ? 3 : 4;
  for (int h = 0; h < hosts; h++)
    if (2L * per_host[h] * (n - per_host[h]) * hosts > hier * (hosts - 1) * n) return true;
  return false;
}

/* float16 and bfloat16 allreduces, below and above the hierarchical size:
 * SUM and AVG as the float32 sum in the order that applies, rounded once
 * (a second rounding shows in most elements), MAX exactly; in place and
 * out of place. Which algorithm the op takes is checked too, and on uneven
 * hosts that only the leaders send data across. */
static void test_half_allreduce(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const tcc_dtype_t dts[] = {TCC_FLOAT16, TCC_BFLOAT16};
  const tcc_redop_t ops[] = {TCC_SUM, TCC_AVG, TCC_MAX};
  /* the last: three segments of the float32 copy (pipelined), odd tails */
  const size_t counts_[] = {1001, HIER_BYTES / 2 + 5, 70001, 5 * HIER_SEGMENT_BYTES / 8 + 7};
  const size_t ncounts = sizeof counts_ / sizeof *counts_;
  const bool segmented = is_hybrid(comm) && widening_pays(n) && hosts_uniform(n), slow = getenv("TCC_TEST_SLOW");
  for (size_t d = 0; d < 2; d++)
    for (size_t k = 0; k < 3; k++)
      for (size_t ci = 0; ci < ncounts; ci++)
        for (int inplace = 0; inplace < 2; inplace++) {
          /* the segmented path runs on even hosts: SUM in place and AVG out
           * of place there (under the sanitizers, bfloat16 SUM in place) */
          const bool big_case = (ops[k] == TCC_SUM && inplace) || (ops[k] == TCC_AVG && !inplace && !slow);
          if (ci == ncounts - 1 && !(segmented && big_case && (!slow || dts[d] == TCC_BFLOAT16))) continue;
          half_dt = dts[d];
          const tcc_redop_t rop = ops[k];
          const size_t count = counts_[ci];
          uint16_t *in = malloc(count * 2 + 2), *out = malloc(count * 2 + 2), *dst = inplace ? in : out;
          for (size_t i = 0; i < count; i++) in[i] = half_bits(half_value(me, i), half_dt);
          const bool widened = is_hybrid(comm) && count * 2 >= HIER_BYTES && widening_pays(n);
          const tcc_coll_t c = {.kind = TCC_COLL_ALLREDUCE, .dtype = half_dt, .redop = rop, .count = count};
          const char *algorithm = tcc__coll_algorithm(comm, &c);
          CHECK((strstr(algorithm, "in float32, rounded once") != NULL) == widened,
                "%s: %s allreduce of %zu takes '%s'", spec, tcc_dtype_name(half_dt), count, algorithm);
          const uint64_t tcp0 = tcp_bytes_queued();
          tcc_result_t r = RUN(tcc_allreduce(comm, host_buf(in, count, half_dt), host_buf(dst, count, half_dt), rop,
                                             NULL, &op));
          const uint64_t tcp_sent = tcp_bytes_queued() - tcp0;
          CHECK(r == TCC_OK, "%s: %s allreduce %s of %zu: %s", spec, tcc_dtype_name(half_dt), tcc_redop_name(rop), count,
                tcc_last_error());
          /* Even hosts: (H - 1) / H of this rank's shard goes out in float32,
           * as much again in the half type (the flat exchange sends more, the
           * shard's sums in float32 both ways would too). */
          int hosts = 0;
          for (int q = 0; q < n; q++) hosts = group_fake_host(spec, q) + 1 > hosts ? group_fake_host(spec, q) + 1 : hosts;
          const double shard_bytes = 2.0 * (double)count / (double)(n / (hosts ? hosts : 1));
          if (widened && hosts_uniform(n))
            CHECK((double)tcp_sent <= 1.1 * 3.0 * shard_bytes * (hosts - 1) / hosts + 4096,
                  "%s: %s allreduce of %zu: rank %d sent %llu B over TCP, expected about %.0f", spec,
                  tcc_dtype_name(half_dt), count, me, (unsigned long long)tcp_sent,
                  3.0 * shard_bytes * (hosts - 1) / hosts);
          if (widened && !hosts_uniform(n) && local_index_of(me) != 0)
            CHECK(tcp_sent < count, "%s: %s allreduce of %zu: rank %d, not a leader, sent %llu B over TCP", spec,
                  tcc_dtype_name(half_dt), count, me, (unsigned long long)tcp_sent);
          const sum_order_t order = order_of(n, widened);
          size_t bad = 0;
          for (size_t i = 0; i < count && r == TCC_OK; i++) {
            float want;
            if (rop == TCC_MAX) {
              want = half_value(0, i);
              for (int q = 1; q < n; q++) want = half_value(q, i) > want ? half_value(q, i) : want;
            } else {
              const float sum = ordered_sum_of(&order, i, half_value);
              want = round_to_bits(rop == TCC_AVG ? sum / (float)n : sum, half_dt == TCC_FLOAT16 ? 11 : 8);
            }
            if (dst[i] != half_bits(want, half_dt) && bad++ < 3)
              CHECK(0, "%s: %s allreduce %s of %zu%s: element %zu is 0x%04x, expected 0x%04x (%.6g)", spec,
                    tcc_dtype_name(half_dt), tcc_redop_name(rop), count, inplace ? " in place" : "", i, dst[i],
                    half_bits(want, half_dt), want);
          }
          free(in);
          free(out);
        }
}

/* Rank 0 runs its segments' cross-host parts in line, as where its thread
 * cannot be started, while the others use theirs: the host's phases keep
 * one order on every rank, so the sums still come out right (a schedule
 * that changed with the thread would pair one rank's reduce-scatter with
 * its host-mates' all-gather). */
static void test_pipe_refused(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t count = 2 * HIER_SEGMENT_BYTES / 4 + 3;
  atomic_store(&tcc__hier_pipe_refused, me == 0);
  const tcc_redop_t ops[] = {TCC_SUM, TCC_AVG};
  for (size_t k = 0; k < 2; k++) {
    float *buf = malloc(count * sizeof *buf);
    for (size_t i = 0; i < count; i++) buf[i] = (float)small_value(me, i, ops[k]);
    tcc_result_t r = RUN(tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(buf, count, TCC_FLOAT32),
                                       ops[k], NULL, &op));
    CHECK(r == TCC_OK, "%s: allreduce %s with rank 0's pipe refused: %s", spec, tcc_redop_name(ops[k]),
          tcc_last_error());
    size_t bad = 0;
    for (size_t i = 0; i < count && r == TCC_OK; i++) {
      const double want = ref_value(n, i, TCC_FLOAT32, ops[k], 0.5);
      if (buf[i] != (float)want && bad++ < 3)
        CHECK(0, "%s: allreduce %s with rank 0's pipe refused: element %zu is %g, expected %g", spec,
              tcc_redop_name(ops[k]), i, buf[i], want);
    }
    free(buf);
  }
  atomic_store(&tcc__hier_pipe_refused, false);
}

/* Whether the leaders' allreduce overlaps its segments with the host
 * phases (transport.h, tcc__hier_overlap_t), as this test works it out:
 * forced by TCCOMM_HIER_OVERLAP, else only where this machine (every
 * simulated host is on it) has a CPU for each rank and each host's leader
 * thread. */
static bool overlap_expected(int n) {
  const char *env = getenv("TCCOMM_HIER_OVERLAP");
  if (env && strcmp(env, "1") == 0) return true;
  if (env && strcmp(env, "0") == 0) return false;
  int hosts = 0;
  for (int q = 0; q < n; q++) hosts = group_fake_host(spec, q) + 1 > hosts ? group_fake_host(spec, q) + 1 : hosts;
  cpu_set_t set;
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  return n + hosts <= cpus;
}

/* The choice every rank made, and, on uneven hosts where it overlaps,
 * that each leader's thread ran the cross-host part of a segmented
 * allreduce (test_sum_order's results are bit for bit either way). */
static void test_leaders_overlap(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (!is_hybrid(comm)) return;
  CHECK(comm->topo->leaders_overlap == overlap_expected(n), "%s: leaders overlap %d, expected %d", spec,
        comm->topo->leaders_overlap, overlap_expected(n));
  if (hosts_uniform(n) || !comm->topo->leaders_overlap) return;
  const size_t count = 2 * HIER_SEGMENT_BYTES / 4 + 5;
  float *buf = malloc(count * sizeof *buf);
  for (size_t i = 0; i < count; i++) buf[i] = (float)small_value(me, i, TCC_SUM);
  tcc_result_t r = RUN(tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(buf, count, TCC_FLOAT32),
                                     TCC_SUM, NULL, &op));
  CHECK(r == TCC_OK, "%s: segmented leaders' allreduce: %s", spec, tcc_last_error());
  for (size_t i = 0, bad = 0; i < count && r == TCC_OK; i++)
    if (buf[i] != (float)ref_value(n, i, TCC_FLOAT32, TCC_SUM, 0) && bad++ < 3)
      CHECK(0, "%s: segmented leaders' allreduce: element %zu is %g", spec, i, buf[i]);
  const bool leader = local_index_of(me) == 0;
  CHECK((coll_scratch_of(comm)->pipe != NULL) == leader, "%s: rank %d (leader %d) has a pipe thread: %d", spec, me,
        leader, coll_scratch_of(comm)->pipe != NULL);
  free(buf);
}

/* Uneven hosts with the leaders' overlap forced on (this machine has too
 * few CPUs for auto to choose it): the segmented path, bit for bit. */
static void overlap_tests(tcc_comm_t *comm) {
  test_leaders_overlap(comm);
  test_sum_order(comm);
  test_allreduce_ops(comm);
}

static void all_tests(tcc_comm_t *comm) {
  test_leaders_overlap(comm);
  test_allreduce_ops(comm);
  test_sum_order(comm);
  test_half_allreduce(comm);
  test_pipe_refused(comm);
  test_broadcast(comm);
  test_allgather_and_p2p(comm);
  test_reduce_scatter(comm);
  test_reduce(comm);
  test_alltoall(comm);
  test_p2p_paths(comm);
  if (tcc_comm_size(comm) > 1) test_mismatch(comm);
  test_allreduce_ops(comm); /* still right after the mismatch */
}

/* ---- a rank that dies ---------------------------------------------------- */

/* The last rank exits; every other rank's hierarchical allreduce fails
 * within about a second, naming it (over shared memory for the ranks of
 * its host, over TCP for the others). */
static void dead_rank_test(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (me == n - 1) _exit(0);
  const size_t count = 1u << 18;
  float *buf = calloc(count, sizeof *buf);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  char msg[TCC_ERRLEN] = "";
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(buf, count, TCC_FLOAT32), TCC_SUM,
                                 NULL, &op);
  r = finish(r, op, msg, sizeof msg);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  char dead[32];
  snprintf(dead, sizeof dead, "rank %d", n - 1);
  CHECK(r == TCC_ERR_REMOTE && strstr(msg, dead) && strstr(msg, "dead-group"), "%s: dead rank gave %s: %s", spec,
        tcc_result_string(r), msg);
  CHECK(secs < 3, "%s: the dead rank was noticed after %.2f s", spec, secs);
  free(buf);
}

/* The last rank exits; a receive from it fails within about a second on
 * every other rank, over its ring on its host and over TCP elsewhere. */
static void dead_rank_p2p_test(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  if (me == n - 1) _exit(0);
  int32_t x = 0;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  char msg[TCC_ERRLEN] = "";
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_recv(comm, host_buf(&x, 1, TCC_INT32), n - 1, 9, NULL, &op);
  r = finish(r, op, msg, sizeof msg);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  char dead[32];
  snprintf(dead, sizeof dead, "rank %d", n - 1);
  CHECK(r == TCC_ERR_REMOTE && strstr(msg, dead) && strstr(msg, "dead-group"), "%s: receive from the dead rank gave %s: %s",
        spec, tcc_result_string(r), msg);
  CHECK(secs < (getenv("TCC_TEST_SLOW") ? 5.0 : 1.0), "%s: the dead rank was noticed after %.2f s", spec, secs);
}

/* ---- a rank that dies in the middle of a hierarchical op ----------------- */

/* When in the op the last rank dies: a fraction of the op's own duration,
 * so the trials land in different phases (host reduce-scatter, the hosts'
 * allreduce, host all-gather) whatever this machine's speed. */
static double death_at;

static double seconds_since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

static void *die_later(void *arg) {
  usleep((useconds_t)(*(double *)arg * 1e6));
  _exit(0); /* mid-op, without a word: what a crash leaves */
}

/* Each survivor's op ends within a few seconds of the death (the group
 * timeout is 30 s): with the right sum if everything it needed had
 * arrived, else failing with a peer named. Whatever phase each rank was
 * in, a rank waiting on one whose communicator failed learns it from that
 * rank (its host's segment, or the end of its TCP connections), not from
 * its own timeout: the failed ranks stay alive, without destroying. The
 * next op then fails at once everywhere. */
static void midop_death_test(tcc_comm_t *comm) {
  const int n = tcc_comm_size(comm), me = tcc_comm_rank(comm);
  const size_t count = 1u << 22; /* 16 MiB: phases long enough to land in */
  float *buf = malloc(count * sizeof *buf);
  for (size_t i = 0; i < count; i++) buf[i] = 1;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  CHECK(RUN(tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(buf, count, TCC_FLOAT32), TCC_SUM,
                          NULL, &op)) == TCC_OK, "%s: the timing op failed", spec);
  double delay = death_at * seconds_since(&t0);
  pthread_t killer;
  if (me == n - 1) pthread_create(&killer, NULL, die_later, &delay);
  for (size_t i = 0; i < count; i++) buf[i] = 1;
  char msg[TCC_ERRLEN] = "";
  struct timespec op_start;
  clock_gettime(CLOCK_MONOTONIC, &op_start);
  t0 = op_start;
  tcc_op_t *op = NULL;
  tcc_result_t r = tcc_allreduce(comm, host_buf(buf, count, TCC_FLOAT32), host_buf(buf, count, TCC_FLOAT32),
                                 TCC_SUM, NULL, &op);
  r = finish(r, op, msg, sizeof msg);
  double took = seconds_since(&t0);
  if (me == n - 1) pause(); /* it outlived the op: wait for the end */
  const double bound = delay + (getenv("TCC_TEST_SLOW") ? 10.0 : 3.0);
  CHECK(took < bound, "%s, death at %.0f%%: rank %d's op ended %.2f s after it began (%.2f s allowed): %s", spec,
        death_at * 100, me, took, bound, msg);
  if (r == TCC_OK) {
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) bad += buf[i] != (float)n;
    CHECK(bad == 0, "%s: the op succeeded on rank %d with %zu wrong elements", spec, me, bad);
  } else {
    CHECK((r == TCC_ERR_REMOTE || r == TCC_ERR_ABORTED) && strstr(msg, "midop-group") && strstr(msg, "allreduce"),
          "%s, death at %.0f%%: rank %d got %s: %s", spec, death_at * 100, me, tcc_result_string(r), msg);
  }
  clock_gettime(CLOCK_MONOTONIC, &t0);
  r = RUN(tcc_allreduce(comm, host_buf(buf, 1, TCC_FLOAT32), host_buf(buf, 1, TCC_FLOAT32), TCC_SUM, NULL, &op));
  took = seconds_since(&t0);
  CHECK(r != TCC_OK && took < bound, "%s: rank %d's next op gave %s after %.2f s", spec, me, tcc_result_string(r),
        took);
  free(buf);
  /* Alive, its communicator failed, until every survivor's bound passed:
   * a destroy would end its connections and tell the others anyway. */
  while (seconds_since(&op_start) < bound + 0.5) usleep(20000);
}

int main(void) {
  /* Under a sanitizer (TCC_TEST_SLOW) every topology would take over ten
   * minutes on two CPUs (TSan), so it runs the battery on the topologies
   * that each take paths of their own (2 + 1 leaders, 1 + 3, 3 + 2 not
   * contiguous, three hosts' partials) and two of the four death points:
   * about eight minutes. The release build (make test) runs all of them. */
  const bool slow = getenv("TCC_TEST_SLOW") != NULL;
  alarm(slow ? 1200 : 600); /* a hang fails the test instead of blocking CI */
  unsetenv("TCCOMM_TRANSPORT");
  const struct { const char *spec; int n; bool under_sanitizer; } groups[] = {
      {"auto-pairs", 4, false},       /* 2 hosts x 2: sharded phases */
      {"auto-pairs", 6, false},       /* 3 hosts x 2 */
      {"auto-pairs", 3, true},        /* 2 + 1: leaders */
      {"auto-interleaved", 4, false}, /* hosts whose ranks are not contiguous */
      {"auto-uneven", 4, true},       /* 1 + 3 */
      {"auto-interleaved", 5, true},  /* 3 + 2, not contiguous */
      {"auto-halves", 5, false},      /* 3 + 2 */
      {"auto-threes", 8, true},       /* 3 + 3 + 2: the sum over three hosts' partials */
  };
  /* 3 + 3: float16/bfloat16 allreduces run in float32 phases on even hosts. */
  spec = "auto-threes";
  int bad_half = run_group(6, spec, 60000, "hybrid-half", test_half_allreduce);
  printf("%s %s n=6, float16/bfloat16 allreduce\n", bad_half ? "FAIL" : "ok  ", spec);
  int passed = !bad_half, failed = bad_half;
  for (size_t g = 0; g < sizeof groups / sizeof *groups; g++) {
    if (slow && !groups[g].under_sanitizer) {
      printf("skip %s n=%d under a sanitizer (release build only)\n", groups[g].spec, groups[g].n);
      continue;
    }
    spec = groups[g].spec;
    int bad = run_group(groups[g].n, spec, 60000, "hybrid-group", all_tests);
    printf("%s %s n=%d\n", bad ? "FAIL" : "ok  ", spec, groups[g].n);
    bad ? failed++ : passed++;
  }
  const struct { const char *spec; int n; } uneven[] = {{"auto-pairs", 3}, {"auto-interleaved", 5}};
  setenv("TCCOMM_HIER_OVERLAP", "1", 1);
  for (size_t g = 0; g < sizeof uneven / sizeof *uneven; g++) {
    spec = uneven[g].spec;
    int bad = run_group(uneven[g].n, spec, 60000, "overlap-group", overlap_tests);
    printf("%s %s n=%d, leaders' allreduce overlapped (TCCOMM_HIER_OVERLAP=1)\n", bad ? "FAIL" : "ok  ", spec,
           uneven[g].n);
    bad ? failed++ : passed++;
  }
  unsetenv("TCCOMM_HIER_OVERLAP");
  const char *dead_specs[] = {"auto-pairs", "auto-uneven"};
  for (int d = 0; d < 2; d++) {
    spec = dead_specs[d];
    int bad = run_group(4, spec, 30000, "dead-group", dead_rank_test);
    printf("%s %s dead rank\n", bad ? "FAIL" : "ok  ", spec);
    bad ? failed++ : passed++;
    bad = run_group(4, spec, 30000, "dead-group", dead_rank_p2p_test);
    printf("%s %s dead rank, receive from it\n", bad ? "FAIL" : "ok  ", spec);
    bad ? failed++ : passed++;
  }
  const double death_points[] = {0.1, 0.35, 0.6, 0.85};
  for (int d = 0; d < 2; d++) {
    spec = dead_specs[d];
    for (size_t k = 0; k < sizeof death_points / sizeof *death_points; k++) {
      if (slow && k % 2) continue; /* 10% and 60% */
      death_at = death_points[k];
      int bad = run_group(4, spec, 30000, "midop-group", midop_death_test);
      printf("%s %s rank dies %.0f%% into an op\n", bad ? "FAIL" : "ok  ", spec, death_at * 100);
      bad ? failed++ : passed++;
    }
  }
  printf("test_hybrid: %d groups passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
