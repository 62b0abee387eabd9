/* shm_segment.c - see shm_segment.h. */
#include "shm_segment.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SEGMENT_READY 0x74636d73u /* "tcms" */

static void sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

void tcc_segment_name(const char *kind, const uint8_t token[TCC_TOKEN_BYTES], char out[64]) {
  int len = snprintf(out, 64, "/tccomm-%s", kind);
  for (int i = 0; i < TCC_TOKEN_BYTES; i++) len += snprintf(out + len, 64 - (size_t)len, "%02x", token[i]);
}

tcc_result_t tcc_segment_create(const char *name, size_t bytes, const char *who, void **base, tcc_err_t *err) {
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return tcc_err_set(err, TCC_ERR_SYSTEM, "%s: shm_open(%s) failed: %s", who, name, strerror(errno));
  if (ftruncate(fd, (off_t)bytes) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "%s: cannot size shared memory to %zu bytes: %s", who, bytes,
                       strerror(e));
  }
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name);
    return tcc_err_set(err, TCC_ERR_SYSTEM, "%s: mmap failed: %s", who, strerror(errno));
  }
  /* Fresh tmpfs pages are zero: the user's counters start at 0. */
  ((tcc_segment_head_t *)p)->total_bytes = bytes;
  *base = p;
  return TCC_OK;
}

void tcc_segment_publish(void *base) {
  atomic_store(&((tcc_segment_head_t *)base)->ready, SEGMENT_READY); /* publishes the layout */
}

tcc_result_t tcc_segment_open(const char *name, int64_t deadline, const char *who, void **base, size_t *bytes,
                              tcc_err_t *err) {
  const size_t head = sizeof(tcc_segment_head_t);
  int fd = -1;
  for (;;) {
    if (fd < 0) fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0 && errno != ENOENT)
      return tcc_err_set(err, TCC_ERR_SYSTEM, "%s: shm_open(%s) failed: %s", who, name, strerror(errno));
    struct stat sb;
    if (fd >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size >= head) {
      tcc_segment_head_t *probe = mmap(NULL, head, PROT_READ, MAP_SHARED, fd, 0);
      if (probe != MAP_FAILED) {
        int ready = atomic_load(&probe->ready) == SEGMENT_READY;
        uint64_t total = probe->total_bytes;
        munmap(probe, head);
        if (ready) {
          void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
          close(fd);
          if (p == MAP_FAILED) return tcc_err_set(err, TCC_ERR_SYSTEM, "%s: mmap failed: %s", who, strerror(errno));
          *base = p;
          *bytes = total;
          return TCC_OK;
        }
      }
    }
    if (tcc_now_ns() > deadline) {
      if (fd >= 0) close(fd);
      return tcc_err_set(err, TCC_ERR_TIMEOUT,
                         "%s: timed out waiting for rank 0 to create the shared-memory segment", who);
    }
    sleep_ns(200 * 1000);
  }
}

tcc_result_t tcc_segment_attach(void *base, const char *name, int n, int64_t deadline, int *attached) {
  tcc_segment_head_t *h = base;
  if (atomic_fetch_add(&h->attached, 1) + 1 == n) shm_unlink(name);
  while (atomic_load(&h->attached) < n) {
    if (tcc_now_ns() > deadline) {
      *attached = atomic_load(&h->attached);
      shm_unlink(name);
      return TCC_ERR_TIMEOUT;
    }
    sleep_ns(50 * 1000);
  }
  *attached = n;
  return TCC_OK;
}
