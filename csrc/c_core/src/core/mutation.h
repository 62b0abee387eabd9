/*
 * mutation.h - deliberate bugs for checking that the tests can fail.
 *
 * Only a build with -DTCC_MUTATIONS has them (scripts/mutation_check.sh,
 * make -C csrc/c_core mutant); everywhere else TCC_MUTANT(x) is the
 * constant 0 and every site compiles away. In a mutant build the
 * environment variable TCCOMM_MUTATION names the one bug that is on (none
 * when unset); an unknown name aborts, so a typo cannot pass for a mutant
 * that no test catches.
 *
 * Each site is one line marked "MUTATION SITE" next to the code it breaks.
 */
#ifndef TCC_MUTATION_H
#define TCC_MUTATION_H

#ifdef TCC_MUTATIONS

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* X(enum suffix, name in TCCOMM_MUTATION): what goes wrong. */
#define TCC_MUTATION_LIST(X)                                                              \
  X(AVG_DIVISOR, "avg_divisor")                 /* AVG divides the sum by 1, not n */    \
  X(ALLGATHER_CORRUPT_BYTE, "allgather_corrupt_byte") /* one bit of a peer's block */   \
  X(BARRIER_SKIP_PEER, "barrier_skip_peer")     /* shm barrier: last rank not awaited */ \
  X(BROADCAST_WRONG_ROOT, "broadcast_wrong_root") /* data comes from root + 1 */        \
  X(REDUCE_SCATTER_SWAP, "reduce_scatter_swap") /* chunks 0 and 1 trade places */       \
  X(P2P_TAG_IGNORED, "p2p_tag_ignored")         /* a peer's first message matches */     \
  X(P2P_DONE_EARLY, "p2p_done_early")           /* a send by reference completes unread */ \
  X(DEAD_PEER_UNREPORTED, "dead_peer_unreported") /* shm liveness: always alive */      \
  X(MISMATCH_UNCHECKED, "mismatch_unchecked")   /* ranks' descriptors never compared */ \
  X(UNREAD_FRAMES_UNCHECKED, "unread_frames_unchecked") /* TCP: a frame no op waited for is never checked */

enum tcc_mutation {
  TCC_MUT_NONE = 0,
#define TCC_MUT_ENUM(id, name) TCC_MUT_##id,
  TCC_MUTATION_LIST(TCC_MUT_ENUM)
#undef TCC_MUT_ENUM
};

/* The mutation TCCOMM_MUTATION selects, read once per translation unit. */
static inline int tcc_mutation_selected(void) {
  static atomic_int cached = -1;
  int m = atomic_load_explicit(&cached, memory_order_relaxed);
  if (m >= 0) return m;
  const char *want = getenv("TCCOMM_MUTATION");
  m = TCC_MUT_NONE;
  if (want && *want) {
    m = -1;
#define TCC_MUT_MATCH(id, name) if (strcmp(want, name) == 0) m = TCC_MUT_##id;
    TCC_MUTATION_LIST(TCC_MUT_MATCH)
#undef TCC_MUT_MATCH
    if (m < 0) {
      fprintf(stderr, "tccomm: unknown TCCOMM_MUTATION '%s'\n", want);
      abort();
    }
  }
  atomic_store_explicit(&cached, m, memory_order_relaxed);
  return m;
}

#define TCC_MUTANT(id) (tcc_mutation_selected() == TCC_MUT_##id)

#else

#define TCC_MUTANT(id) 0

#endif /* TCC_MUTATIONS */

#endif /* TCC_MUTATION_H */
