/*
 * device_alloc.c - the device allocator the embedding program gives the
 * core (tcc_set_device_allocator), kept for the device executor.
 *
 * Set once, before the first device op, and read on every staging
 * allocation: a copy behind an atomic pointer. Copies are never freed (an
 * op in flight may still hold one a later set replaced); they stay linked
 * from `kept`, so they are not leaks but the few bytes of every set.
 */
#include <stdlib.h>

#include "core/internal.h"

typedef struct kept_allocator {
  tcc_device_allocator_t allocator;
  struct kept_allocator *older;
} kept_allocator_t;

static _Atomic(const tcc_device_allocator_t *) current;
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static kept_allocator_t *kept;

void tcc_set_device_allocator(const tcc_device_allocator_t *allocator) {
  if (!allocator || !allocator->alloc || !allocator->free) {
    atomic_store(&current, NULL);
    return;
  }
  kept_allocator_t *copy = malloc(sizeof *copy);
  if (!copy) return; /* keeps the previous one: the default is always correct */
  copy->allocator = *allocator;
  pthread_mutex_lock(&kept_lock);
  copy->older = kept;
  kept = copy;
  pthread_mutex_unlock(&kept_lock);
  atomic_store(&current, &copy->allocator);
}

const tcc_device_allocator_t *tcc__device_allocator(void) { return atomic_load(&current); }
