/*
 * transport.h - what a transport provides to the rest of the core.
 */
#ifndef TCC_TRANSPORT_TRANSPORT_H
#define TCC_TRANSPORT_TRANSPORT_H

#include <sys/uio.h>

#include "core/internal.h"

/* ---- what a transport offers the collective algorithms (coll/) ------ */

/* Shared staging windows (one host). Every rank owns, per parity (0, 1),
 * a descriptor slot, an input window and a result window of
 * window_bytes() each, which every rank can read. Algorithms advance in
 * stages: stage s writes only parity s&1 of the writer's own windows, then
 * every rank passes barrier s, then ranks read parity s&1 of any rank.
 * Passing barrier s proves every rank finished reading stage s-1, so
 * writing stage s+1 may start right after it: one barrier per stage. */
typedef struct tcc__spans_ops {
  size_t (*window_bytes)(tcc_comm_t *comm);
  /* Reductions up to this size go one-shot (agreed by every rank). */
  size_t (*one_shot_bytes)(tcc_comm_t *comm);
  char *(*desc)(tcc_comm_t *comm, int rank, int parity);
  /* Bytes right after a descriptor that travel with it at no cost (the
   * rest of its cache line): a one-shot reduction's input that fits goes
   * there instead of the input span. Every rank has the same value. */
  size_t desc_inline_bytes;
  char *(*input)(tcc_comm_t *comm, int rank, int parity);
  char *(*result)(tcc_comm_t *comm, int rank, int parity);
  /* The parity the next stage writes. */
  int (*next_parity)(tcc_comm_t *comm);
  /* Arrives at the next stage's barrier and waits for every rank (and
   * their liveness). On timeout the message names `what`, seq and the
   * ranks that did not arrive; TCC_ERR_ABORTED soon after the
   * communicator failed. */
  tcc_result_t (*barrier)(tcc_comm_t *comm, int64_t deadline_ns, const char *what, uint64_t seq,
                          tcc_err_t *err);
  /* A hint, called right after a barrier: this rank will soon write its
   * descriptor and the first `bytes` of its input span of `parity` again.
   * The peers are done reading them (the stage rule), so the lines may be
   * taken back into this rank's cache now, while it has other work, instead
   * of one by one when the next stage writes them. Changes no result. */
  void (*prefetch_writes)(tcc_comm_t *comm, int parity, size_t bytes);
  /* Single-copy movement: bytes go straight from another rank's own
   * memory into this rank's, one copy instead of two through the windows.
   * direct_bytes: this rank's own verdict, SIZE_MAX when it cannot read
   * every peer this way, else the size from which movement should go
   * direct (the same on every rank that can); algorithms combine every
   * rank's published value before choosing. peer_read copies `len` bytes
   * at address `remote` of `rank` into `local`, peer_write the other way;
   * an error names the op (`what`, seq) and the peer. */
  size_t (*direct_bytes)(tcc_comm_t *comm);
  /* The size every rank of the group that can move directly uses: a
   * stream shorter than it never moves directly, whatever the verdicts. */
  size_t (*direct_agreed_bytes)(tcc_comm_t *comm);
  tcc_result_t (*peer_read)(tcc_comm_t *comm, int rank, void *local, uint64_t remote, size_t len, const char *what,
                            uint64_t seq, tcc_err_t *err);
  tcc_result_t (*peer_write)(tcc_comm_t *comm, int rank, const void *local, uint64_t remote, size_t len,
                             const char *what, uint64_t seq, tcc_err_t *err);
  /* Slot rings (coll/coll_slots.c): every rank owns slot_count() slots of
   * slot_bytes() each (0 slots: none), which only it writes and every rank
   * reads; slot(comm, rank, i) is slot i mod slot_count() of `rank`, and
   * the slots of a rank lie one after the other in that order. Its
   * progress line holds two words only it writes ([0] and [1]); peers
   * read them. Every slot and progress word starts at 0. slot_span_bytes:
   * the largest part a rooted op may lay over several consecutive slots
   * (0: none), the same on every rank of the group. */
  unsigned (*slot_count)(tcc_comm_t *comm);
  size_t (*slot_bytes)(tcc_comm_t *comm);
  size_t (*slot_span_bytes)(tcc_comm_t *comm);
  char *(*slot)(tcc_comm_t *comm, int rank, uint64_t index);
  atomic_ullong *(*slot_progress)(tcc_comm_t *comm, int rank);
  /* Waits until ready(arg), with the stage barrier's checks: abort, and
   * whether `peer` lives (an error names `what` and seq); TCC_ERR_TIMEOUT
   * at the deadline, without a message. A writer of a slot or progress
   * word calls slot_wake after its store, to wake peers asleep in here. */
  tcc_result_t (*slot_wait)(tcc_comm_t *comm, bool (*ready)(void *arg), void *arg, int peer, int64_t deadline_ns,
                            const char *what, uint64_t seq, tcc_err_t *err);
  void (*slot_wake)(tcc_comm_t *comm);
  /* Whether `rank` arrived at a stage barrier this rank has not passed:
   * it runs a later op than this rank's. */
  bool (*stage_ahead)(tcc_comm_t *comm, int rank);
  /* 4 bytes beside a rank's descriptor of a parity, which reach the peers
   * with it: the digest of the slot-ring ops it ran (coll_slots.c). */
  uint32_t *(*digest)(tcc_comm_t *comm, int rank, int parity);
} tcc__spans_ops_t;

/* Byte streams between every pair of ranks, reserved for collectives (the
 * collective runner is their only user). Non-blocking, in the manner of
 * send(2) and recv(2). */
typedef struct tcc__stream_ops {
  /* Bytes moved, or -1 with errno (EAGAIN: nothing can move now). recv
   * returns 0 when the peer closed its end. */
  ssize_t (*send)(tcc_comm_t *comm, int peer, const void *buf, size_t len);
  ssize_t (*recv)(tcc_comm_t *comm, int peer, void *buf, size_t len);
  /* Waits up to timeout_ms (0: only looks) until one of the n streams to
   * peers[i] can move in the directions of events[i] (POLLIN, POLLOUT);
   * revents[i] gets poll(2)'s flags. The number ready, or -1 with errno. */
  int (*poll)(tcc_comm_t *comm, int n, const int *peers, const short *events, short *revents,
              int timeout_ms);
} tcc__stream_ops_t;

/* ---- transports ------------------------------------------------------- */

/* A transport does connection-level work only: setup, teardown, moving
 * bytes between two ranks, telling when a peer is gone. It offers the
 * collective algorithms shared spans or streams (or both); the
 * point-to-point byte streams are progressed by the host executor's p2p
 * thread. */
/* Capability flags (tcc_transport_ops.caps). */
enum {
  /* Every rank of the group can map memory every other rank shares (one
   * host, one /dev/shm): windows and single-copy movement need it. */
  TCC__TRANSPORT_SHARES_MEMORY = 1u << 0,
  /* The group's streams carry its own collectives only (no view of
   * another group reads them): a sender may leave its peers' frames of an
   * op unread until its next op (coll_stream_eager.c). */
  TCC__TRANSPORT_STREAMS_ALONE = 1u << 1,
};

typedef struct tcc_transport_ops {
  const char *name;
  unsigned caps; /* TCC__TRANSPORT_* */
  const tcc__spans_ops_t *spans;     /* NULL when not offered */
  const tcc__stream_ops_t *streams;  /* NULL when not offered */
  /* Non-blocking point-to-point byte stream to / from `peer`. Return
   * bytes moved (0 when nothing can move now) or -1 with err set when the
   * channel failed. A write gathers its iovcnt parts, in order, as one
   * (a message's header and payload: one system call, or one update of a
   * ring's head); it may take a prefix of them. */
  ssize_t (*p2p_write)(tcc_comm_t *comm, int peer, const struct iovec *iov, int iovcnt,
                       tcc_err_t *err);
  ssize_t (*p2p_read)(tcc_comm_t *comm, int peer, void *buf, size_t len,
                      tcc_err_t *err);
  /* Sleeps until some p2p channel may be able to move bytes, or until
   * p2p_notify is called, or max_ns passes. want_write[peer] is true
   * for peers with bytes waiting to be written. */
  void (*p2p_wait)(tcc_comm_t *comm, const bool *want_write, int64_t max_ns);
  /* Wakes p2p_wait (new local work or abort). Any thread. */
  void (*p2p_notify)(tcc_comm_t *comm);
  /* Optional: whether a write of `bytes` to `peer` now takes them all
   * (no other thread writes to the stream meanwhile). NULL: a write may
   * take a prefix of any size. */
  bool (*p2p_fits)(tcc_comm_t *comm, int peer, size_t bytes);
  /* Optional, both or neither: single-copy messages (host/p2p_direct.c).
   * p2p_direct: whether a message of `bytes` between this rank and `peer`
   * goes by reference, its receiver reading it from the sender's memory
   * with p2p_peer_read (the receiver said it can read every rank);
   * `to_peer`: this rank sends it, else `peer` does. p2p_peer_read:
   * len bytes at `remote` in peer's memory into dst, for receive number
   * `seq`; TCC_OK, or an error naming the peer and the cause. */
  bool (*p2p_direct)(tcc_comm_t *comm, int peer, size_t bytes, bool to_peer);
  tcc_result_t (*p2p_peer_read)(tcc_comm_t *comm, int peer, void *dst, uint64_t remote, size_t len, uint64_t seq,
                                tcc_err_t *err);
  /* Optional: the CPU `peer` last ran on, as it published it (-1: not
   * known), for waits that spin on while it runs elsewhere
   * (core/cpu_share.h; used when comm->cpu_share says so). */
  int (*peer_cpu)(tcc_comm_t *comm, int peer);
  /* Releases transport state (threads are already stopped). */
  void (*destroy)(tcc_comm_t *comm);
  /* Optional: the communicator just failed (comm->aborted is set); let
   * anything waiting inside the transport see it. `announce`: tell the
   * peers too, so that a rank waiting on this one fails now instead of at
   * its timeout (false when the owner destroys the communicator: the
   * teardown itself tells them). */
  void (*failed)(tcc_comm_t *comm, bool announce);
} tcc_transport_ops_t;

/* ---- groups that span hosts ------------------------------------------- */

/* TCCOMM_HIER_OVERLAP, carried in each rank's endpoint blob: whether the
 * leaders' allreduce of a group on uneven hosts (coll_hier_leaders.c)
 * runs in segments whose cross-host part overlaps the host phases. That
 * pays where the link is the limit (3 + 2 simulated hosts: 0-4% faster at
 * 1 Gbit/s; at 2.5 Gbit/s 64 MiB took 248-251 ms against 279) and costs
 * where the CPUs are (10-20% slower at 10 Gbit/s with 5 ranks on 2 cores:
 * the leader's thread takes the CPU from the host phases). A machine whose
 * CPUs outnumber its ranks and their leaders' threads has the CPU to
 * spare, so `auto` overlaps only where every machine of the group (ranks
 * with one boot id) has. */
typedef enum tcc__hier_overlap {
  TCC_HIER_OVERLAP_AUTO = 0,
  TCC_HIER_OVERLAP_OFF = 1,
  TCC_HIER_OVERLAP_ON = 2,
} tcc__hier_overlap_t;

/* This process's TCCOMM_HIER_OVERLAP (auto, 0, 1); an error names a value
 * that is none of those. */
tcc_result_t tcc__hier_overlap_from_env(uint8_t *out, tcc_err_t *err);

/* Where the ranks of a group are, for a group whose ranks share memory
 * with some ranks but not all (transport/hybrid/). Hosts are numbered in
 * the order of their lowest rank; a rank's local index is its position
 * among its host's ranks in rank order. Identical on every rank: it is
 * derived from the same endpoint blobs. */
typedef struct tcc__topology {
  int nhosts;
  int host;          /* this rank's host */
  int *host_of;      /* [size] */
  int *local_index;  /* [size] */
  int *host_size;    /* [nhosts] ranks on each host */
  /* The ranks of host h, in local index order: by_host[host_start[h] + i]
   * for i < host_size[h]. */
  int *by_host;      /* [size] */
  int *host_start;   /* [nhosts] */
  bool uniform;      /* every host has the same number of ranks */
  /* Whether the leaders' allreduce on uneven hosts overlaps its segments'
   * cross-host part (on a thread of each leader) with the host phases:
   * TCCOMM_HIER_OVERLAP of rank 0, or, by default, where every machine
   * has a CPU for each of its ranks and each leader's thread (above). */
  bool leaders_overlap;
  /* Views (core/view.c) that the hierarchical algorithms run phases on:
   * the ranks of this host over shared memory (NULL when this rank is
   * alone on its host), and the ranks of every host that share this
   * rank's local index, in host order, over the group's streams (NULL when
   * no other host has one). The cross view of the ranks of local index 0
   * is the leaders'. */
  tcc_comm_t *local;
  tcc_comm_t *cross;
  /* Point-to-point with the ranks of this host (transport/hybrid/). */
  struct tcc__hybrid_p2p *p2p;
} tcc__topology_t;

/* Each transport's setup. `blobs` as in tcc_comm_create; on success sets
 * comm->ops and comm->transport_state. Bounded by comm->timeout_ms. */
/* Sets up `transport` (tcc__comm_choose_transport's choice) for comm and
 * closes ep. The one place that knows every transport. */
tcc_result_t tcc__transport_setup(tcc_comm_t *comm, tcc_transport_t transport, tcc_endpoint_t *ep,
                                  const tcc_blob_t *blobs, tcc_err_t *err);
tcc_result_t tcc__shm_setup(tcc_comm_t *comm, const tcc_blob_t *blobs, tcc_err_t *err);
/* Shared memory within each host, TCP between hosts (transport/hybrid/). */
tcc_result_t tcc__hybrid_setup(tcc_comm_t *comm, tcc_endpoint_t *ep, const tcc_blob_t *blobs, tcc_err_t *err);
/* How many CPUs the ranks whose blobs carry `boot_id` (NULL: all n) may
 * use between them (core/cpu_share.h's tcc__cpus_between; 0: unknown). */
int tcc__blobs_cpus(const tcc_blob_t *blobs, int n, const char *boot_id);
/* Whether two ranks can map each other's shared memory (select.c). */
bool tcc__blobs_share_shm(const tcc_blob_t *a, const tcc_blob_t *b);
tcc_result_t tcc__tcp_setup(tcc_comm_t *comm, tcc_endpoint_t *ep, const tcc_blob_t *blobs,
                           tcc_err_t *err);

#endif /* TCC_TRANSPORT_TRANSPORT_H */
