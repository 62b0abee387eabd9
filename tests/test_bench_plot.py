"""bench/plot_results.py turns a bench_collectives.py CSV into PNGs (busbw and
time against size, one line per backend), from the command line too."""

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "plot_results.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load():
    spec = importlib.util.spec_from_file_location("plot_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_results = _load()
needs_matplotlib = pytest.mark.skipif(
    plot_results.matplotlib_missing() is not None,
    reason=f"no plots to test: {plot_results.matplotlib_missing()}")


def _synthetic_csv(path):
    """A tiny CSV in bench_collectives.py's format: 2 world sizes, 2 ops, three
    backends (any backend in the CSV gets a line), and a host-time row that
    must be left out of the plots."""
    fields = ["world", "backend", "op", "bytes", "count", "dtype", "iters", "samples", "time_us",
              "time_min_us", "time_max_us", "spread_pct", "verified", "algbw_GBps", "busbw_GBps",
              "busbw_fraction_of_memcpy"]
    memcpy = 10.0
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for world in (2, 4):
            for k, backend in enumerate(("tccomm", "gloo", "other")):
                for op in ("allreduce", "broadcast"):
                    for nbytes in (8, 1024, 1 << 20):
                        t = 5.0 * (k + 1) + nbytes / 1e3
                        bw = nbytes / t / 1e3
                        w.writerow({"world": world, "backend": backend, "op": op, "bytes": nbytes,
                                    "count": nbytes // 4, "dtype": "float32", "iters": 10, "samples": 3,
                                    "time_us": t, "time_min_us": t, "time_max_us": t, "spread_pct": 0,
                                    "verified": True, "algbw_GBps": bw, "busbw_GBps": bw,
                                    "busbw_fraction_of_memcpy": bw / memcpy})
        w.writerow({"world": 1, "backend": "tccomm", "op": plot_results.HOST_OP, "bytes": 1024,
                    "count": 256, "dtype": "float32", "iters": 10, "samples": 3, "time_us": 3.0,
                    "time_min_us": 3.0, "time_max_us": 3.0, "spread_pct": 0, "verified": True,
                    "algbw_GBps": 0.3, "busbw_GBps": 0.3, "busbw_fraction_of_memcpy": 0.03})


def _assert_png(path):
    assert os.path.isfile(path), path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, f"{path} is not a PNG"
    assert os.path.getsize(path) > 5000, f"{path} is suspiciously small"


@needs_matplotlib
def test_plot_csv_writes_busbw_and_time_pngs(tmp_path):
    src = tmp_path / "bench_x.csv"
    _synthetic_csv(src)
    rows = plot_results.read_csv(str(src))
    assert plot_results.memcpy_from_rows(rows) == pytest.approx(10.0)
    paths = plot_results.plot_csv(str(src))
    assert paths == [str(tmp_path / "bench_x_busbw.png"), str(tmp_path / "bench_x_time.png")]
    for p in paths:
        _assert_png(p)


@needs_matplotlib
def test_command_line_out_dir(tmp_path):
    src = tmp_path / "bench_y.csv"
    _synthetic_csv(src)
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, SCRIPT, str(src), "--out-dir", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    for suffix in ("busbw", "time"):
        _assert_png(str(out / f"bench_y_{suffix}.png"))
        assert f"bench_y_{suffix}.png" in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["bench_y.csv", "plots"]  # nothing next to the CSV


@needs_matplotlib
def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError):
        plot_results.plot_rows([], str(tmp_path / "empty"))


def test_without_matplotlib_says_why(tmp_path):
    """Runs anywhere: matplotlib is hidden from the command line tool."""
    src = tmp_path / "bench_z.csv"
    _synthetic_csv(src)
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = [{SCRIPT!r}, {str(src)!r}]; runpy.run_path({SCRIPT!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert "no plots: matplotlib is not installed" in proc.stdout, proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["bench_z.csv"]
