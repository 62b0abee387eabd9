"""bench/bench_p2p.py runs end to end: send/recv round trips through tccomm
over shared memory and over TCP and through gloo, and the C core's own
8 B round trip over both transports, each payload checked by
the benchmark itself, reported in the table and the CSV. A smoke run with
few round trips: figures are not judged here."""

import csv
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_backend_and_size_is_measured_and_reported():
    with tempfile.TemporaryDirectory() as tmp:
        out_csv = os.path.join(tmp, "p2p.csv")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_p2p.py"), "--calls", "100",
                               "--sizes", "8,70000", "--csv", out_csv], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out_csv) as f:
            rows = list(csv.DictReader(f))
    got = [(r["backend"], r["bytes"]) for r in rows]
    want = [(b, s) for b in ("tccomm-shm", "gloo", "tccomm-tcp") for s in ("8", "70000")]
    want += [("core-shm", "8"), ("core-tcp", "8")]  # the C program: 8 B only
    assert sorted(got) == sorted(want), got
    assert all(float(r["us_round_trip"]) > 0 for r in rows), rows
    for backend in ("tccomm-shm", "tccomm-tcp", "gloo", "core-shm", "core-tcp"):
        assert any(line.startswith(backend) for line in proc.stdout.splitlines()), (backend, proc.stdout)
