/*
 * fuzz_blob.c - the endpoint blobs every rank gathers from the store:
 * decoding (tcc__blobs_decode), the transport choice made from them, and
 * the CPUs their ranks may use between them (tcc__blobs_cpus).
 *
 * Input: [n-1 (1 byte)] [requested transport (1 byte)] [n blobs of
 * TCC_ENDPOINT_BLOB_SIZE bytes]. The blobs sit in a buffer of exactly that
 * size, so any read past the last one is caught by AddressSanitizer.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "core/internal.h"
#include "transport/transport.h"

#define MAX_RANKS 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  const int n = 1 + fuzz_u8(&in) % MAX_RANKS;
  const uint8_t want = fuzz_u8(&in);
  uint8_t *raw = malloc((size_t)n * TCC_ENDPOINT_BLOB_SIZE);
  tcc_blob_t *blobs = calloc((size_t)n, sizeof *blobs);
  if (!raw || !blobs) abort();
  fuzz_take(&in, raw, (size_t)n * TCC_ENDPOINT_BLOB_SIZE);
  /* The choice must depend on the blobs alone, not on this process. */
  unsetenv("TCCOMM_TRANSPORT");
  tcc_err_t err = {TCC_OK, {0}};
  if (tcc__blobs_decode(raw, n, blobs, &err) == TCC_OK) {
    for (int r = 0; r < n; r++) {
      assert(blobs[r].magic == TCC_BLOB_MAGIC);
      assert(strnlen(blobs[r].hostname, sizeof blobs[r].hostname) < sizeof blobs[r].hostname);
      assert(strnlen(blobs[r].boot_id, sizeof blobs[r].boot_id) < sizeof blobs[r].boot_id);
    }
    /* No more CPUs than any mask can show, nor than the most any rank counts. */
    int most = 0;
    for (int r = 0; r < n; r++) most = blobs[r].cpus > most ? blobs[r].cpus : most;
    const int between = tcc__blobs_cpus(blobs, n, want & 4 ? blobs[0].boot_id : NULL);
    assert(between >= 0 && (between <= TCC_BLOB_CPU_BITS || between <= most));
    tcc_comm_config_t cfg = {.rank = 0, .size = n, .transport = (tcc_transport_t)(want % 3)};
    tcc_transport_t t = TCC_TRANSPORT_AUTO;
    /* Hybrid only where auto chose it: some ranks share a host, not all. */
    if (tcc__comm_choose_transport(&cfg, blobs, &t, &err) == TCC_OK)
      assert(t == TCC_TRANSPORT_SHM || t == TCC_TRANSPORT_TCP ||
             (t == TCC_TRANSPORT_HYBRID && cfg.transport == TCC_TRANSPORT_AUTO));
  } else {
    assert(err.code == TCC_ERR_INVALID);
  }
  free(blobs);
  free(raw);
  return 0;
}
