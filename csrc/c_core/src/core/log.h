/*
 * log.h - debug logging, off unless TCCOMM_DEBUG asks for it.
 *
 *   TCCOMM_DEBUG=VERSION|WARN|INFO|TRACE   (any case; unset: off)
 *   TCCOMM_DEBUG_FILE=/path/log.%h.%p      (%h host name, %p pid; default stderr)
 *
 * Both are read once per process, by tcc__log_setup (the first endpoint or
 * communicator). Until then, and whenever the level is below a site's, a
 * log site costs one relaxed load and a branch: the arguments are not even
 * evaluated. Each line goes out in one write(2):
 *   <host>:<pid>:<tid> [<rank>] TCCOMM <LEVEL> <message>
 * Never log from signal or fork handlers: formatting is not async-signal-safe.
 */
#ifndef TCC_CORE_LOG_H
#define TCC_CORE_LOG_H

#include <stdatomic.h>

typedef enum tcc__log_level {
  TCC__LOG_OFF = 0,
  TCC__LOG_VERSION, /* the tccomm version, once */
  TCC__LOG_WARN,    /* failures: timeouts, dead peers, aborts, failed creation */
  TCC__LOG_INFO,    /* communicators: creation (transport and why, thresholds), destroy */
  TCC__LOG_TRACE    /* every op as issued, with the algorithm chosen for it */
} tcc__log_level_t;

/* The level in force; written once by tcc__log_setup. Atomic so threads
 * that never passed through the setup read it without a data race. */
extern atomic_int tcc__log_level;

/* Reads TCCOMM_DEBUG and TCCOMM_DEBUG_FILE the first time it is called in
 * this process; later calls return at once. */
void tcc__log_setup(void);

/* Formats and writes one line. rank < 0 prints '-'. Call it through the
 * macros below, which skip it (and the formatting) when the level is off. */
void tcc__log_write(tcc__log_level_t level, int rank, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#define TCC__LOG_ON(level) (atomic_load_explicit(&tcc__log_level, memory_order_relaxed) >= (level))

#define TCC__LOG_AT(level, rank, ...)                                   \
  do {                                                                  \
    if (__builtin_expect(TCC__LOG_ON(level), 0)) tcc__log_write((level), (rank), __VA_ARGS__); \
  } while (0)

#define TCC_LOG_WARN(rank, ...) TCC__LOG_AT(TCC__LOG_WARN, rank, __VA_ARGS__)
#define TCC_LOG_INFO(rank, ...) TCC__LOG_AT(TCC__LOG_INFO, rank, __VA_ARGS__)
#define TCC_LOG_TRACE(rank, ...) TCC__LOG_AT(TCC__LOG_TRACE, rank, __VA_ARGS__)

#endif /* TCC_CORE_LOG_H */
