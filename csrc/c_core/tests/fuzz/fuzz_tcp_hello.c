/*
 * fuzz_tcp_hello.c - the TCP handshake: the hello an acceptor reads from
 * any connection to its listening port (tcc__tcp_hello_accept) and the reply a
 * connector reads back (tcc__tcp_ack_valid).
 *
 * Input: [n-1] [me] [ack peer] [ack chan] [claimed: 2n bytes, low bit]
 * [this rank's token] [tcp_hello_t]. `claimed` has exactly 2n entries.
 */
#include <assert.h>
#include <stdlib.h>

#include "fuzz.h"
#include "transport/tcp/tcp.h"

#define MAX_RANKS 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  const int n = 1 + fuzz_u8(&in) % MAX_RANKS;
  const int me = fuzz_u8(&in) % n;
  const int ack_peer = fuzz_u8(&in) % n, ack_chan = fuzz_u8(&in) % TCP_NCHAN;
  bool *claimed = malloc((size_t)(2 * n) * sizeof *claimed);
  if (!claimed) abort();
  for (int i = 0; i < 2 * n; i++) claimed[i] = fuzz_u8(&in) & 1;
  uint8_t token[TCC_TOKEN_BYTES];
  fuzz_take(&in, token, sizeof token);
  tcp_hello_t h;
  fuzz_take(&in, &h, sizeof h);

  int peer = -1, chan = -1;
  if (tcc__tcp_hello_accept(&h, n, me, token, claimed, &peer, &chan)) {
    assert(peer > me && peer < n && chan >= 0 && chan < TCP_NCHAN);
    assert(!claimed[2 * peer + chan]);
  }
  if (tcc__tcp_ack_valid(&h, ack_peer, ack_chan, token)) assert(h.rank == (uint32_t)ack_peer);
  free(claimed);
  return 0;
}
