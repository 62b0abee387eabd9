"""bench/bench_mpi.py adds Open MPI to the benchmark as an optional peer:
rows in bench_collectives.py's CSV with backend "openmpi", measured in the
same ranks as the torch.distributed backends.

With Open MPI's mpirun and mpi4py installed, a 2-rank job at two tiny sizes
must write one verified row per (op, size) whose figures follow the
nccl-tests formulas, and next to gloo every point is timed on both in the
same run; without them those tests skip, naming what is missing.
The "not available" path (one line, then the run goes on without Open MPI)
is tested everywhere by hiding mpirun and mpi4py. No timing is asserted.
"""

import csv
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPT = os.path.join(BENCH, "bench_mpi.py")
COLLECTIVES = os.path.join(BENCH, "bench_collectives.py")
sys.path.insert(0, BENCH)
import bench_mpi  # noqa: E402  (imports no torch and no MPI)

MISSING = bench_mpi.missing()
needs_mpi = pytest.mark.skipif(MISSING is not None, reason=f"Open MPI not available: {MISSING}")

# nccl-tests' bus bandwidth factors, written out again rather than imported:
# the rows must follow the formula, not merely the script's own table.
FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
TINY = ["--warmup", "1", "--time-per-point", "0.01", "--samples", "3"]


def _run(cmd, env=None, timeout=300):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=ROOT, env=env, timeout=timeout)
    return proc.returncode, proc.stdout


def _rows(out_dir, pattern):
    paths = glob.glob(os.path.join(out_dir, pattern))
    assert len(paths) == 1, paths
    with open(paths[0], newline="") as f:
        return list(csv.DictReader(f))


def _check_row(r, world, dtype):
    assert r["backend"] == "openmpi"
    assert int(r["world"]) == world
    assert r["dtype"] == dtype
    assert r["verified"] == "True"
    assert int(r["samples"]) == 3 and int(r["iters"]) >= 1
    nbytes, t = int(r["bytes"]), float(r["time_us"])
    assert int(r["count"]) * {"float32": 4, "bfloat16": 2}[dtype] == nbytes
    assert 0 < float(r["time_min_us"]) <= t <= float(r["time_max_us"])
    algbw = float(r["algbw_GBps"])
    assert algbw == pytest.approx(nbytes / t / 1e3, rel=1e-9)  # bytes / (us * 1e-6) / 1e9
    assert float(r["busbw_GBps"]) == pytest.approx(algbw * FACTOR[r["op"]](world), rel=1e-9)


@needs_mpi
def test_two_ranks_two_sizes(tmp_path):
    code, out = _run([sys.executable, SCRIPT, "--worlds", "2", "--min-bytes", "8",
                      "--max-bytes", "16", "--out-dir", str(tmp_path)] + TINY)
    assert code == 0, out
    assert "btl self,vader" in out, out
    rows = _rows(str(tmp_path), "bench_*.csv")
    assert sorted((r["op"], int(r["bytes"])) for r in rows) == sorted(
        (op, size) for op in FACTOR for size in (8, 16)), out
    for r in rows:
        _check_row(r, 2, "float32")


@needs_mpi
def test_16_bit_sums_are_not_available(tmp_path):
    """bfloat16 moves as raw 16-bit words (verified); Open MPI cannot sum it,
    which is said, not measured on another type."""
    code, out = _run([sys.executable, SCRIPT, "--worlds", "2", "--dtype", "bfloat16",
                      "--ops", "allreduce,allgather", "--min-bytes", "8", "--max-bytes", "16",
                      "--out-dir", str(tmp_path)] + TINY)
    assert code == 0, out
    assert "allreduce       openmpi: not available in bfloat16" in out, out
    rows = _rows(str(tmp_path), "bench_*.csv")
    assert sorted((r["op"], int(r["bytes"])) for r in rows) == [("allgather", 8), ("allgather", 16)]
    for r in rows:
        _check_row(r, 2, "bfloat16")


@needs_mpi
def test_open_mpi_beside_gloo_in_the_same_ranks(tmp_path):
    """With gloo and openmpi, one mpirun job runs both: each point's line
    carries both backends' times, and the CSV a verified row of each."""
    code, out = _run([sys.executable, COLLECTIVES, "--backends", "gloo,openmpi", "--worlds", "2",
                      "--ops", "allgather,alltoall", "--min-bytes", "64", "--max-bytes", "128",
                      "--out-dir", str(tmp_path)] + TINY)
    assert code == 0, out
    assert re.search(r"-- 2 ranks under mpirun: mpirun \(Open MPI\) .*btl self,vader", out), out
    points = re.findall(r"n=2 (\w+) +(\d+) B  gloo: .* us .*  openmpi: .* us .*  ratio", out)
    assert sorted(points) == [(op, size) for op in ("allgather", "alltoall") for size in ("128", "64")], out
    rows = _rows(str(tmp_path), "bench_*.csv")
    assert sorted((r["backend"], r["op"], int(r["bytes"])) for r in rows) == sorted(
        (b, op, size) for b in ("gloo", "openmpi") for op in ("allgather", "alltoall") for size in (64, 128))
    for r in rows:
        if r["backend"] == "openmpi":
            _check_row(r, 2, "float32")


def _without_mpi(tmp_path):
    """An environment with no mpirun on PATH and an mpi4py that cannot be imported."""
    empty = tmp_path / "bin"
    empty.mkdir()
    fake = tmp_path / "site" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    return dict(os.environ, PATH=str(empty), PYTHONPATH=str(tmp_path / "site"))


def test_missing_mpi_is_one_line(tmp_path):
    code, out = _run([sys.executable, SCRIPT, "--out-dir", str(tmp_path / "out")],
                     env=_without_mpi(tmp_path), timeout=60)
    assert code == 2, out
    assert out.count("\n") == 1 and out.startswith("openmpi: not available ("), out
    assert "mpi4py is not installed" in out and "mpirun is not on PATH" in out, out
    assert not (tmp_path / "out").exists()


def test_bench_collectives_goes_on_without_mpi(tmp_path):
    """--backends gloo,openmpi without Open MPI: one line, then gloo alone."""
    code, out = _run([sys.executable, COLLECTIVES, "--backends", "gloo,openmpi", "--worlds", "2",
                      "--ops", "allreduce", "--min-bytes", "8", "--max-bytes", "8",
                      "--out-dir", str(tmp_path / "out")] + TINY, env=_without_mpi(tmp_path))
    assert code == 0, out
    lines = [line for line in out.splitlines() if "openmpi" in line]
    assert len(lines) == 1 and lines[0].startswith("openmpi: not available ("), out
    assert lines[0].endswith("going on without it"), out
    rows = _rows(str(tmp_path / "out"), "bench_*.csv")
    assert [(r["backend"], r["op"], r["bytes"]) for r in rows] == [("gloo", "allreduce", "8")]
    # The shared-memcpy reference: the line it prints, and busbw as a fraction of it.
    m = re.search(r"memcpy bandwidth of each of 2 processes copying at once: ([0-9.]+) GB/s", out)
    assert m and float(m.group(1)) > 0, out
    shared = float(rows[0]["busbw_GBps"]) / float(rows[0]["busbw_fraction_of_shared_memcpy"])
    assert abs(shared - float(m.group(1))) < 0.01, (shared, out)


NO_MPICC = [tool for tool in ("mpicc", "mpirun") if not shutil.which(tool)]
needs_mpicc = pytest.mark.skipif(
    bool(NO_MPICC), reason=f"Open MPI's {' and '.join(NO_MPICC)} not on PATH (apt-get install openmpi-bin libopenmpi-dev)")


@needs_mpicc
@pytest.mark.parametrize("op,transport,btl,extra", [("allreduce", "tcp", "self,tcp", []),
                                                    ("allgather", "shm", "self,vader", []),
                                                    ("reduce_scatter", "shm", "self,vader", []),
                                                    ("reduce", "shm", "self,vader", ["fresh"]),
                                                    ("broadcast", "shm", "self,vader", ["cold"]),
                                                    ("scatter", "tcp", "self,tcp", []),
                                                    ("gather", "shm", "self,vader", ["handles"]),
                                                    ("pingpong", "shm", "self,vader", ["handles"]),
                                                    ("pingpong", "tcp", "self,tcp", [])])
def test_core_against_open_mpi_in_the_same_processes(op, transport, btl, extra):
    """csrc/c_core/tests/bench_mpi_pair.c: one line per size, both medians
    (`fresh`: inputs written again before every call; `cold`: 2 MiB through
    the caches before every call; `handles`: the core's ops issued, waited
    for and released instead of blocking calls)."""
    core = os.path.join(ROOT, "csrc", "c_core")
    code, out = _run(["make", "-s", "-C", core, "build/bench_mpi_pair"])
    assert code == 0, out
    code, out = _run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "--bind-to", "none",
                      "--mca", "pml", "ob1", "--mca", "btl", btl,
                      os.path.join(core, "build", "bench_mpi_pair"), op, "64", "256", "3", transport, *extra])
    assert code == 0, out
    lines = re.findall(rf"^{op} (\d+) B, 2 ranks, {transport}: openmpi ([0-9.]+) us, core ([0-9.]+) us, "
                       r"openmpi / core ([0-9.]+) \(quartiles [0-9.]+ \.\. [0-9.]+\); memcpy ([0-9.]+) GB/s$", out, re.M)
    assert [int(b) for b, *_ in lines] == [64, 256], out
    assert all(float(m) > 0 and float(c) > 0 and float(g) > 0 for _, m, c, _, g in lines), out
