/*
 * bench_median.h - the median of a benchmark's batch timings (sorts v).
 */
#ifndef TCC_TESTS_BENCH_MEDIAN_H
#define TCC_TESTS_BENCH_MEDIAN_H

static double median(double *v, int n) {
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
      double t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return v[n / 2];
}

#endif /* TCC_TESTS_BENCH_MEDIAN_H */
