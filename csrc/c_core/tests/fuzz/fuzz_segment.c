/*
 * fuzz_segment.c - a shared-memory object under a segment's name, as
 * another rank finds it: tcc__segment_open's checks of mode, size, reserved
 * pages, state, secret and failure reason, then (when it maps) the shm
 * transport's header check on the mapping. A real object is created per
 * input, so the checks run exactly as they do against a hostile or
 * half-written segment.
 *
 * Input: [flags] [mode (2 bytes)] [file size (4 bytes)] [head bytes...]
 *   flags bit 0: write this group's secret into the head
 *         bit 1: state word = the "ready" value tcc__segment_publish writes
 *         bit 2: total_bytes = the file size
 *         bit 3: reserve every page (else only those written)
 *         bits 4-5: mode 0600, 0400, 0644, or the mode field
 */
#include <assert.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz.h"
#include "transport/shm/shm.h"

#define MAX_FILE (64u << 10)

static void name_once(tcc_segment_id_t *id) {
  static tcc_segment_id_t cached;
  static int done;
  if (!done) {
    uint8_t token[TCC_TOKEN_BYTES] = {0};
    pid_t pid = getpid();
    memcpy(token, &pid, sizeof pid); /* one name per process: parallel runs do not meet */
    tcc__segment_id("fuzz-", token, &cached);
    done = 1;
  }
  *id = cached;
}

static void remove_all(const tcc_segment_id_t *id) {
  char ack[80];
  shm_unlink(id->name);
  snprintf(ack, sizeof ack, "%s.1", id->name);
  shm_unlink(ack);
}

/* Writes the object; returns 0 on success. */
static int make_object(const tcc_segment_id_t *id, fuzz_in_t *in) {
  const uint8_t flags = fuzz_u8(in);
  uint16_t mode_field;
  uint32_t file_size;
  fuzz_take(in, &mode_field, sizeof mode_field);
  fuzz_take(in, &file_size, sizeof file_size);
  file_size %= MAX_FILE + 1;
  static const mode_t modes[] = {0600, 0400, 0644};
  const mode_t mode = (flags >> 4 & 3) < 3 ? modes[flags >> 4 & 3] : (mode_t)(mode_field & 0777);
  tcc_segment_head_t head;
  fuzz_take(in, &head, sizeof head);
  if (flags & 1) memcpy(head.secret, id->secret, sizeof head.secret);
  if (flags & 2) tcc__segment_publish(&head);
  if (flags & 4) head.total_bytes = file_size;
  int fd = shm_open(id->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  int bad = ftruncate(fd, file_size) != 0;
  if (!bad && (flags & 8) && file_size) bad = posix_fallocate(fd, 0, file_size) != 0;
  size_t len = file_size < sizeof head ? file_size : sizeof head;
  if (!bad && len) bad = pwrite(fd, &head, len, 0) != (ssize_t)len;
  /* The rest of the input fills the page after the head. */
  size_t rest = in->left;
  if (rest > file_size - len) rest = file_size - len;
  if (!bad && rest) bad = pwrite(fd, in->p, rest, (off_t)len) != (ssize_t)rest;
  if (!bad) bad = fchmod(fd, mode) != 0;
  close(fd);
  return bad ? -1 : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  tcc_segment_id_t id;
  name_once(&id);
  remove_all(&id);
  if (make_object(&id, &in) != 0) {
    remove_all(&id);
    return 0;
  }
  void *base = NULL;
  size_t bytes = 0;
  tcc_err_t err = {TCC_OK, {0}};
  /* A deadline in the past: one look, no waiting on an incomplete object. */
  tcc_result_t r = tcc__segment_open(&id, 1, 2, tcc__now_ns() - 1, "fuzz", &base, &bytes, NULL, &err);
  if (r == TCC_OK) {
    assert(bytes >= TCC_SEGMENT_HEAD_BYTES && bytes <= MAX_FILE);
    (void)tcc__shm_check_header(base, 2, bytes, "fuzz", &err);
    munmap(base, bytes);
  } else {
    assert(err.msg[0]);
  }
  remove_all(&id);
  return 0;
}
