"""bench/bench_offsets.py runs end to end: all_reduce and all_gather on
views a few bytes past a page boundary, tccomm and gloo, every result
checked by the benchmark itself, one table row and one CSV row per point,
ratios against offset 0. A smoke run with few calls: figures are not
judged here."""

import csv
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench_offsets.py")


def test_every_offset_is_measured_and_reported():
    with tempfile.TemporaryDirectory() as tmp:
        out_csv = os.path.join(tmp, "offsets.csv")
        proc = subprocess.run([sys.executable, BENCH, "--bytes", "64K", "--offsets", "0,16,4080", "--iters", "5",
                               "--samples", "2", "--csv", out_csv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out_csv) as f:
            rows = list(csv.DictReader(f))
    points = {(r["op"], r["offset"], r["backend"]) for r in rows}
    assert points == {(op, off, b) for op in ("all_reduce", "all_gather") for off in ("0", "16", "4080")
                      for b in ("tccomm", "gloo")}, points
    for r in rows:
        assert r["world"] == "2" and r["bytes"] == "65536" and float(r["us_per_call"]) > 0, r
        base = next(float(q["us_per_call"]) for q in rows
                    if (q["op"], q["offset"], q["backend"]) == (r["op"], "0", r["backend"]))
        assert abs(float(r["ratio_to_offset_0"]) - float(r["us_per_call"]) / base) < 1e-2, r
    table = [line.split() for line in proc.stdout.splitlines()]
    assert sum(1 for cells in table if cells and cells[0] in ("all_reduce", "all_gather")) == 6, proc.stdout


def test_offsets_that_are_not_whole_floats_are_refused():
    proc = subprocess.run([sys.executable, BENCH, "--offsets", "0,2", "--iters", "2", "--samples", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "multiples of 4 bytes" in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_unknown_op_is_refused():
    proc = subprocess.run([sys.executable, BENCH, "--ops", "all_reduce,scan"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "unknown op" in proc.stderr, proc.stderr
