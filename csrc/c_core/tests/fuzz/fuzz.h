/*
 * fuzz.h - reading a fuzz input as a sequence of fields. A field past the
 * end of the input reads as zeros, so every input, however short, drives
 * the code under test with some well-defined values.
 */
#ifndef TCC_FUZZ_H
#define TCC_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct fuzz_in {
  const uint8_t *p;
  size_t left;
} fuzz_in_t;

/* Copies the next len bytes into out, zero-filling what the input lacks. */
static inline void fuzz_take(fuzz_in_t *in, void *out, size_t len) {
  size_t k = len < in->left ? len : in->left;
  if (k) memcpy(out, in->p, k);
  memset((uint8_t *)out + k, 0, len - k);
  in->p += k;
  in->left -= k;
}

static inline uint8_t fuzz_u8(fuzz_in_t *in) {
  uint8_t v;
  fuzz_take(in, &v, 1);
  return v;
}

static inline uint64_t fuzz_u64(fuzz_in_t *in) {
  uint64_t v;
  fuzz_take(in, &v, sizeof v);
  return v;
}

#endif /* TCC_FUZZ_H */
