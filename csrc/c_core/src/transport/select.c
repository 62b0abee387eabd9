/*
 * select.c - which transport a new group uses, decided alike on every rank
 * from the same endpoint blobs, and the one place that sets each up.
 */
#include <stdlib.h>
#include <string.h>

#include "transport/transport.h"

static int same_host(const tcc_blob_t *a, const tcc_blob_t *b) {
  return strncmp(a->hostname, b->hostname, sizeof a->hostname) == 0 &&
         strncmp(a->boot_id, b->boot_id, sizeof a->boot_id) == 0;
}

/* Shared memory needs more than one kernel: containers on one host may
 * each have a /dev/shm of their own, where rank 0's segment would never
 * appear to the others. The same directory (device and inode) is the
 * proof; every rank compares the same blobs, so all reach the same choice. */
static int same_shm(const tcc_blob_t *a, const tcc_blob_t *b) {
  return same_host(a, b) && a->shm_dev != 0 && a->shm_dev == b->shm_dev && a->shm_ino == b->shm_ino;
}

tcc_result_t tcc__blobs_decode(const uint8_t *raw, int n, tcc_blob_t *blobs, tcc_err_t *err) {
  for (int r = 0; r < n; r++) {
    memcpy(&blobs[r], raw + (size_t)r * TCC_ENDPOINT_BLOB_SIZE, sizeof blobs[r]);
    if (blobs[r].magic != TCC_BLOB_MAGIC)
      return tcc__err_set(err, TCC_ERR_INVALID, "tccomm: endpoint blob of rank %d is not a tccomm endpoint", r);
    /* The strings came from another process: terminate them here so no
     * later use can run past their fields. */
    blobs[r].hostname[sizeof blobs[r].hostname - 1] = '\0';
    blobs[r].boot_id[sizeof blobs[r].boot_id - 1] = '\0';
  }
  return TCC_OK;
}

tcc_result_t tcc__comm_choose_transport(const tcc_comm_config_t *cfg, const tcc_blob_t *blobs,
                                       tcc_transport_t *out, tcc_err_t *err) {
  tcc_transport_t t = cfg->transport;
  if (t == TCC_TRANSPORT_AUTO) {
    const char *env = getenv("TCCOMM_TRANSPORT");
    if (!env || !*env || strcmp(env, "auto") == 0) t = TCC_TRANSPORT_AUTO;
    else if (strcmp(env, "shm") == 0) t = TCC_TRANSPORT_SHM;
    else if (strcmp(env, "tcp") == 0) t = TCC_TRANSPORT_TCP;
    else
      return tcc__err_set(err, TCC_ERR_INVALID,
                         "tccomm: TCCOMM_TRANSPORT='%s' is not one of auto, shm, tcp", env);
  }
  int hosts = 1, shared = 1;
  for (int r = 1; r < cfg->size; r++) {
    hosts &= same_host(&blobs[0], &blobs[r]);
    shared &= same_shm(&blobs[0], &blobs[r]);
  }
  if (t == TCC_TRANSPORT_AUTO) t = shared ? TCC_TRANSPORT_SHM : TCC_TRANSPORT_TCP;
  if (t == TCC_TRANSPORT_SHM && !hosts)
    return tcc__err_set(err, TCC_ERR_INVALID,
                       "tccomm: shared-memory transport requested but the ranks are on different hosts");
  if (t == TCC_TRANSPORT_SHM && !shared)
    return tcc__err_set(err, TCC_ERR_INVALID,
                       "tccomm: shared-memory transport requested but the ranks do not share /dev/shm "
                       "(separate containers or mount namespaces); use TCCOMM_TRANSPORT=tcp");
  *out = t;
  return TCC_OK;
}

tcc_result_t tcc__transport_setup(tcc_comm_t *comm, tcc_transport_t transport, tcc_endpoint_t *ep,
                                  const tcc_blob_t *blobs, tcc_err_t *err) {
  tcc_result_t r;
  switch (transport) {
    case TCC_TRANSPORT_SHM:
      tcc_endpoint_close(ep); /* no connections: the listening socket goes at once */
      return tcc__shm_setup(comm, blobs, err);
    case TCC_TRANSPORT_TCP:
      r = tcc__tcp_setup(comm, ep, blobs, err);
      tcc_endpoint_close(ep);
      return r;
    default:
      tcc_endpoint_close(ep);
      return tcc__err_set(err, TCC_ERR_INVALID, "tccomm '%s': no transport %d", comm->name, (int)transport);
  }
}
