/*
 * coll_hier_alltoall.c - all-to-all on groups that span hosts, small
 * blocks aggregated per host.
 *
 * Flat, every pair of ranks exchanges its own message: L x L' messages
 * between two hosts of L and L' ranks, each paying the network's latency,
 * and host-mates' blocks go through TCP loopback. Aggregated, in three
 * phases on the topology's views:
 *   1. within each host (shared memory), every rank sends its host-mates
 *      their blocks, and its leader (local index 0) its block for the
 *      leader followed by all its blocks for other hosts;
 *   2. the leaders exchange one message per pair of hosts: the blocks from
 *      every rank of one host to every rank of the other;
 *   3. within each host, the leader hands every rank the blocks that came
 *      for it from the other hosts.
 * Every rank learns every rank's counts in the descriptor exchange, so
 * every rank sizes every phase alike, and all choose the same way: when
 * some block is large the leaders' extra copies and the serialization on
 * one rank per host cost more than the messages saved, and the op moves
 * directly between every pair (the streams' algorithm, already agreed).
 *
 * Layouts (blocks in elements of the op's dtype, never split):
 *   a rank's off-host blocks: to every rank of every other host, in host
 *     order, each host's ranks in local index order;
 *   phase 1, to the leader: [block for the leader][off-host blocks];
 *   phase 2, host h to host g: for each rank a of h, its blocks for g's
 *     ranks in local index order;
 *   phase 3, to local rank b: for each other host in host order, for each
 *     of its ranks a, the block a -> b.
 */
#include <stdlib.h>
#include <string.h>

#include "coll/hier_phase.h"
#include "core/copy.h"

/* Aggregation pays off while every block is below this. Measured on
 * simulated hosts over 10 Gbit/s: on 2 x 4 it is 10-20% ahead of direct
 * up to 1 KiB blocks, even at 2 KiB, behind from 4 KiB (32 KiB per rank:
 * 1.12-1.44 against 1.10-1.14 ms); on 2 x 2 even up to 4 KiB blocks, and
 * behind from 8 KiB (bench/README.md). */
#define AGG_MAX_BLOCK_BYTES (2u << 10)

typedef struct a2a {
  tcc_comm_t *comm;
  const tcc__topology_t *t;
  const tcc_coll_t *c;
  const uint64_t *S; /* [n x n] elements rank i sends to rank j */
  size_t es;         /* element size */
  int n;
} a2a_t;

static size_t bytes(const a2a_t *a, int from, int to) { return (size_t)a->S[(size_t)from * (size_t)a->n + (size_t)to] * a->es; }
/* memcpy that accepts the NULL buffers of empty blocks */
static void copy(void *dst, const void *src, size_t len) {
  if (len) tcc__copy(dst, src, len);
}

/* Bytes rank i sends to the ranks of host g. */
static size_t to_host(const a2a_t *a, int i, int g) {
  size_t sum = 0;
  for (int b = 0; b < a->t->host_size[g]; b++) sum += bytes(a, i, rank_at(a->t, g, b));
  return sum;
}

/* Bytes rank i sends off its host. */
static size_t off_host(const a2a_t *a, int i) {
  size_t sum = 0;
  for (int g = 0; g < a->t->nhosts; g++)
    if (g != a->t->host_of[i]) sum += to_host(a, i, g);
  return sum;
}

/* Bytes from the ranks of host h to the ranks of host g. */
static size_t host_to_host(const a2a_t *a, int h, int g) {
  size_t sum = 0;
  for (int i = 0; i < a->t->host_size[h]; i++) sum += to_host(a, rank_at(a->t, h, i), g);
  return sum;
}

static bool blocks_small(const a2a_t *a) {
  for (size_t k = 0; k < (size_t)a->n * (size_t)a->n; k++)
    if (a->S[k] * a->es >= AGG_MAX_BLOCK_BYTES) return false;
  return true;
}

/* One all-to-all phase on a view (NULL: this rank has no part in it). */
typedef struct phase_args {
  void **sends, **recvs;
  size_t *send_counts, *recv_counts;
} phase_args_t;

static tcc_result_t run_phase(const a2a_t *a, tcc_comm_t *view, const phase_args_t *p, uint64_t seq, int64_t deadline,
                              tcc_err_t *err) {
  if (!view) return TCC_OK;
  tcc_coll_t ph = {.kind = TCC_COLL_ALLTOALL, .dtype = a->c->dtype, .sends = p->sends, .recvs = p->recvs,
                   .send_counts = p->send_counts, .recv_counts = p->recv_counts};
  return tcc__coll_run(view, &ph, seq, deadline, err);
}

static void set(phase_args_t *p, int j, const void *send, size_t send_bytes, void *recv, size_t recv_bytes,
                size_t es) {
  p->sends[j] = (void *)send;
  p->send_counts[j] = send_bytes / es;
  p->recvs[j] = recv;
  p->recv_counts[j] = recv_bytes / es;
}

/* Appends the off-host blocks of rank `me` (whose blocks are c->sends) at dst. */
static uint8_t *pack_off_host(const a2a_t *a, uint8_t *dst) {
  const tcc__topology_t *t = a->t;
  const int me = a->comm->rank;
  for (int g = 0; g < t->nhosts; g++) {
    if (g == t->host) continue;
    for (int b = 0; b < t->host_size[g]; b++) {
      const int j = rank_at(t, g, b);
      copy(dst, a->c->sends[j], bytes(a, me, j));
      dst += bytes(a, me, j);
    }
  }
  return dst;
}

/* Phase 3's message for each local rank b from phase 2's arrivals `in`
 * (host g's part at in_at[g]): out_at[b] advances as blocks are placed.
 * Blocks for this rank (the leader) go straight to its outputs. */
static void sort_arrivals(const a2a_t *a, void *const *in_at, uint8_t **out_at) {
  const tcc__topology_t *t = a->t;
  const int me = a->comm->rank;
  for (int g = 0; g < t->nhosts; g++) {
    if (g == t->host) continue;
    const uint8_t *p = in_at[g];
    for (int i = 0; i < t->host_size[g]; i++) {
      const int from = rank_at(t, g, i);
      for (int b = 0; b < t->host_size[t->host]; b++) {
        const int to = rank_at(t, t->host, b);
        const size_t len = bytes(a, from, to);
        copy(to == me ? a->c->recvs[from] : out_at[b], p, len);
        if (to != me) out_at[b] += len;
        p += len;
      }
    }
  }
}

/* A non-leader's phase-3 message, into its outputs. */
static void unpack_arrivals(const a2a_t *a, const uint8_t *p) {
  const tcc__topology_t *t = a->t;
  const int me = a->comm->rank;
  for (int g = 0; g < t->nhosts; g++) {
    if (g == t->host) continue;
    for (int i = 0; i < t->host_size[g]; i++) {
      const int from = rank_at(t, g, i);
      copy(a->c->recvs[from], p, bytes(a, from, me));
      p += bytes(a, from, me);
    }
  }
}

/* Buffers of one aggregated op: pointer and count arrays for the phases,
 * and the staging bytes. */
typedef struct a2a_mem {
  phase_args_t ph;
  uint8_t **cursor; /* [max(L, H)] */
  uint8_t *stage;
  void *block;
} a2a_mem_t;

static bool mem_alloc(a2a_mem_t *m, int entries, size_t stage_bytes) {
  const size_t e = (size_t)entries;
  m->block = malloc(e * (3 * sizeof(void *) + 2 * sizeof(size_t)) + stage_bytes + 1);
  if (!m->block) return false;
  m->ph.sends = m->block;
  m->ph.recvs = m->ph.sends + e;
  m->cursor = (uint8_t **)(m->ph.recvs + e);
  m->ph.send_counts = (size_t *)(m->cursor + e);
  m->ph.recv_counts = m->ph.send_counts + e;
  m->stage = (uint8_t *)(m->ph.recv_counts + e);
  return true;
}

static void clear(phase_args_t *p, int entries) {
  for (int j = 0; j < entries; j++) {
    p->sends[j] = p->recvs[j] = NULL;
    p->send_counts[j] = p->recv_counts[j] = 0;
  }
}

/* Phase 1 between host-mates: every block straight from its input to its
 * output; the callers then reroute what goes through the leader. */
static void host_blocks(const a2a_t *a, phase_args_t *p) {
  const tcc__topology_t *t = a->t;
  const int me = a->comm->rank;
  for (int b = 0; b < t->host_size[t->host]; b++) {
    const int j = rank_at(t, t->host, b);
    set(p, b, a->c->sends[j], bytes(a, me, j), a->c->recvs[j], bytes(a, j, me), a->es);
  }
}

static tcc_result_t nomem(const a2a_t *a, uint64_t seq, tcc_err_t *err) {
  return tcc__err_set(err, TCC_ERR_SYSTEM, "tccomm alltoall #%llu on '%s' (rank %d): out of memory",
                      (unsigned long long)seq, a->comm->name, a->comm->rank);
}

static tcc_result_t as_member(const a2a_t *a, uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const tcc__topology_t *t = a->t;
  const int me = a->comm->rank, L = t->host_size[t->host], leader = rank_at(t, t->host, 0);
  const size_t to_leader = bytes(a, me, leader) + off_host(a, me);
  size_t from_others = 0;
  for (int j = 0; j < a->n; j++)
    if (t->host_of[j] != t->host) from_others += bytes(a, j, me);
  a2a_mem_t m;
  if (!mem_alloc(&m, L, to_leader + from_others)) return nomem(a, seq, err);
  uint8_t *packed = m.stage, *arrivals = m.stage + to_leader;
  copy(packed, a->c->sends[leader], bytes(a, me, leader));
  pack_off_host(a, packed + bytes(a, me, leader));
  host_blocks(a, &m.ph);
  set(&m.ph, 0, packed, to_leader, a->c->recvs[leader], bytes(a, leader, me), a->es);
  tcc_result_t r = run_phase(a, t->local, &m.ph, seq, deadline, err);
  if (r == TCC_OK) {
    clear(&m.ph, L);
    set(&m.ph, 0, NULL, 0, arrivals, from_others, a->es);
    r = run_phase(a, t->local, &m.ph, seq, deadline, err);
  }
  if (r == TCC_OK) unpack_arrivals(a, arrivals);
  free(m.block);
  return r;
}

static tcc_result_t as_leader(const a2a_t *a, uint64_t seq, int64_t deadline, tcc_err_t *err) {
  const tcc__topology_t *t = a->t;
  const int me = a->comm->rank, H = t->nhosts, h = t->host, L = t->host_size[h];
  /* staging: [phase 1 arrivals, per local rank][phase 2 out, per host][phase 2 in, per host][phase 3 out, per local rank] */
  size_t gathered = 0, out2 = 0, in2 = 0, out3 = 0;
  for (int b = 1; b < L; b++) gathered += bytes(a, rank_at(t, h, b), me) + off_host(a, rank_at(t, h, b));
  for (int g = 0; g < H; g++)
    if (g != h) {
      out2 += host_to_host(a, h, g);
      in2 += host_to_host(a, g, h);
    }
  for (int j = 0; j < a->n; j++)
    if (t->host_of[j] != h)
      for (int b = 1; b < L; b++) out3 += bytes(a, j, rank_at(t, h, b));
  a2a_mem_t m;
  const int entries = L > H ? L : H;
  if (!mem_alloc(&m, entries, gathered + out2 + in2 + out3)) return nomem(a, seq, err);
  uint8_t *const g1 = m.stage, *const o2 = g1 + gathered, *const i2 = o2 + out2, *const o3 = i2 + in2;

  /* 1: host-mates' blocks, and their off-host blocks to this rank */
  host_blocks(a, &m.ph);
  uint8_t *p = g1;
  for (int b = 1; b < L; b++) {
    const int j = rank_at(t, h, b);
    const size_t len = bytes(a, j, me) + off_host(a, j);
    m.ph.recvs[b] = p;
    m.ph.recv_counts[b] = len / a->es;
    m.cursor[b] = p + bytes(a, j, me); /* where j's off-host blocks start */
    p += len;
  }
  tcc_result_t r = run_phase(a, t->local, &m.ph, seq, deadline, err);
  if (r != TCC_OK) goto out;
  for (int b = 1; b < L; b++) {
    const int j = rank_at(t, h, b);
    copy(a->c->recvs[j], m.ph.recvs[b], bytes(a, j, me));
  }
  if (!t->local && a->c->sends[me] != a->c->recvs[me]) /* alone on its host: its own block */
    copy(a->c->recvs[me], a->c->sends[me], bytes(a, me, me));

  /* 2: host to host; the leaders' view holds one rank per host, in host order */
  clear(&m.ph, entries);
  uint8_t *o = o2, *in = i2;
  for (int g = 0; g < H; g++) {
    if (g == h) continue;
    uint8_t *start = o, *in_start = in;
    for (int b = 0; b < L; b++) {
      const size_t len = to_host(a, rank_at(t, h, b), g);
      if (b == 0) {
        for (int k = 0; k < t->host_size[g]; k++) {
          const int j = rank_at(t, g, k);
          copy(o, a->c->sends[j], bytes(a, me, j));
          o += bytes(a, me, j);
        }
      } else {
        copy(o, m.cursor[b], len); /* host g's blocks follow those of the hosts before it */
        m.cursor[b] += len;
        o += len;
      }
    }
    in += host_to_host(a, g, h);
    set(&m.ph, g, start, (size_t)(o - start), in_start, (size_t)(in - in_start), a->es);
  }
  r = run_phase(a, t->cross, &m.ph, seq, deadline, err);
  if (r != TCC_OK) goto out;

  /* 3: to each host-mate what came for it */
  uint8_t *q = o3;
  for (int b = 1; b < L; b++) {
    m.cursor[b] = q;
    for (int j = 0; j < a->n; j++)
      if (t->host_of[j] != h) q += bytes(a, j, rank_at(t, h, b));
  }
  sort_arrivals(a, m.ph.recvs, m.cursor); /* phase 2's arrivals, by host */
  clear(&m.ph, entries);
  q = o3;
  for (int b = 1; b < L; b++) {
    m.ph.sends[b] = q;
    m.ph.send_counts[b] = (size_t)(m.cursor[b] - q) / a->es;
    q = m.cursor[b];
  }
  r = run_phase(a, t->local, &m.ph, seq, deadline, err);
out:
  free(m.block);
  return r;
}

tcc_result_t tcc__coll_hier_alltoall(tcc_comm_t *comm, const tcc_coll_t *c, uint64_t seq, int64_t deadline_ns,
                                     tcc_err_t *err) {
  const int n = comm->size;
  uint64_t *matrix = malloc((size_t)n * (size_t)n * sizeof *matrix);
  const a2a_t a = {.comm = comm, .t = comm->topo, .c = c, .S = matrix, .es = tcc__dtype_size(c->dtype), .n = n};
  if (!matrix) return nomem(&a, seq, err);
  tcc_result_t r = tcc__coll_stream_agree(comm, c, seq, deadline_ns, matrix, err);
  if (r == TCC_OK && !blocks_small(&a)) {
    r = tcc__coll_stream_run_agreed(comm, c, seq, deadline_ns, err);
  } else if (r == TCC_OK) {
    tcc_coll_t staged;
    void *mem = NULL;
    if (!tcc__coll_snapshot_inputs(c, n, comm->rank, &staged, &mem)) {
      r = nomem(&a, seq, err);
    } else {
      const a2a_t s = {.comm = comm, .t = comm->topo, .c = &staged, .S = matrix, .es = a.es, .n = n};
      r = comm->topo->local_index[comm->rank] == 0 ? as_leader(&s, seq, deadline_ns, err)
                                                     : as_member(&s, seq, deadline_ns, err);
      free(mem);
    }
    /* The counts agreed, so a phase cannot disagree: a failure leaves the
     * ranks out of step, and the group must fail. */
    if (r == TCC_ERR_MISMATCH || r == TCC_ERR_INVALID || r == TCC_ERR_UNSUPPORTED) r = TCC_ERR_REMOTE;
    if (r != TCC_OK)
      tcc__err_prefix(err, r, "tccomm alltoall #%llu on '%s' (rank %d), in a hierarchical phase: ",
                      (unsigned long long)seq, comm->name, comm->rank);
  }
  free(matrix);
  return r;
}
