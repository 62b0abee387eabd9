"""csrc/c_core/tests/bench_handoff.c runs end to end: the stage exchange and
rings of several depths, 2 and 3 ranks, and it refuses arguments it cannot
use. Each receiver checks every payload it reads and aborts on a wrong one
(a ring of depth 1 or 3 wraps around every op or every third, so its root
waits for the receivers' consumption all the time); figures are not judged
here."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "c_core")
EXE = os.path.join(CORE, "build", "bench_handoff")


@pytest.fixture(scope="module")
def bench_handoff():
    subprocess.run(["make", "-s", "-C", CORE, "build/bench_handoff"], check=True, timeout=600)
    return EXE


@pytest.mark.parametrize("ranks,depth", [(2, 0), (3, 0), (2, 1), (3, 3), (2, 32)])
def test_protocol_runs_and_checks(bench_handoff, ranks, depth):
    proc = subprocess.run([bench_handoff, str(ranks), str(depth), "3000"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    protocol = "exchange" if depth == 0 else f"ring {depth}"
    m = re.fullmatch(rf"handoff {protocol}, {ranks} ranks: median ([0-9.]+) us per op "
                     r"\(batches ([0-9.]+) \.\. ([0-9.]+)\)\n", proc.stdout)
    assert m, proc.stdout
    median, lo, hi = (float(g) for g in m.groups())
    assert 0 < lo <= median <= hi, proc.stdout


@pytest.mark.parametrize("args", [["1"], ["17"], ["2", "-1"], ["2", "1025"], ["2", "4", "0"]])
def test_refuses_bad_arguments(bench_handoff, args):
    proc = subprocess.run([bench_handoff, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage: bench_handoff" in proc.stderr
