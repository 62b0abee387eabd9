/*
 * select.c - which transport a new group uses, decided alike on every rank
 * from the same endpoint blobs, and the one place that sets each up.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "transport/transport.h"

static int same_host(const tcc_blob_t *a, const tcc_blob_t *b) {
  return strncmp(a->hostname, b->hostname, sizeof a->hostname) == 0 &&
         strncmp(a->boot_id, b->boot_id, sizeof a->boot_id) == 0;
}

/* Shared memory needs more than one kernel: containers on one host may
 * each have a /dev/shm of their own, where rank 0's segment would never
 * appear to the others. The same directory (device and inode) is the
 * proof; every rank compares the same blobs, so all reach the same choice. */
bool tcc__blobs_share_shm(const tcc_blob_t *a, const tcc_blob_t *b) {
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

int tcc__blobs_cpus(const tcc_blob_t *blobs, int n, const char *boot_id) {
  const uint64_t **masks = malloc((size_t)n * sizeof *masks);
  uint16_t *counts = malloc((size_t)n * sizeof *counts);
  int mates = 0;
  for (int r = 0; masks && counts && r < n; r++) {
    if (boot_id && strncmp(blobs[r].boot_id, boot_id, sizeof blobs[r].boot_id) != 0) continue;
    masks[mates] = blobs[r].cpu_mask;
    counts[mates++] = blobs[r].cpus;
  }
  const int cpus = masks && counts ? tcc__cpus_between(masks, counts, mates, TCC_BLOB_CPU_BITS) : 0;
  free(masks);
  free(counts);
  return cpus;
}

/* Whether some two ranks share memory: then a group spanning hosts keeps
 * their traffic off the network (the hybrid transport). */
static bool some_pair_shares(int n, const tcc_blob_t *blobs) {
  for (int a = 0; a < n; a++)
    for (int b = a + 1; b < n; b++)
      if (tcc__blobs_share_shm(&blobs[a], &blobs[b])) return true;
  return false;
}

/* What the blobs say about where the ranks are: all sharing one /dev/shm,
 * or the first rank on another host, or the first on this host with a
 * /dev/shm of its own. -1: none such. */
static void describe_topology(int n, const tcc_blob_t *blobs, int other_host, int other_shm, char *out, size_t len) {
  if (other_host >= 0)
    snprintf(out, len, "rank %d is on another host (%s; rank 0 is on %s)", other_host, blobs[other_host].hostname,
             blobs[0].hostname);
  else if (other_shm >= 0)
    snprintf(out, len, "rank %d is on host %s but does not share /dev/shm with rank 0 (another container or mount namespace)",
             other_shm, blobs[0].hostname);
  else
    snprintf(out, len, "all %d ranks on host %s share /dev/shm", n, blobs[0].hostname);
}

/* INFO: the transport and why, so a slow job's log shows at once whether
 * it fell back to TCP. forced_by: what forced it, or NULL when chosen. */
static void log_choice(const tcc_comm_config_t *cfg, const tcc_blob_t *blobs, tcc_transport_t t, const char *forced_by,
                       int other_host, int other_shm) {
  char where[256];
  describe_topology(cfg->size, blobs, other_host, other_shm, where, sizeof where);
  const char *name = cfg->name && *cfg->name ? cfg->name : "tccomm";
  const char *tname = t == TCC_TRANSPORT_SHM ? "shm" : t == TCC_TRANSPORT_HYBRID ? "shm within each host, tcp between hosts" : "tcp";
  if (forced_by) TCC_LOG_INFO(cfg->rank, "communicator '%s': transport %s forced by %s; %s", name, tname, forced_by, where);
  else TCC_LOG_INFO(cfg->rank, "communicator '%s': %s: %s", name, where, tname);
}

tcc_result_t tcc__comm_choose_transport(const tcc_comm_config_t *cfg, const tcc_blob_t *blobs,
                                       tcc_transport_t *out, tcc_err_t *err) {
  tcc_transport_t t = cfg->transport;
  const char *forced_by = t == TCC_TRANSPORT_AUTO ? NULL : "the caller's config";
  char env_forced[64];
  if (t == TCC_TRANSPORT_AUTO) {
    const char *env = getenv("TCCOMM_TRANSPORT");
    if (!env || !*env || strcmp(env, "auto") == 0) t = TCC_TRANSPORT_AUTO;
    else if (strcmp(env, "shm") == 0) t = TCC_TRANSPORT_SHM;
    else if (strcmp(env, "tcp") == 0) t = TCC_TRANSPORT_TCP;
    else
      return tcc__err_set(err, TCC_ERR_INVALID,
                         "tccomm: TCCOMM_TRANSPORT='%s' is not one of auto, shm, tcp", env);
    if (t != TCC_TRANSPORT_AUTO) {
      snprintf(env_forced, sizeof env_forced, "TCCOMM_TRANSPORT=%s", env);
      forced_by = env_forced;
    }
  }
  int hosts = 1, shared = 1, other_host = -1, other_shm = -1;
  for (int r = 1; r < cfg->size; r++) {
    hosts &= same_host(&blobs[0], &blobs[r]);
    shared &= tcc__blobs_share_shm(&blobs[0], &blobs[r]);
    if (!hosts && other_host < 0) other_host = r;
    if (!shared && other_shm < 0) other_shm = r;
  }
  if (t == TCC_TRANSPORT_AUTO) t = shared ? TCC_TRANSPORT_SHM : some_pair_shares(cfg->size, blobs) ? TCC_TRANSPORT_HYBRID : TCC_TRANSPORT_TCP;
  if (t == TCC_TRANSPORT_HYBRID && forced_by)
    return tcc__err_set(err, TCC_ERR_INVALID,
                        "tccomm: the hybrid transport cannot be requested (auto chooses it when some ranks "
                        "share a host and others do not)");
  if (t == TCC_TRANSPORT_SHM && !hosts)
    return tcc__err_set(err, TCC_ERR_INVALID,
                       "tccomm: shared-memory transport requested but the ranks are on different hosts");
  if (t == TCC_TRANSPORT_SHM && !shared)
    return tcc__err_set(err, TCC_ERR_INVALID,
                       "tccomm: shared-memory transport requested but the ranks do not share /dev/shm "
                       "(separate containers or mount namespaces); use TCCOMM_TRANSPORT=tcp");
  if (TCC__LOG_ON(TCC__LOG_INFO)) log_choice(cfg, blobs, t, forced_by, other_host, other_shm);
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
    case TCC_TRANSPORT_HYBRID:
      r = tcc__hybrid_setup(comm, ep, blobs, err);
      tcc_endpoint_close(ep);
      return r;
    default:
      tcc_endpoint_close(ep);
      return tcc__err_set(err, TCC_ERR_INVALID, "tccomm '%s': no transport %d", comm->name, (int)transport);
  }
}
