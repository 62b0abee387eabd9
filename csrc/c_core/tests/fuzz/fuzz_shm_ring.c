/*
 * fuzz_shm_ring.c - the records of a shared-memory point-to-point ring
 * (transport/shm/shm_p2p.c), as the peer that writes them leaves them.
 *
 * Input: the line the reader's tail starts on (1 byte, of the ring's 64),
 * the ring's 4096 bytes, then the lengths of reads (2 bytes each). Every
 * read must either fail with a message naming the corrupt ring and the
 * writing rank, or return at most what was asked, from inside the ring
 * (ASan), moving the tail a whole number of lines, never past a lap;
 * nothing there (0) ends the input. Then the same ring, written by the
 * writer's own code after what was read: what it wrote is read back
 * whole, byte for byte.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_ring.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fake_ring_t *reader = fake_ring_new(0);
  if (!reader) abort();
  fuzz_in_t in = {data, size};
  shm_ring_t *ring = shm_ring_of(&reader->st, 1, 0);
  const uint64_t start = (uint64_t)(fuzz_u8(&in) % (FAKE_RING_BYTES / 64)) * 64;
  atomic_store(&ring->tail, start);
  atomic_store(&ring->head, start);
  fuzz_take(&in, ring->data, FAKE_RING_BYTES);
  uint8_t buf[2048];
  bool failed = false;
  while (in.left > 0) {
    uint16_t want;
    fuzz_take(&in, &want, sizeof want);
    const size_t len = 1 + want % sizeof buf;
    const uint64_t before = atomic_load(&ring->tail);
    tcc_err_t err = {TCC_OK, {0}};
    const ssize_t n = tcc__shm_p2p_read(&reader->comm, 1, buf, len, &err);
    const uint64_t after = atomic_load(&ring->tail);
    if (n < 0) {
      assert(err.code == TCC_ERR_REMOTE && strstr(err.msg, "corrupt ring from rank 1") && strstr(err.msg, "'fuzz' (rank 0)"));
      assert(after == before);
      failed = true;
      break;
    }
    assert((size_t)n <= len && after % 64 == 0 && after - before <= FAKE_RING_BYTES);
    if (n == 0) break;
  }
  if (!failed) {
    /* The writer goes on from where the reader is, on a ring whose every
     * byte past the tail is garbage but for the header it clears. */
    fake_ring_t *writer = fake_ring_new(1);
    if (!writer) abort();
    writer->st.base = reader->st.base; /* one segment, two views */
    writer->st.hdr = reader->st.hdr;
    const uint64_t tail = atomic_load(&ring->tail);
    if (reader->rec_read[1] == 0) {
      atomic_store(&ring->head, tail);
      atomic_store((_Atomic uint64_t *)(void *)(ring->data + tail % FAKE_RING_BYTES), 0);
      writer->tail_seen[0] = tail;
      uint8_t msg[700], got[700];
      for (size_t i = 0; i < sizeof msg; i++) msg[i] = (uint8_t)(i * 7 + tail);
      const struct iovec iov[2] = {{msg, 300}, {msg + 300, 400}};
      tcc_err_t err = {TCC_OK, {0}};
      assert(tcc__shm_p2p_write(&writer->comm, 0, iov, 2, &err) == 700);
      size_t have = 0;
      while (have < sizeof got) {
        const ssize_t n = tcc__shm_p2p_read(&reader->comm, 1, got + have, sizeof got - have, &err);
        assert(n > 0);
        have += (size_t)n;
      }
      assert(memcmp(got, msg, sizeof msg) == 0);
      assert(tcc__shm_p2p_read(&reader->comm, 1, got, 1, &err) == 0);
    }
    fake_ring_free(writer);
  }
  fake_ring_free(reader);
  return 0;
}
