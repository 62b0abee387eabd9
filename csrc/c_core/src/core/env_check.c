/*
 * env_check.c - the core's on/off switches in the environment, checked at
 * every communicator's creation. Their readers (spread over the transports
 * and the reduction kernels, some read once per process) only ask "is it
 * 0?", so a value they do not know would silently mean the default:
 * TCCOMM_CMA=off kept single-copy movement on. Such a value now fails the
 * creation, naming the variable, its value and what it may be, as
 * TCCOMM_TRANSPORT and TCCOMM_HIER_OVERLAP do where they are read.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

typedef struct env_switch {
  const char *name;
  const char *const *values; /* NULL-terminated; unset or empty is always fine */
  const char *listed;        /* the values, for the message */
} env_switch_t;

static const char *const zero_one[] = {"0", "1", NULL};
static const char *const reduce_isa[] = {"generic", NULL};
static const char *const async_policy[] = {"0", "1", "2", "3", NULL};

static const env_switch_t switches[] = {
    {"TCCOMM_CMA", zero_one, "0, 1"},
    {"TCCOMM_CPU_MOVE", zero_one, "0, 1"},
    {"TCCOMM_STREAM_ONE_SIDED", zero_one, "0, 1"},
    {"TCCOMM_REDUCE_ISA", reduce_isa, "generic"},
    {"TCCOMM_ASYNC_ERROR_HANDLING", async_policy, "0, 1, 2, 3"},
};

static bool known(const env_switch_t *s, const char *v) {
  for (const char *const *p = s->values; *p; p++)
    if (strcmp(v, *p) == 0) return true;
  return false;
}

tcc_result_t tcc__env_check_switches(tcc_err_t *err) {
  for (size_t i = 0; i < sizeof switches / sizeof *switches; i++) {
    const char *v = getenv(switches[i].name);
    if (v && *v && !known(&switches[i], v))
      return tcc__err_set(err, TCC_ERR_INVALID, "tccomm: %s='%.60s' is not one of %s", switches[i].name, v,
                          switches[i].listed);
  }
  return TCC_OK;
}
