"""csrc/c_core/tests/bench_sizes.c runs end to end: every op it times, over
shared memory and TCP, in place for all_reduce, on huge pages, in bfloat16
and float16, prints one line per size,
and it refuses what it does not know. The program checks every result
itself and stops at a wrong one; figures are not judged here."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "c_core")
EXE = os.path.join(CORE, "build", "bench_sizes")


@pytest.fixture(scope="module")
def bench_sizes():
    subprocess.run(["make", "-s", "-C", CORE, "build/bench_sizes"], check=True, timeout=600)
    return EXE


@pytest.mark.parametrize("ranks,transport,op,extra", [
    (2, "shm", "allreduce", []),
    (2, "shm", "allreduce", ["in-place"]),
    (3, "shm", "allgather", []),
    (3, "shm", "alltoall", []),
    (2, "shm", "broadcast", []),
    (3, "shm", "reduce_scatter", []),
    (2, "tcp", "allreduce", []),
    (2, "shm", "allreduce", ["bfloat16"]),
    (3, "shm", "reduce_scatter", ["float16"]),
    (2, "tcp", "allreduce", ["in-place", "bfloat16"]),
])
def test_each_size_is_timed(bench_sizes, ranks, transport, op, extra):
    # 12 KiB, 24 KiB, 48 KiB: below and above the single-copy size.
    proc = subprocess.run([bench_sizes, str(ranks), transport, op, "12K", "48K", *extra], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = op + (" in place" if "in-place" in extra else "")
    dtype = "".join(f", {x}" for x in extra if x.endswith("float16"))
    lines = proc.stdout.splitlines()
    sizes = []
    for line in lines:
        m = re.fullmatch(rf"{name} (\d+) B, {ranks} ranks, {transport}{dtype}: ([0-9.]+) us", line)
        assert m, line
        assert float(m.group(2)) > 0, line
        sizes.append(int(m.group(1)))
    assert sizes == [12 << 10, 24 << 10, 48 << 10], lines


def test_huge_pages(bench_sizes):
    """Buffers on huge pages where the kernel grants them: each size is still
    timed and checked, and the line says how much of rank 0's memory they got
    (a number of kB, or -1 where /proc cannot say)."""
    proc = subprocess.run([bench_sizes, "2", "shm", "alltoall", "2M", "4M", "huge-pages"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sizes = []
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"alltoall (\d+) B, 2 ranks, shm, huge pages \((-?\d+) kB of rank 0's\): ([0-9.]+) us", line)
        assert m, line
        assert float(m.group(3)) > 0, line
        sizes.append(int(m.group(1)))
    assert sizes == [2 << 20, 4 << 20], proc.stdout


@pytest.mark.parametrize("args", [["2", "shm", "gather"], ["2", "udp"], ["2", "shm", "allgather", "64K", "1K"],
                                  ["2", "shm", "allgather", "1K", "2K", "in-place"],
                                  ["2", "shm", "allgather", "1K", "2K", "huge"],
                                  ["2", "shm", "allreduce", "1K", "2K", "float64"]])
def test_refuses_what_it_does_not_know(bench_sizes, args):
    proc = subprocess.run([bench_sizes, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: bench_sizes" in proc.stderr, proc.stdout + proc.stderr
