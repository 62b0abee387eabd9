/*
 * host.h - the host executor: runs a communicator's ops on host memory
 * through its transport (the "engine").
 *
 * host_executor.c  the executor table, lifecycle, submit and waiting
 * coll_queue.c     the collective queue and whoever runs it
 * p2p_match.c      the point-to-point thread: matching, rounds, expiry
 * p2p_now.c        blocking sends and receives run in the calling thread
 * p2p_direct.c     messages by reference, read once from the sender's memory
 * p2p_frame.c      the frame header of a point-to-point message
 *
 * Collectives: a FIFO queue executed strictly in issue order by whoever
 * holds the runner claim: the collective thread, or a thread blocked in
 * tcc_op_wait() on a queued op. Letting the waiter run its own op saves two
 * thread hand-offs per synchronous collective, which dominates small-message
 * latency when ranks outnumber cores.
 *
 * The queue is a ring of op pointers indexed by sequence number: submit
 * numbers an op and stores it in its slot under the engine lock (ops of
 * several threads are numbered in the order they are queued); the runner
 * takes the slot of the next number without it, and the claim is one
 * compare-and-swap, so a synchronous collective takes the lock once
 * (at submit), not three times. More ops in flight than the ring holds go
 * to an overflow list under the lock, and every op after them too until
 * the runner has emptied it, so the ring never holds an op out of turn.
 *
 * A blocking call (an entry point given no op handle) skips all of it when
 * nothing is queued and nobody runs the queue: it claims the runner, takes
 * the next number only if no op has it (the compare-and-swap that makes
 * submit number with an atomic increment) and runs the collective in the
 * calling thread, with no op (tcc__host_coll_run_now).
 *
 * For the same reason submitting does not wake the collective thread while
 * the communicator is busy: waking a third thread per op on a machine whose
 * cores are busy spinning in barriers costs more than the op (2 ranks on 2
 * cores: 4.4 us per small allreduce without the wake, 7-22 us with it).
 * Instead, tcc_op_start() wakes it for ops handed to futures or polls,
 * and for COLL_POLL_WINDOW_NS after the last submit it polls the queue
 * every COLL_POLL_NS, so any other op nobody waits on (fire-and-forget)
 * still starts within that interval; after a quiet spell it sleeps until
 * a submit wakes it.
 *
 * Point-to-point: rounds of framing messages (header + payload) on the
 * transport's per-peer byte streams and matching them to posted receives
 * by (peer, tag, order); unmatched arrivals are buffered. Whoever holds
 * p2p_progress runs a round. The caller runs them first: submitting runs
 * one round at once (a small send then usually completes before
 * tcc_send() returns, and a receive whose message is there before
 * tcc_recv() does), and a thread blocked in tcc_op_wait() or polling with
 * tcc_op_test() on a p2p op runs them until its op is done. The p2p thread
 * runs the rest, independently of collectives so a pending send never
 * blocks the queue: ops nobody has run rounds for within P2P_POLL_NS,
 * ops of more than P2P_EAGER_BYTES whose bytes cross the stream (not
 * those sent by reference), and ops passed to tcc_op_start(). As
 * for collectives, submitting does not wake it otherwise: a wake per
 * message costs more than the message (8 B round trip at 2 ranks over
 * shared memory: about 8 us with it, 2 us without). It polls every
 * P2P_POLL_NS for P2P_POLL_WINDOW_NS after the last submit, waiters
 * running rounds or not, then sleeps until a submit wakes it. (Sleeping
 * until signalled whenever a waiter ran made the next submit wake it: a
 * wake-up per message again, each preempting a rank: some 30,000
 * wake-ups in one run of the 8 B round-trip bench over TCP, about 2,300,
 * one per millisecond, once it polled.)
 */
#ifndef TCC_HOST_HOST_H
#define TCC_HOST_HOST_H

#include "core/executor.h"
#include "host/p2p_frame.h"
#include "transport/transport.h"

/* Above this, a p2p op that did not complete in its submitter's round
 * wakes the p2p thread at once: it streams, and the wake costs little
 * next to it. */
#define P2P_EAGER_BYTES (64u << 10)

/* A message up to this size goes out with its header in one gathered
 * write: one system call over TCP, one update of the ring's head over
 * shared memory (one line crossing to the reader). bench_mpi_pair
 * pingpong over TCP, round trip: 2 KiB 14.0-17.3 -> 10.4-10.7 us, 8 KiB
 * 16.7-19.6 -> 13.7-14.7, 64 KiB 44-45 -> 34-36. Larger payloads still go
 * apart from their header, which kept 128 KiB and 256 KiB at 66-89 and
 * 115-144 us where gathering measured 83-102 and 140-145. */
#define P2P_GATHER_BYTES (64u << 10)

/* Collectives in flight that the queue's ring holds (more go to its
 * overflow list). */
#define TCC_COLL_RING 64

typedef struct unexpected_msg {
  uint64_t tag;
  uint64_t arrival; /* order of arrival over all peers (any-source matching) */
  size_t bytes;
  void *data;
  struct unexpected_msg *next;
} unexpected_msg_t;

/* Per-peer state, touched only by the p2p thread. */
typedef struct peer_state {
  tcc_op_t *send_head, *send_tail; /* sends in issue order */
  tcc_op_t *recv_head, *recv_tail; /* posted, unmatched receives */
  unexpected_msg_t *unexp_head, *unexp_tail;
  /* incoming message being read */
  tcc_p2p_frame_t in_hdr;
  size_t in_hdr_got;
  int in_payload;          /* 1 while reading a payload */
  char *in_dst;            /* where the payload goes (NULL: discard) */
  size_t in_remaining;
  size_t in_discard;       /* bytes still to drop (size mismatch) */
  tcc_op_t *in_op;         /* receive being filled, or NULL */
  /* Bytes read from the stream ahead of the frame being parsed (p2p_match.c:
   * a small message's header and payload come in one read). A blocking
   * receive takes a message that fits here straight from it (p2p_now.c):
   * at 256 bytes, a 512 B ping-pong over shared memory took 1.34-1.43 us
   * a round trip, at 1 KiB 1.07-1.11 (Open MPI 1.09-1.18). */
  char ahead[1024];
  size_t ahead_off, ahead_len;
  unexpected_msg_t *in_unexp; /* buffer being filled, or NULL */
  bool in_ref;                /* the payload being read is in_ref_body (a reference frame's) */
  tcc_p2p_ref_t in_ref_body;
  /* Single-copy messages (p2p_direct.c): sends whose reference frame went
   * out, waiting for the peer's done frame; the done frames owed to the
   * peer (tokens dones[dones_first..dones_len), the first done_sent bytes
   * of the first one written). */
  tcc_op_t *await_head, *await_tail;
  uint64_t *dones;
  size_t dones_first, dones_len, dones_cap, done_sent;
  uint64_t ref_bytes_sent; /* bytes of the messages sent by reference (what tests see of the path) */
  tcc_result_t broken;        /* TCC_OK while the stream to this peer works */
  char broken_msg[TCC_ERRLEN];
} peer_state_t;

struct tcc_engine {
  pthread_mutex_t lock;
  pthread_cond_t coll_cv;
  pthread_cond_t p2p_cv;
  /* The collective queue (coll_queue.c): op number n sits in
   * coll_ring[n % TCC_COLL_RING] (stored under lock, taken by the runner
   * without it) or, past the ring's room, on the overflow list (under
   * lock, coll_overflowed set while it is not empty). */
  _Atomic(tcc_op_t *) coll_ring[TCC_COLL_RING];
  atomic_ullong coll_next; /* number of the next op to run; written by the runner */
  tcc_op_t *coll_over_head, *coll_over_tail;
  atomic_bool coll_overflowed;
  tcc_op_t *p2p_new_head, *p2p_new_tail;
  /* Set under lock with every op put on p2p_new and when stopping begins:
   * a round takes the lock to look at either only when it is set, so a
   * polling waiter's empty rounds take no lock. */
  atomic_bool p2p_news;
  int stopping;
  int p2p_idle;       /* p2p thread sleeping on p2p_cv */
  int p2p_deep_sleep; /* ... until signalled (no timeout) */
  int64_t p2p_last_submit_ns; /* under lock (tcc__coarse_now_ns) */
  /* When a caller last ran p2p rounds (tcc__now_ns); 0 after tcc_op_start.
   * The p2p thread leaves pending ops to callers until P2P_POLL_NS after it. */
  _Atomic int64_t p2p_attended_ns;
  atomic_int runner; /* who holds the runner claim: RUNNER_FREE, _THREAD or _WAITER */
  /* Set when destroy begins: waiters no longer claim the runner, and stop
   * waits for one that holds it to leave (waiter_cv). */
  atomic_bool waiters_refused;
  pthread_cond_t waiter_cv;
  /* Held by whoever runs p2p rounds (the p2p thread, or a waiter; see the
   * file comment); the peer state and the posted/any-source queues below
   * are touched only by its holder. */
  pthread_mutex_t p2p_progress;
  int p2p_waiter_runs; /* a waiter holds p2p_progress; stop waits until it is out */
  bool *waiter_want_write; /* the waiter's per-peer write interest (under p2p_progress) */
  tcc__spin_gate_t waiter_spin_gate; /* whether a waiter spins where peers' CPUs are unknown (under p2p_progress) */
  int coll_deep_sleep;      /* the collective thread sleeps until signalled */
  int64_t last_submit_ns;   /* last collective submitted (tcc__coarse_now_ns) */
  pthread_t coll_thread, p2p_thread;
  int coll_started, p2p_started;
  peer_state_t *peers;
  /* Posted receives from any source, in posting order (p2p thread only).
   * A p2p op's `seq` is its posting number, so a message goes to the
   * earliest-posted receive it matches, specific or any-source. */
  tcc_op_t *any_head, *any_tail;
  uint64_t posted, arrived;
  /* No p2p op held by the rounds expires before this (under p2p_progress):
   * a round walks the queues for expired ops only once it passed. */
  int64_t p2p_next_expiry_ns;
  atomic_int p2p_pending; /* ops owned by the p2p thread (it decrements without the lock) */
};

typedef struct tcc_engine tcc_engine_t;

enum { RUNNER_FREE, RUNNER_THREAD, RUNNER_WAITER };

/* ---- coll_queue.c ---- */
/* Queues a numbered collective (caller holds the engine lock). */
void tcc__host_coll_push_locked(tcc_engine_t *e, tcc_op_t *op);
/* The collective thread's main loop (arg: the communicator). */
void *tcc__host_coll_thread(void *arg);
/* A waiter claims the right to run the collective queue (see the file
 * comment); 0 when another thread runs it or destroy has begun. With the
 * claim, *first is the queue's first op, taken off it (NULL when the queue
 * is empty or `until` has finished). */
int tcc__host_claim_runner(tcc_engine_t *e, tcc_op_t *until, tcc_op_t **first);
/* Runs `first` (or NULL), then queued collectives in order until the queue
 * is empty or `until` finished; the caller holds the runner claim. */
void tcc__host_run_queue(tcc_comm_t *comm, tcc_op_t *until, tcc_op_t *first);
/* Gives the claim back (a waiter's: see coll_queue.c). */
void tcc__host_release_runner(tcc_engine_t *e);
/* Runs c in the calling thread when nothing is queued and nobody runs the
 * queue (the executor's run_now, core/executor.h). */
bool tcc__host_coll_run_now(tcc_comm_t *comm, tcc_coll_t *c, int64_t timeout_ms, tcc_result_t *result,
                            tcc_err_t *err);
/* Whether a collective waits in the queue (exact for the claim's holder,
 * a hint for anyone else). */
bool tcc__host_coll_queued(tcc_engine_t *e);

/* ---- p2p_match.c ---- */
/* The point-to-point thread's main loop (arg: the communicator). */
void *tcc__host_p2p_thread(void *arg);
/* Runs p2p rounds on the calling thread until `op` finished or
 * deadline_ns (tcc__now_ns clock) passed (the p2p thread meanwhile waits
 * for p2p_progress); returns at once when another thread keeps running
 * them (the op completes there). */
void tcc__host_drive_p2p(tcc_comm_t *comm, tcc_op_t *op, int64_t deadline_ns);
/* Runs one p2p round on the calling thread if no other thread runs them;
 * returns whether `op` has finished. */
bool tcc__host_p2p_round_now(tcc_comm_t *comm, tcc_op_t *op);
/* The round of a submitter that took p2p_progress (and releases it):
 * `op` first when `adopt` (it was not put on p2p_new), then the ops on
 * p2p_new. Returns whether `op` has finished; *answer_due, whether it is
 * a send that only waits for its peer's answer (p2p_direct.c). */
bool tcc__host_p2p_submitter_round(tcc_comm_t *comm, tcc_op_t *op, bool adopt, bool *answer_due);
/* Makes the p2p thread take the pending ops (tcc_op_start, large ops). */
void tcc__host_p2p_kick(tcc_comm_t *comm);
/* Wakes the p2p thread to look at new ops: signals it when it sleeps on
 * p2p_cv untimed (or `always`), notifies the transport when it runs rounds. */
void tcc__host_p2p_wake(tcc_engine_t *e, tcc_comm_t *comm, bool always);
/* Frees messages that arrived for receives never posted (and the done
 * frames owed). */
void tcc__host_free_unexpected(tcc_engine_t *e, int size);

/* ---- p2p_direct.c ---- */
/* Whether a send's frame is a reference (decided when its frame starts). */
bool tcc__host_p2p_goes_by_ref(tcc_comm_t *comm, const tcc_op_t *op);
/* Whether a receive's message, of the size it expects, comes by reference
 * (its sender asks the same of the transport); false for any source. */
bool tcc__host_p2p_comes_by_ref(tcc_comm_t *comm, const tcc_op_t *op);
/* The frame of a send (data: its header; reference: header and
 * reference) into *f and *ref; the bytes of the frame on the stream. */
size_t tcc__host_p2p_send_frame(const tcc_op_t *op, tcc_p2p_frame_t *f, tcc_p2p_ref_t *ref);
/* A send whose reference frame went out waits for the peer's done frame. */
void tcc__host_p2p_await_done(peer_state_t *ps, tcc_op_t *op);
/* Whether a send only waits for its peer's answer: its reference frame
 * went out whole. The caller holds p2p_progress. */
bool tcc__host_p2p_awaits_answer(const tcc_op_t *op);
/* The send a done frame for `token` answers, unlinked; NULL (and *err)
 * when no send awaits one. */
tcc_op_t *tcc__host_p2p_done_arrived(tcc_comm_t *comm, int peer, peer_state_t *ps, uint64_t token, tcc_err_t *err);
/* Reads a message of `bytes` that came by reference into dst (room for
 * dst_bytes; `seq` names the receive) and owes the sender its done frame,
 * whatever the outcome: the sender's buffer is free once the receiver has
 * done with it. TCC_OK, or why the receive fails (`cause`). */
tcc_result_t tcc__host_p2p_read_ref(tcc_comm_t *comm, int peer, peer_state_t *ps, void *dst, size_t dst_bytes,
                                    size_t bytes, const tcc_p2p_ref_t *ref, uint64_t seq, char *cause,
                                    size_t cause_len);
/* Writes the done frames owed to a peer, when no other frame is part
 * written. Bytes moved, or -1 when its stream failed (*err). */
ssize_t tcc__host_p2p_send_dones(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err);
/* Frees the done frames still owed. */
void tcc__host_p2p_free_dones(peer_state_t *ps);

/* The parts of the rounds that p2p_now.c runs too; the caller holds
 * p2p_progress. */
/* Why a send or receive failed, naming the op, the group, both ranks and the tag. */
void tcc__host_p2p_describe_failure(char *msg, size_t len, const tcc_comm_t *comm, tcc_op_kind_t kind, int peer_rank,
                                    uint64_t tag, const char *cause);
/* Hands newly submitted p2p ops (a list) to their peers' queues, or to
 * what arrived for them. */
void tcc__host_p2p_adopt(tcc_comm_t *comm, tcc_op_t *list);
/* Moves the bytes of one peer's queued sends, or reads what it sent.
 * Bytes moved, or -1 when its stream failed (*err). */
ssize_t tcc__host_p2p_progress_send(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err);
ssize_t tcc__host_p2p_progress_recv(tcc_comm_t *comm, int peer, peer_state_t *ps, tcc_err_t *err);
/* The stream to one peer failed: fails its ops (and any-source receives
 * once no stream is left). */
void tcc__host_p2p_break_peer(tcc_comm_t *comm, peer_state_t *ps, const tcc_err_t *err);
/* One round over every peer. */
void tcc__host_p2p_round(tcc_comm_t *comm);
/* Ends a caller's round: releases p2p_progress; whether `op` finished. */
bool tcc__host_p2p_end_caller_round(tcc_engine_t *e, tcc_op_t *op);
/* tcc__host_drive_p2p once p2p_progress is held (released there). */
void tcc__host_p2p_drive_held(tcc_comm_t *comm, tcc_op_t *op, int64_t deadline_ns);

/* ---- p2p_now.c ---- */
/* A send or receive whose caller waits for it at once (the executor's
 * p2p_now): taken when nothing waits on p2p_new and no other thread runs
 * rounds; then its own stream moved in this thread with p2p_progress
 * held from the look to the end, and rounds run until it finished. */
bool tcc__host_p2p_now(tcc_comm_t *comm, tcc_op_t *op);
/* The same with no op (the executor's p2p_move_now): a send written
 * whole when no send to its peer waits before it and the stream takes it
 * all now; a receive taken when its message lies whole at the front of
 * its peer's stream, within a while of spinning, and nothing before it
 * could take that message. */
bool tcc__host_p2p_move_now(tcc_comm_t *comm, tcc_op_kind_t kind, void *buf, size_t bytes, int peer, uint64_t tag,
                            tcc_result_t *result, tcc_err_t *err);

#endif /* TCC_HOST_HOST_H */
