/*
 * no_reduce.c - stands in for src/reduce.c in the libFuzzer build: clang
 * rejects that file's GCC forms of the F16C intrinsics, and no parser under
 * test ever reduces data. Reaching it means a target left the parsers.
 */
#include <stdlib.h>

#include "core/internal.h"

void tcc__reduce_n(void *dst, const void *const *srcs, int nsrc, size_t count, tcc_dtype_t dtype,
                  tcc_redop_t op, double premul) {
  (void)dst, (void)srcs, (void)nsrc, (void)count, (void)dtype, (void)op, (void)premul;
  abort();
}
