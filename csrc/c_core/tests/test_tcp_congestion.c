/*
 * test_tcp_congestion.c - the congestion control TCP connections send
 * with (transport/tcp/tcp_congestion.c): reno between ranks of one
 * machine, the system's choice towards other machines, the one
 * TCCOMM_TCP_CONGESTION names, none changed with "system", and a clear
 * error at creation for a name the kernel refuses.
 */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "check.h"
#include "group.h"
#include "transport/tcp/tcp.h"

static char system_default[32];

static void congestion_of(int fd, char *name, size_t len) {
  socklen_t n = (socklen_t)len;
  memset(name, 0, len);
  CHECK(getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &n) == 0, "getsockopt(TCP_CONGESTION)");
  name[len - 1] = '\0';
}

/* What every connection of a group must send with (set before the fork). */
static const char *want;

static void check_connections(tcc_comm_t *comm) {
  const tcp_state_t *st = comm->transport_state;
  for (int j = 0; j < st->n; j++) {
    if (j == st->me) continue;
    const int fds[2] = {st->coll_fd[j], st->p2p_fd[j]};
    for (int k = 0; k < 2; k++) {
      char name[32];
      congestion_of(fds[k], name, sizeof name);
      CHECK(strcmp(name, want) == 0, "rank %d, %s connection to rank %d: %s, want %s", st->me,
            k ? "p2p" : "collective", j, name, want);
    }
  }
  /* The connections still carry data. */
  float x[4] = {1, 2, 3, 4};
  tcc_op_t *op;
  const tcc_buf_t b = {x, 4, TCC_FLOAT32, -1, NULL};
  CHECK(tcc_allreduce(comm, b, b, TCC_SUM, NULL, &op) == TCC_OK && tcc_op_wait(op, -1) == TCC_OK,
        "allreduce: %s", tcc_last_error());
  tcc_op_release(op);
  CHECK(x[0] == 1.0f * st->n && x[3] == 4.0f * st->n, "allreduce result %g %g", x[0], x[3]);
}

static void test_groups(void) {
  unsetenv("TCCOMM_TCP_CONGESTION");
  want = "reno"; /* one machine: every rank here */
  CHECK(run_group(3, "tcp", 10000, "cc-default", check_connections) == 0, "default: reno between ranks of one machine");
  setenv("TCCOMM_TCP_CONGESTION", "system", 1);
  want = system_default;
  CHECK(run_group(2, "tcp", 10000, "cc-system", check_connections) == 0, "system: %s", system_default);
  setenv("TCCOMM_TCP_CONGESTION", "cubic", 1);
  want = "cubic";
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  const bool has_cubic = setsockopt(probe, IPPROTO_TCP, TCP_CONGESTION, "cubic", 5) == 0;
  close(probe);
  if (has_cubic)
    CHECK(run_group(2, "tcp", 10000, "cc-named", check_connections) == 0, "named: cubic");
  else
    fprintf(stderr, "test_tcp_congestion: a named algorithm not tested: this kernel refuses cubic\n");
  unsetenv("TCCOMM_TCP_CONGESTION");
}

/* A name the kernel refuses fails creation, naming the setting and what
 * the kernel offers; so does one too long to be a name. */
static void test_refused_name(void) {
  const char *bad[] = {"nosuchalgo", "a-name-longer-than-any-congestion-control"};
  for (int i = 0; i < 2; i++) {
    setenv("TCCOMM_TCP_CONGESTION", bad[i], 1);
    tcc_endpoint_t *ep;
    uint8_t blob[TCC_ENDPOINT_BLOB_SIZE];
    CHECK(tcc_endpoint_open("127.0.0.1", &ep, blob) == TCC_OK, "endpoint: %s", tcc_last_error());
    const tcc_comm_config_t cfg = {0, 1, 10000, "cc-refused", TCC_TRANSPORT_TCP};
    tcc_comm_t *comm = NULL;
    const tcc_result_t r = tcc_comm_create(&cfg, ep, blob, &comm);
    CHECK(r == TCC_ERR_INVALID && strstr(tcc_last_error(), "TCCOMM_TCP_CONGESTION") &&
              strstr(tcc_last_error(), "communicator 'cc-refused' rank 0") &&
              strstr(tcc_last_error(), i == 0 ? "this kernel offers" : "not a congestion control"),
          "'%s': %s (%s)", bad[i], tcc_result_string(r), tcc_last_error());
    if (r == TCC_OK) tcc_comm_destroy(comm);
  }
  unsetenv("TCCOMM_TCP_CONGESTION");
}

/* The policy on a connection of its own: towards another machine the
 * default changes nothing, towards this one it takes reno, a name wins
 * either way, and "system" changes nothing. */
static void test_policy(void) {
  const tcp_congestion_t by_default = {false, ""}, system_only = {true, ""}, named = {false, "reno"};
  struct {
    const tcp_congestion_t *cc;
    bool same_machine;
    const char *want;
  } cases[] = {{&by_default, false, system_default}, {&by_default, true, "reno"}, {&system_only, true, system_default},
               {&named, false, "reno"}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0, "socket");
    tcc__tcp_congestion_apply(cases[i].cc, fd, cases[i].same_machine);
    char name[32];
    congestion_of(fd, name, sizeof name);
    CHECK(strcmp(name, cases[i].want) == 0, "case %zu: %s, want %s", i, name, cases[i].want);
    close(fd);
  }
}

int main(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(fd >= 0, "socket");
  congestion_of(fd, system_default, sizeof system_default);
  close(fd);
  test_policy();
  test_refused_name();
  test_groups();
  CHECK_DONE();
}
