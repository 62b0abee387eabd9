/*
 * tcp_congestion.c - the congestion control of each connection's sending
 * side.
 *
 * Between two ranks on one machine (the same boot id: loopback, veth
 * pairs between network namespaces, containers on one node) the bytes
 * never share a link with another flow, so congestion control protects
 * nothing there, and a pacing one costs a great deal. With bbr, this
 * machine's default, a plain C loop of send and recv over loopback takes
 * 521 us per 1 MiB round trip, against 222 with cubic and 225 with reno;
 * the core's 16 MiB all_reduce over TCP 9.6 ms against 4.4 with reno.
 * Those connections use reno, which every Linux kernel has built in and
 * which measured at least as well as cubic at every size. Connections to
 * other machines keep the system's choice (their traffic shares links with
 * other jobs), unless TCCOMM_TCP_CONGESTION names one for every
 * connection; "system" leaves every connection as the system sets it.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "transport/tcp/tcp.h"

#define CONGESTION_ENV "TCCOMM_TCP_CONGESTION"

static bool use(int fd, const char *name) {
  return setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, (socklen_t)strlen(name)) == 0;
}

tcc_result_t tcc__tcp_congestion_choose(tcp_congestion_t *cc, int probe_fd, tcc_err_t *err) {
  memset(cc, 0, sizeof *cc);
  const char *env = getenv(CONGESTION_ENV);
  if (!env || !*env) return TCC_OK;
  if (strcmp(env, "system") == 0) {
    cc->system_only = true;
    return TCC_OK;
  }
  if (strlen(env) >= sizeof cc->name)
    return tcc__err_set(err, TCC_ERR_INVALID, "%s='%.40s' is not a congestion control's name (at most %zu characters)",
                        CONGESTION_ENV, env, sizeof cc->name - 1);
  /* Tried on a socket of this process first: an unknown name, or one the
   * kernel does not let this user choose, fails here, not per connection. */
  if (!use(probe_fd, env)) {
    const int errnum = errno;
    char offered[200] = "";
    FILE *f = fopen("/proc/sys/net/ipv4/tcp_available_congestion_control", "r");
    if (f) {
      if (!fgets(offered, sizeof offered, f)) offered[0] = '\0';
      fclose(f);
      offered[strcspn(offered, "\n")] = '\0';
    }
    return tcc__err_set(err, TCC_ERR_INVALID,
                        "%s='%s' cannot be used: %s (this kernel offers: %s; or 'system' to keep its default)",
                        CONGESTION_ENV, env, strerror(errnum), offered[0] ? offered : "unknown");
  }
  snprintf(cc->name, sizeof cc->name, "%s", env);
  return TCC_OK;
}

void tcc__tcp_congestion_apply(const tcp_congestion_t *cc, int fd, bool same_machine) {
  if (cc->system_only) return;
  if (cc->name[0]) {
    (void)use(fd, cc->name); /* checked when chosen */
    return;
  }
  if (same_machine) (void)use(fd, "reno"); /* best effort: the system's choice stays otherwise */
}
