"""bench/bench_stability.py runs end to end with either barrier between the
timed calls: every run's line per size, its figures consistent with each
other (spread and slowest call against the median, from the median, minimum
and maximum it printed), the summary naming the barrier and every run's
median. The benchmark checks the all_reduces' results itself and exits
non-zero on a wrong one. A smoke run with few calls: no timing is judged.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench_stability.py")

RUN_LINE = re.compile(r"run (\d+): +(\d+ [KM]iB) +median +([\d.]+) ms +min +([\d.]+) +max +([\d.]+) +"
                      r"spread +([\d.]+)% +slowest ([\d.]+)x")


@pytest.mark.parametrize("barrier", ["tccomm", "gloo"])
def test_each_run_and_size_is_reported(barrier):
    proc = subprocess.run([sys.executable, BENCH, "--runs", "2", "--sizes", "1M,4M", "--calls", "4",
                           "--barrier", barrier], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [m.groups() for m in map(RUN_LINE.match, proc.stdout.splitlines()) if m]
    assert sorted((r[0], r[1]) for r in runs) == sorted((str(k), s) for k in (1, 2) for s in ("1 MiB", "4 MiB")), \
        proc.stdout
    for _, _, med, lo, hi, spread, slowest in runs:
        med, lo, hi, spread, slowest = map(float, (med, lo, hi, spread, slowest))
        assert 0 < lo <= med <= hi, proc.stdout
        # Printed rounded: compare with the rounding's slack.
        assert spread == pytest.approx((hi - lo) / med * 100, rel=0.05, abs=1.0), proc.stdout
        assert slowest == pytest.approx(hi / med, rel=0.05, abs=0.02), proc.stdout
    assert f"2 ranks, 4 calls per run, 2 runs, {barrier} barrier between calls:" in proc.stdout
    for size in ("1 MiB", "4 MiB"):
        medians = [float(r[2]) for r in runs if r[1] == size]
        summary = next(line for line in proc.stdout.splitlines() if line.strip().startswith(f"{size}: run medians"))
        assert [float(x) for x in re.findall(r"[\d.]+", summary.split("run medians")[1].split("ms")[0])] == \
            pytest.approx(medians, abs=0.001), summary


def test_an_unknown_barrier_is_refused():
    proc = subprocess.run([sys.executable, BENCH, "--barrier", "mpi", "--runs", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "invalid choice: 'mpi'" in proc.stderr, proc.stderr[-2000:]
