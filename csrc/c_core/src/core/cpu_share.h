/*
 * cpu_share.h - waiting well when ranks of a group share CPUs with each
 * other or with other processes (another job, a data loader, `yes`).
 *
 * A rank waiting for a peer has three choices, and which one is right
 * depends on where the peer is:
 *   - the peer runs on another CPU: spin. A yield would hand this CPU to
 *     whatever else is queued on it (another process), for a whole time
 *     slice, and a sleep costs a wake-up of tens of microseconds;
 *   - the peer is queued on this CPU: yield, so that it runs now;
 *   - the peer is away for long: sleep (idle_wait.h's last phase).
 * Each rank publishes the CPU it runs on at every stage barrier
 * (tcc__cpu_now), so a waiter knows which case it is in. This holds only
 * while the group has no more ranks on this host than its ranks may use
 * CPUs between them (every rank's endpoint carries its CPU set, so ranks
 * a launcher binds to a CPU each count as one CPU each, not one in all):
 * beyond that, the process queued on this CPU is most likely another rank
 * of the group, and spinning would keep it from the op (the waiter then
 * yields at once, as before).
 *
 * Two ranks that share one CPU while another process has a CPU to itself
 * only ever run one at a time: every op then costs two context switches,
 * and the scheduler has no reason to separate them (either placement
 * leaves the load balanced). So, with no more ranks than CPUs again, a
 * rank that keeps finding the peer it waits for on its own CPU moves itself to another of its allowed CPUs
 * (tcc__cpu_share_after_wait): its affinity excludes this CPU for a moment and
 * is then restored exactly, so the scheduler is free to place it again.
 * Of two ranks that find each other on one CPU only the higher one moves:
 * when both did, their moves crossed, and they met again on the other CPU
 * for the 5 ms until the next move (2 ranks, 32 MiB all_reduce: about one
 * call in 40 took twice its time, the two ranks taking turns on one CPU
 * while the other idled). TCCOMM_CPU_MOVE=0 turns moving off.
 */
#ifndef TCC_CORE_CPU_SHARE_H
#define TCC_CORE_CPU_SHARE_H

#include "core/base.h"

/* How long a waiter spins while the ranks it waits for run on other CPUs,
 * before it yields and sleeps: longer than the work above the core between
 * two ops of a rank (a few microseconds, ten times that under load), far
 * shorter than a time slice. */
#define TCC_CPU_AWAY_SPIN_NS (200 * 1000LL)

/* The CPU this thread runs on now (-1: unknown). Cheap (rseq). */
int tcc__cpu_now(void);

/* How a group's waits treat shared CPUs; set when its transport is set
 * up, read-only after. Zero (as for TCP): waiters yield, nobody moves. */
typedef struct tcc__cpu_share {
  bool spin_while_away; /* no more ranks on this host than CPUs they may use */
  bool may_move;        /* that, and moving is not turned off */
  /* Busy polls before a wait first yields: TCC_SPINS_OWN_CPU with
   * spin_while_away, else TCC_SPINS_SHARED (zero until the transport is
   * set up). */
  int spins;
} tcc__cpu_share_t;

/* A peer running on another CPU answers within a few hundred polls; when
 * there are more ranks than CPUs the awaited one is most likely queued
 * behind the waiter, and every poll delays it (2 ranks pinned to one CPU,
 * 8 B dist.all_reduce: 30-36 us per call with 300 polls, 22-27 with 16). */
#define TCC_SPINS_OWN_CPU 300
#define TCC_SPINS_SHARED 16

/* Decides for a group with `local_ranks` ranks on this host, which may use
 * `cpus` CPUs between them (0: unknown; ranks bound to a CPU each have as
 * many as there are ranks, though each may use only one); `why` gets a
 * line for the log. Moving needs two CPUs of this thread's own. */
void tcc__cpu_share_init(tcc__cpu_share_t *s, int local_ranks, int cpus, char *why, size_t why_len);

/* Waits that must find the awaited rank on this CPU, within 10 ms, before
 * a move: one unlucky wait is no pattern, but many are slow. Two ranks
 * taking turns on one CPU wait once per phase of an op, and a 32 MiB
 * all_reduce's phases take about 0.2 ms each: 16 waits let them share the
 * CPU for 7 ms of a 7 ms call, 4 for under 2 ms (bench/README, "Steadiness
 * of large all_reduces"). */
#define TCC_SHARED_WAITS_TO_MOVE 4

/* After a wait of this thread for a rank of a group with these settings:
 * `shared` when the rank, a lower one than this thread's, was on this
 * thread's CPU (a higher one moves itself). Moves the thread to
 * another allowed CPU when that keeps happening (counted per thread,
 * whichever groups it waits in). */
void tcc__cpu_share_after_wait(const tcc__cpu_share_t *s, bool shared);

/* Spinning for peers whose CPU cannot be seen (TCP streams): a wait may
 * poll without sleeping for its first TCC_CPU_AWAY_SPIN_NS while the
 * ranks sharing this machine have a CPU each. A spin that saw nothing, or
 * (where the caller asks) a thread preempted since its last wait (CPUs
 * shared with other processes, where the spinning rank is the one the
 * scheduler makes wait), shows that spinning does not pay now: the next
 * TCC_SPIN_BACKOFF_WAITS waits sleep at once. One gate per waiting
 * thread and kind of wait; it is not thread-safe. */
#define TCC_SPIN_BACKOFF_WAITS 64

typedef struct tcc__spin_gate {
  int backoff; /* waits left that sleep at once */
} tcc__spin_gate_t;

/* At the start of a wait: whether it may spin. `preemption_shuts`: a
 * preempted thread shuts the gate too. Collectives need that (8 B
 * allreduce over TCP with a core busy: 392-432 us without it, 51-57 with
 * it); point-to-point waits do better without, since the p2p thread's
 * periodic look preempts a rank too (8 B round trip quiet: 25-32 us
 * without, 37-62 with; with a core busy 47-48 and 41-45). */
bool tcc__spin_gate_open(tcc__spin_gate_t *g, const tcc__cpu_share_t *s, bool preemption_shuts);

/* A spin ran its time out without seeing progress. */
void tcc__spin_gate_missed(tcc__spin_gate_t *g);

/* How many CPUs this thread may use (its affinity; 0: unknown). */
int tcc__cpus_allowed(void);

/* The same count; sets bit c of mask (bits / 64 words) for each allowed
 * CPU c below `bits`. */
int tcc__cpu_mask(uint64_t *mask, int bits);

/* How many CPUs n ranks may use between them, from each one's mask and
 * count as tcc__cpu_mask gave them: the union of the masks when every
 * mask holds its rank's whole set, else (CPUs beyond the masks) the
 * fewest any of them may use; 0 when a count is unknown. */
int tcc__cpus_between(const uint64_t *const *masks, const uint16_t *counts, int n, int bits);

/* Moves this thread made, and the CPUs of the last one (for tests). */
int tcc__cpu_moves(int *from, int *to);

#endif /* TCC_CORE_CPU_SHARE_H */
