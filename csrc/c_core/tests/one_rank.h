/*
 * one_rank.h - a communicator of one rank, for tests of what an op does
 * before any peer is involved (argument checks, device rules).
 */
#ifndef TCC_TESTS_ONE_RANK_H
#define TCC_TESTS_ONE_RANK_H

#include <stdio.h>

#include "tccomm.h"

/* NULL (with the reason on stderr) if the communicator cannot be made. */
static tcc_comm_t *one_rank_comm(const char *name) {
  tcc_endpoint_t *ep;
  uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
  if (tcc_endpoint_open("127.0.0.1", &ep, blob) != TCC_OK) {
    fprintf(stderr, "endpoint: %s\n", tcc_last_error());
    return NULL;
  }
  tcc_comm_config_t cfg = {0, 1, 10000, name, TCC_TRANSPORT_AUTO};
  tcc_comm_t *comm = NULL;
  if (tcc_comm_create(&cfg, ep, blob, &comm) != TCC_OK) {
    fprintf(stderr, "create: %s\n", tcc_last_error());
    return NULL;
  }
  return comm;
}

/* `n` float32 elements at `p` on `device` (-1: host). */
static tcc_buf_t buf(void *p, size_t n, int device) {
  tcc_buf_t b = {p, n, TCC_FLOAT32, device, NULL};
  return b;
}

#endif /* TCC_TESTS_ONE_RANK_H */
