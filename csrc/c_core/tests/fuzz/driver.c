/*
 * driver.c - runs one fuzz target (LLVMFuzzerTestOneInput) where libFuzzer
 * is not available: replays a corpus, then feeds seeded random mutations of
 * it for a bounded time. Meant to be built with AddressSanitizer and UBSan,
 * which turn any out-of-bounds access or undefined behaviour into an abort;
 * the input that caused it is written out first (see save_crash).
 *
 *   driver [-s seconds] [-r seed] [-n max_execs] [-o crash_file] path...
 *
 * Each path is a corpus file or a directory of them. Deterministic for a
 * given seed and execution count.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fuzz.h"

#define MAX_ENTRIES 512
#define INPUT_CAP (128u << 10)

void __sanitizer_set_death_callback(void (*callback)(void));

typedef struct entry {
  uint8_t *data;
  size_t size;
} entry_t;

static entry_t corpus[MAX_ENTRIES];
static int ncorpus;
static const uint8_t *current;
static size_t current_size;
static const char *crash_path = "fuzz-crash.bin";
static uint64_t rng_state;

/* xorshift64*: small, fast and the same on every platform. */
static uint64_t rnd(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ULL;
}
static size_t below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

/* Called by the sanitizers just before they abort. */
static void save_crash(void) {
  FILE *f = fopen(crash_path, "wb");
  if (!f) return;
  if (current_size) fwrite(current, 1, current_size, f);
  fclose(f);
  fprintf(stderr, "fuzz driver: the failing input (%zu bytes) is in %s\n", current_size, crash_path);
}

static void add_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f || ncorpus == MAX_ENTRIES) {
    if (f) fclose(f);
    return;
  }
  uint8_t *buf = malloc(INPUT_CAP);
  size_t n = buf ? fread(buf, 1, INPUT_CAP, f) : 0;
  fclose(f);
  if (!buf) return;
  corpus[ncorpus++] = (entry_t){buf, n};
}

static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

static void add_path(const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) return;
  if (!S_ISDIR(sb.st_mode)) {
    add_file(path);
    return;
  }
  struct dirent **names;
  int k = scandir(path, &names, NULL, by_name); /* sorted: the same order everywhere */
  for (int i = 0; i < k; i++) {
    char full[4096];
    if (names[i]->d_name[0] != '.') {
      snprintf(full, sizeof full, "%s/%s", path, names[i]->d_name);
      add_file(full);
    }
    free(names[i]);
  }
  if (k >= 0) free(names);
}

/* Runs one input from a buffer of exactly its size, so a read past its
 * end is caught. */
static void run_one(const uint8_t *data, size_t size) {
  uint8_t *copy = malloc(size ? size : 1);
  if (!copy) abort();
  if (size) memcpy(copy, data, size);
  current = copy;
  current_size = size;
  LLVMFuzzerTestOneInput(copy, size);
  current = NULL;
  free(copy);
}

/* Values that sit on the edges of the checks: zero, one, signs, maxima. */
static const uint64_t interesting[] = {0, 1, 2, 0x7f, 0x80, 0xff, 0x100, 0x7fff, 0xffff, 0x1000,
                                       0x7fffffff, 0x80000000u, 0xffffffffu, 0x100000000ULL,
                                       0x7fffffffffffffffULL, 0x8000000000000000ULL, UINT64_MAX};

static void mutate_once(uint8_t *buf, size_t *size) {
  size_t n = *size;
  switch (rnd() % 7) {
  case 0: /* flip a bit */
    if (n) buf[below(n)] ^= (uint8_t)(1u << (rnd() % 8));
    break;
  case 1: /* set a byte */
    if (n) buf[below(n)] = (uint8_t)rnd();
    break;
  case 2: { /* an interesting 1, 2, 4 or 8 byte value */
    size_t w = (size_t)1 << (rnd() % 4);
    if (n < w) break;
    uint64_t v = interesting[below(sizeof interesting / sizeof interesting[0])];
    if (rnd() & 1) v = ~v + 1 + (rnd() % 3) - 1; /* near the negative too */
    memcpy(buf + below(n - w + 1), &v, w);
    break;
  }
  case 3: /* truncate */
    *size = below(n + 1);
    break;
  case 4: { /* extend with random bytes */
    size_t add = 1 + below(64);
    if (n + add > INPUT_CAP) break;
    for (size_t i = 0; i < add; i++) buf[n + i] = (uint8_t)rnd();
    *size = n + add;
    break;
  }
  case 5: { /* splice: our prefix, another entry's suffix */
    const entry_t *o = &corpus[below((size_t)ncorpus)];
    size_t cut = below(n + 1), from = below(o->size + 1), tail = o->size - from;
    if (cut + tail > INPUT_CAP) break;
    memcpy(buf + cut, o->data + from, tail);
    *size = cut + tail;
    break;
  }
  default: { /* copy a run of bytes within the input */
    if (n < 2) break;
    size_t len = 1 + below(n / 2), src = below(n - len + 1), dst = below(n - len + 1);
    memmove(buf + dst, buf + src, len);
    break;
  }
  }
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
  double seconds = 10;
  uint64_t seed = 1, max_execs = UINT64_MAX;
  int opt;
  while ((opt = getopt(argc, argv, "s:r:n:o:")) != -1) {
    if (opt == 's') seconds = atof(optarg);
    else if (opt == 'r') seed = strtoull(optarg, NULL, 0);
    else if (opt == 'n') max_execs = strtoull(optarg, NULL, 0);
    else if (opt == 'o') crash_path = optarg;
    else return fprintf(stderr, "usage: %s [-s seconds] [-r seed] [-n max_execs] [-o crash_file] path...\n", argv[0]), 2;
  }
  for (int i = optind; i < argc; i++) add_path(argv[i]);
  if (ncorpus == 0) corpus[ncorpus++] = (entry_t){calloc(1, 1), 0};
  __sanitizer_set_death_callback(save_crash);
  rng_state = seed * 0x9e3779b97f4a7c15ULL + 1;

  for (int i = 0; i < ncorpus; i++) run_one(corpus[i].data, corpus[i].size);
  uint8_t *buf = malloc(INPUT_CAP);
  if (!buf) abort();
  const double start = now_s();
  uint64_t execs = 0;
  while (execs < max_execs && ((execs & 255) || now_s() - start < seconds)) {
    const entry_t *e = &corpus[below((size_t)ncorpus)];
    size_t size = e->size;
    memcpy(buf, e->data, size);
    for (int k = 1 + (int)(rnd() % 4); k > 0; k--) mutate_once(buf, &size);
    run_one(buf, size);
    execs++;
  }
  const double took = now_s() - start;
  printf("%s: %d corpus inputs replayed, %llu mutated executions in %.1f s (%.0f/s), seed %llu: no crash\n",
         argv[0], ncorpus, (unsigned long long)execs, took, took > 0 ? (double)execs / took : 0.0,
         (unsigned long long)seed);
  free(buf);
  return 0;
}
