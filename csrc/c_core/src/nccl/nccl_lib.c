/*
 * nccl_lib.c - finds NCCL at run time (see nccl_lib.h).
 *
 * dlopen("libnccl.so.2", RTLD_NOLOAD) returns the copy torch already
 * loaded; only when there is none (a program that uses the core without
 * torch) is the library loaded from the search path. Two NCCL copies in one
 * process would each keep their own state and could not share
 * communicators, which is why the soname is looked up before anything else.
 */
#include "nccl/nccl_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static tcc__nccl_lib_t lib;
static int loaded;
static char load_error[TCC_ERRLEN];

int tcc__nccl_version_normalize(int code) {
  /* Old codes are below 10000 (2.8.4: 2804); new ones are not (2.9.6: 20906). */
  if (code >= 10000) return code;
  return TCC_NCCL_V(code / 1000, (code / 100) % 10, code % 100);
}

void tcc__nccl_version_string(int v, char *out, size_t len) {
  snprintf(out, len, "%d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
}

/* Resolves one symbol into *slot; required symbols that are missing fail the load. */
static int resolve(void *handle, const char *name, void *slot, int required) {
  void *fn = dlsym(handle, name);
  /* Function pointers and void * have the same representation on every
   * platform with dlsym (POSIX requires it); memcpy avoids the ISO C cast. */
  memcpy(slot, &fn, sizeof fn);
  if (!fn && required) {
    snprintf(load_error, sizeof load_error, "the NCCL library in this process lacks %s", name);
    return -1;
  }
  return 0;
}

static void load(void) {
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    snprintf(load_error, sizeof load_error,
             "cannot load NCCL (libnccl.so.2): %s; it ships with torch's CUDA build "
             "(the nvidia-nccl-cu* package)",
             why ? why : "not found");
    return;
  }
  ncclResult_t (*get_version)(int *) = NULL;
  if (resolve(h, "ncclGetVersion", &get_version, 1) != 0) return;
  int code = 0;
  if (get_version(&code) != ncclSuccess) {
    snprintf(load_error, sizeof load_error, "ncclGetVersion failed");
    return;
  }
  lib.version = tcc__nccl_version_normalize(code);
  if (lib.version < TCC_NCCL_MIN_VERSION) {
    char have[32], need[32];
    tcc__nccl_version_string(lib.version, have, sizeof have);
    tcc__nccl_version_string(TCC_NCCL_MIN_VERSION, need, sizeof need);
    snprintf(load_error, sizeof load_error, "NCCL %s is too old: tccomm needs NCCL >= %s", have, need);
    return;
  }
  int bad = 0;
  bad |= resolve(h, "ncclGetErrorString", &lib.GetErrorString, 1);
  bad |= resolve(h, "ncclGetLastError", &lib.GetLastError, 0);
  bad |= resolve(h, "ncclGetUniqueId", &lib.GetUniqueId, 1);
  bad |= resolve(h, "ncclCommInitRank", &lib.CommInitRank, 1);
  bad |= resolve(h, "ncclCommDestroy", &lib.CommDestroy, 1);
  bad |= resolve(h, "ncclCommCount", &lib.CommCount, 1);
  bad |= resolve(h, "ncclCommUserRank", &lib.CommUserRank, 1);
  bad |= resolve(h, "ncclCommAbort", &lib.CommAbort, 1);
  bad |= resolve(h, "ncclCommGetAsyncError", &lib.CommGetAsyncError, 1);
  bad |= resolve(h, "ncclGroupStart", &lib.GroupStart, 1);
  bad |= resolve(h, "ncclGroupEnd", &lib.GroupEnd, 1);
  bad |= resolve(h, "ncclAllReduce", &lib.AllReduce, 1);
  bad |= resolve(h, "ncclBroadcast", &lib.Broadcast, 1);
  bad |= resolve(h, "ncclReduce", &lib.Reduce, 1);
  bad |= resolve(h, "ncclAllGather", &lib.AllGather, 1);
  bad |= resolve(h, "ncclReduceScatter", &lib.ReduceScatter, 1);
  bad |= resolve(h, "ncclSend", &lib.Send, 1);
  bad |= resolve(h, "ncclRecv", &lib.Recv, 1);
  if (bad) return;
  if (lib.version >= TCC_NCCL_PREMUL_VERSION) {
    resolve(h, "ncclRedOpCreatePreMulSum", &lib.RedOpCreatePreMulSum, 0);
    resolve(h, "ncclRedOpDestroy", &lib.RedOpDestroy, 0);
  }
  if (lib.version >= TCC_NCCL_CONFIG_VERSION) resolve(h, "ncclCommInitRankConfig", &lib.CommInitRankConfig, 0);
  if (lib.version >= TCC_NCCL_SPLIT_VERSION) resolve(h, "ncclCommSplit", &lib.CommSplit, 0);
  /* Newer collectives: absent symbols leave NULL (grouped send/recv instead). */
  resolve(h, "ncclAlltoAll", &lib.AlltoAll, 0);
  resolve(h, "ncclGather", &lib.Gather, 0);
  resolve(h, "ncclScatter", &lib.Scatter, 0);
  /* The handle stays open for the life of the process: NCCL is never unloaded. */
  loaded = 1;
}

const tcc__nccl_lib_t *tcc__nccl_lib(tcc_err_t *err) {
  pthread_once(&load_once, load);
  if (loaded) return &lib;
  tcc__err_set(err, TCC_ERR_UNSUPPORTED, "tccomm: %s", load_error);
  return NULL;
}
