"""bench/bench_layers.py runs end to end: every layer of a small all_reduce
(the C core, the TorchComm API, the functional op + wait_tensor, eager c10d
and the same call without torch's Python wrapper and without its dispatcher,
gloo, and torch's own floor for funcol's two op calls) is timed, checked by the benchmark itself, and reported in the table
and the CSV, quiet, with a core kept busy by another process (--busy) and
with both ranks confined to one CPU (--cpus 1);
and the same for send/recv round trips (--op p2p), whose layers have no
functional op.
A smoke run with few calls: figures are not judged here."""

import csv
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


import pytest


LAYERS = {
    "allreduce": ["core", "torchcomm", "funcol", "c10d", "pg", "backend", "gloo", "floor"],
    "p2p": ["core", "torchcomm", "c10d", "pg", "backend", "gloo"],
}


@pytest.mark.parametrize("op,busy,cpus,cold", [("allreduce", 0, 0, 0), ("allreduce", 1, 0, 0), ("allreduce", 0, 1, 0),
                                               ("p2p", 0, 0, 0), ("allreduce", 0, 0, 1 << 20)])
def test_every_layer_is_measured_and_reported(op, busy, cpus, cold):
    with tempfile.TemporaryDirectory() as tmp:
        out_csv = os.path.join(tmp, "layers.csv")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_layers.py"), "--calls", "200",
                               "--csv", out_csv, "--busy", str(busy), "--op", op, "--cpus", str(cpus),
                               "--cold", "1M" if cold else "0"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out_csv) as f:
            rows = list(csv.DictReader(f))
    layers = [r["layer"] for r in rows]
    assert layers == LAYERS[op], layers
    assert ("round trip" in proc.stdout.splitlines()[0]) == (op == "p2p"), proc.stdout
    core = float(rows[0]["us_per_call"])
    for r in rows:
        assert r["op"] == op and r["world"] == "2" and r["busy"] == str(busy) and float(r["us_per_call"]) > 0, r
        assert r["cpus"] == str(cpus or len(os.sched_getaffinity(0))), r
        assert r["cold_bytes"] == str(cold), r
        assert abs(float(r["us_above_core"]) - (float(r["us_per_call"]) - core)) < 1e-2, r
        # The C program's row has no process counts, nor has a cold run.
        if r["layer"] == "core" or cold:
            assert r["cpu_us_per_call"] == "" and r["switches_per_call"] == "", r
        else:
            assert float(r["cpu_us_per_call"]) > 0 and float(r["switches_per_call"]) >= 0, r
    assert (f"{cold} bytes through the caches before each call" in proc.stdout) == bool(cold), proc.stdout
    assert ("core(s) kept busy" in proc.stdout) == bool(busy), proc.stdout
    assert f"on {cpus or len(os.sched_getaffinity(0))} CPU(s)" in proc.stdout.splitlines()[0], proc.stdout
    for layer in layers:
        assert any(line.startswith(layer) for line in proc.stdout.splitlines()), (layer, proc.stdout)
