"""bench_collectives.py --rounds: each world size's sweep repeated one op at
a time, every peer in the same job (Open MPI too), and each point reported
as the median of its rounds' medians.

The combination is checked on made-up rows against figures worked out here;
a run with 2 rounds must print the rounds in the documented order and write
the median of the figures it printed for each round. No timing is asserted.
"""

import csv
import glob
import os
import re
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
COLLECTIVES = os.path.join(BENCH, "bench_collectives.py")
sys.path.insert(0, BENCH)
import bench_collectives  # noqa: E402  (imports no torch at module level)
import bench_mpi  # noqa: E402

MISSING = bench_mpi.missing()
TINY = ["--warmup", "1", "--time-per-point", "0.01", "--samples", "3"]


def _row(round_, time_us, op="allgather", nbytes=1 << 20, world=4, backend="tccomm"):
    return {"world": world, "backend": backend, "device": "cpu", "op": op, "bytes": nbytes,
            "count": nbytes // 4, "dtype": "float32", "iters": 10, "samples": 5, "time_us": time_us,
            "time_min_us": time_us * 0.9, "time_max_us": time_us * 1.2, "spread_pct": 30.0,
            "verified": True, "algbw_GBps": 0.0, "busbw_GBps": 0.0, "round": round_}


def test_combine_takes_the_median_of_the_rounds():
    rows = [_row(0, 300.0), _row(1, 100.0), _row(2, 140.0),
            _row(0, 50.0, op="broadcast", nbytes=8, backend="gloo")]
    combined = bench_collectives.combine_rounds(rows)
    by_op = {r["op"]: r for r in combined}
    assert len(combined) == 2
    ag = by_op["allgather"]
    assert ag["rounds"] == 3 and "round" not in ag
    assert (ag["time_us"], ag["time_min_us"], ag["time_max_us"]) == (140.0, 100.0, 300.0)  # not the mean, 180
    assert ag["spread_pct"] == pytest.approx(200 / 1.4)  # (300 - 100) / 140, in percent
    # 1 MiB in 140 us; allgather's bus factor at 4 ranks is 3/4.
    assert ag["algbw_GBps"] == pytest.approx((1 << 20) / 140e-6 / 1e9)
    assert ag["busbw_GBps"] == pytest.approx(ag["algbw_GBps"] * 0.75)
    # A point measured in one round keeps its own batches' figures.
    bc = by_op["broadcast"]
    assert bc["rounds"] == 1 and bc["time_us"] == 50.0 and bc["spread_pct"] == 30.0


def _run(args, timeout=300):
    proc = subprocess.run([sys.executable, COLLECTIVES] + args, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=timeout)
    return proc.returncode, proc.stdout


def _printed_times(out, backend):
    """{(op, size text): [us of each round]} from the per-point lines."""
    got = {}
    for m in re.finditer(rf"n=2 (\w+) +([0-9]+ \w+) .*?{backend}: +([0-9.]+) us", out):
        got.setdefault((m.group(1), m.group(2)), []).append(float(m.group(3)))
    return got


def _check_rounds(out_dir, out, backends):
    paths = glob.glob(os.path.join(out_dir, "bench_*.csv"))
    assert len(paths) == 1, (paths, out)
    with open(paths[0], newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["backend"], r["op"]) for r in rows) == sorted(
        (b, op) for b in backends for op in ("allreduce", "broadcast")), out
    for r in rows:
        assert r["rounds"] == "2", r
        printed = _printed_times(out, r["backend"])[(r["op"], "8 B")]
        assert len(printed) == 2, (printed, out)
        # The median of two rounds is their mean; the lines print 0.1 us.
        assert float(r["time_us"]) == pytest.approx(statistics.median(printed), abs=0.06), (r, out)
        assert float(r["time_min_us"]) <= float(r["time_us"]) <= float(r["time_max_us"])


def test_two_rounds_of_one_backend(tmp_path):
    code, out = _run(["--backends", "gloo", "--worlds", "2", "--ops", "allreduce,broadcast",
                      "--min-bytes", "8", "--max-bytes", "8", "--rounds", "2",
                      "--out-dir", str(tmp_path)] + TINY)
    assert code == 0, out
    order = re.findall(r"-- round (\d)/2, (\w+): (.*)", out)
    assert order == [("1", "allreduce", "gloo"), ("1", "broadcast", "gloo"),
                     ("2", "allreduce", "gloo"), ("2", "broadcast", "gloo")], out
    _check_rounds(str(tmp_path), out, ["gloo"])


@pytest.mark.skipif(MISSING is not None, reason=f"Open MPI not available: {MISSING}")
def test_rounds_run_open_mpi_in_the_same_job(tmp_path):
    """Open MPI is measured in the ranks of the torch.distributed backends:
    one job per op and round, in round order."""
    code, out = _run(["--backends", "gloo,openmpi", "--worlds", "2", "--ops", "allreduce,broadcast",
                      "--min-bytes", "8", "--max-bytes", "8", "--rounds", "2",
                      "--out-dir", str(tmp_path)] + TINY)
    assert code == 0, out
    order = re.findall(r"-- round (\d)/2, (\w+): (.*)", out)
    assert order == [(k, op, "gloo,openmpi") for k in ("1", "2") for op in ("allreduce", "broadcast")], out
    assert out.count("-- 2 ranks under mpirun") == 4, out
    _check_rounds(str(tmp_path), out, ["gloo", "openmpi"])


def test_rounds_must_be_positive(tmp_path):
    code, out = _run(["--rounds", "0", "--out-dir", str(tmp_path)], timeout=60)
    assert code == 2 and "--rounds must be at least 1" in out, out
