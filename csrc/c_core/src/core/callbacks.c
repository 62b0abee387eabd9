/*
 * callbacks.c - the detached-callback pool (tcc_run_detached).
 *
 * Code handed here may block on anything, including other ops of the
 * communicator whose completion scheduled it: a DDP communication hook's
 * continuation waits for the next all_reduce, a continuation of an irecv
 * sends. Such code must never run on a thread that progresses ops (the
 * collective runner, the p2p thread), or the op it waits for can never run.
 *
 * The pool grows instead of queueing behind a blocked task: a task that
 * finds no idle thread gets a new one (up to MAX_THREADS), so a chain of
 * continuations that each wait for the next one's completion always makes
 * progress. Threads beyond the first exit after IDLE_EXIT_NS without work.
 *
 * After fork() the child starts with an empty pool: the parent's queued
 * tasks and threads are not the child's.
 */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "core/internal.h"

#define MAX_THREADS 256
#define IDLE_EXIT_NS (5 * 1000000000LL)

typedef struct task {
  void (*fn)(void *);
  void *arg;
  struct task *next;
} task_t;

static struct {
  pthread_mutex_t lock;
  pthread_cond_t cv;
  task_t *head, *tail;
  int queued;   /* tasks in the queue */
  int idle;     /* threads waiting for a task */
  int threads;  /* threads alive */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void init_cv(void) { tcc__cond_init_monotonic(&pool.cv); /* timed waits on the tcc__now_ns clock */ }

static void reset_in_child(void) {
  pthread_mutex_init(&pool.lock, NULL);
  init_cv();
  pool.head = pool.tail = NULL; /* the parent's tasks: leaked, never run */
  pool.queued = pool.idle = pool.threads = 0;
}

static void pool_init(void) {
  pthread_cond_destroy(&pool.cv);
  init_cv();
  pthread_atfork(NULL, NULL, reset_in_child);
}

static void *worker_main(void *unused) {
  (void)unused;
  pthread_mutex_lock(&pool.lock);
  for (;;) {
    while (!pool.head) {
      int64_t until = tcc__now_ns() + IDLE_EXIT_NS;
      struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
      pool.idle++;
      int rc = pthread_cond_timedwait(&pool.cv, &pool.lock, &ts);
      pool.idle--;
      if (rc != 0 && !pool.head && pool.threads > 1) {
        pool.threads--;
        pthread_mutex_unlock(&pool.lock);
        return NULL;
      }
    }
    task_t *t = pool.head;
    pool.head = t->next;
    if (!pool.head) pool.tail = NULL;
    pool.queued--;
    pthread_mutex_unlock(&pool.lock);
    t->fn(t->arg);
    free(t);
    pthread_mutex_lock(&pool.lock);
  }
}

static int start_worker(void) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t tid;
  int rc = pthread_create(&tid, &attr, worker_main, NULL);
  pthread_attr_destroy(&attr);
  return rc;
}

tcc_result_t tcc_run_detached(void (*fn)(void *arg), void *arg) {
  pthread_once(&pool_once, pool_init);
  task_t *t = malloc(sizeof *t);
  if (!t) return TCC_ERR_SYSTEM;
  *t = (task_t){fn, arg, NULL};
  pthread_mutex_lock(&pool.lock);
  if (pool.tail) pool.tail->next = t; else pool.head = t;
  pool.tail = t;
  pool.queued++;
  int spawn = pool.idle < pool.queued && pool.threads < MAX_THREADS;
  if (spawn && start_worker() == 0) pool.threads++;
  else if (pool.threads == 0) {
    /* No thread at all and none could be started: take the task back. */
    pool.head = pool.tail = NULL;
    pool.queued = 0;
    pthread_mutex_unlock(&pool.lock);
    free(t);
    return TCC_ERR_SYSTEM;
  }
  pthread_cond_signal(&pool.cv);
  pthread_mutex_unlock(&pool.lock);
  return TCC_OK;
}
