/*
 * fuzz_window.c - window creation: the sizes every rank allgathers
 * (tcc__window_check_hellos), the layout computed from them, and rank 0's
 * segment header checked against it (tcc__window_check_header).
 *
 * Input: [n-1] [rank] [n win_hello_t] [win_header_t] [mapped size (8 bytes)].
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzz.h"
#include "window/window.h"

#define MAX_RANKS 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in_t in = {data, size};
  const int n = 1 + fuzz_u8(&in) % MAX_RANKS;
  tcc_window_t win = {.rank = fuzz_u8(&in) % n, .size = n};
  snprintf(win.name, sizeof win.name, "fuzz");
  win_hello_t *hellos = malloc((size_t)n * sizeof *hellos);
  win_header_t *h = malloc(sizeof *h);
  win.off = calloc((size_t)n, sizeof *win.off);
  win.bytes = calloc((size_t)n, sizeof *win.bytes);
  if (!hellos || !h || !win.off || !win.bytes) abort();
  fuzz_take(&in, hellos, (size_t)n * sizeof *hellos);
  fuzz_take(&in, h, sizeof *h);
  const size_t mapped = (size_t)fuzz_u64(&in);
  tcc_err_t err = {TCC_OK, {0}};
  if (tcc__window_check_hellos(&win, hellos, &err) == TCC_OK) {
    tcc__window_layout(&win, hellos);
    /* The layout must not have wrapped: each buffer lies inside the total. */
    for (int r = 0; r < n; r++) assert(win.off[r] + win.bytes[r] <= win.total);
    if (tcc__window_check_header(&win, h, mapped, "fuzz", &err) == TCC_OK) assert(mapped == win.total);
  }
  free(win.off);
  free(win.bytes);
  free(h);
  free(hellos);
  return 0;
}
