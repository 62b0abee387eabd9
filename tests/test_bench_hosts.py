"""bench/bench_hosts.py across simulated hosts of different rank counts
(2 + 1): a short sweep of all_gather and reduce_scatter, tccomm and gloo in
the same run, every point verified by the workers (bench_collectives.py)
before it is timed. A world of 3 ranks divides no power-of-two message, so
each point runs the largest multiple of 3 elements below it. Skips, saying
why, where namespaces cannot be created."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys

import pytest

import _netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def namespaces_or_skip() -> None:
    c = _netns.Cluster(2)
    try:
        c.start()
    except _netns.NamespaceUnavailable as e:
        pytest.skip(f"cannot simulate hosts here: {e}")
    finally:
        c.close()


def test_uneven_hosts_sweep(tmp_path):
    namespaces_or_skip()
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_hosts.py"), "--per-host", "2,1", "--rate", "10gbit",
           "--ops", "allgather,reduce_scatter", "--min-bytes", "1M", "--max-bytes", "4M", "--warmup", "1",
           "--time-per-point", "0.05", "--samples", "2", "--backends", "tccomm,gloo", "--out-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "hosts of 2 + 1 ranks" in out.stdout, out.stdout[-2000:]
    [path] = glob.glob(str(tmp_path / "hosts2+1_*.csv"))
    rows = list(csv.DictReader(open(path)))
    points = {(r["backend"], r["op"], int(r["bytes"])) for r in rows if r["verified"] == "True"}
    for nominal in (1 << 20, 2 << 20, 4 << 20):
        actual = nominal // 4 // 3 * 3 * 4  # float32, a multiple of 3 ranks
        for backend in ("tccomm", "gloo"):
            for op in ("allgather", "reduce_scatter"):
                assert (backend, op, actual) in points, f"{backend} {op} of {actual} B missing: {sorted(points)}"
