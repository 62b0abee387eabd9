/*
 * forksafe.c - descriptors a forked child must not keep.
 *
 * A process that forks without exec (a DataLoader worker) would otherwise
 * hold copies of every socket and shared-memory descriptor of its parent's
 * communicators: when the parent dies, its peers would not see the
 * connections close (nor its liveness lock released) until the children
 * exit too, and would wait for their timeout instead of failing at once.
 * O_CLOEXEC covers exec only; Linux has no close-on-fork flag, so the
 * child closes the registered descriptors in a pthread_atfork handler.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"

static pthread_mutex_t fds_lock = PTHREAD_MUTEX_INITIALIZER;
static int *fds;
static size_t nfds, cap;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* The prepare handler takes the lock so the child never inherits it held
 * by a thread that does not exist there. */
static void before_fork(void) { pthread_mutex_lock(&fds_lock); }
static void in_parent(void) { pthread_mutex_unlock(&fds_lock); }

static void in_child(void) {
  for (size_t i = 0; i < nfds; i++) close(fds[i]);
  nfds = 0;
  pthread_mutex_unlock(&fds_lock);
}

static void install(void) { pthread_atfork(before_fork, in_parent, in_child); }

void tcc__fd_close_on_fork(int fd) {
  if (fd < 0) return;
  pthread_once(&once, install);
  pthread_mutex_lock(&fds_lock);
  if (nfds == cap) {
    size_t ncap = cap ? 2 * cap : 64;
    int *grown = realloc(fds, ncap * sizeof *grown);
    if (!grown) { /* the descriptor then stays inherited: no worse than before */
      pthread_mutex_unlock(&fds_lock);
      return;
    }
    fds = grown;
    cap = ncap;
  }
  fds[nfds++] = fd;
  pthread_mutex_unlock(&fds_lock);
}

void tcc__fd_close(int fd) {
  if (fd < 0) return;
  pthread_mutex_lock(&fds_lock);
  for (size_t i = 0; i < nfds; i++) {
    if (fds[i] == fd) {
      fds[i] = fds[--nfds];
      break;
    }
  }
  /* Closed under the lock: the number must not be reused and registered by
   * another thread before it leaves the list. */
  close(fd);
  pthread_mutex_unlock(&fds_lock);
}
