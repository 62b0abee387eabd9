"""Plots a bench_collectives.py CSV: busbw and time against message size.

    python bench/plot_results.py bench/results/bench_<time>.csv [more.csv ...] [--out-dir DIR]

For each CSV writes two PNGs next to it (or into --out-dir):

    <name>_busbw.png   bus bandwidth (GB/s) against size
    <name>_time.png    time per operation (microseconds) against size

each a grid with one panel per (world size, op): a row per world size, a
column per op, one line per backend found in the CSV (the first backend of
the run solid, the others dashed), both axes logarithmic. The busbw panels
also show the single-core memcpy bandwidth the run measured (dotted), when
the CSV has it. bench_collectives.py calls the same code at the end of a run,
and so does bench_mpi.py (its CSVs, backend "openmpi", are plotted the same way).

Needs matplotlib (not a dependency of the tccomm package; scripts/setup_env.sh
installs it): without it nothing is plotted, and the reason is printed.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

# Rows of the CUDA host-time measurement: one size, nothing to plot.
HOST_OP = "allreduce_host_time"
OP_ORDER = ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall"]
METRICS = {  # suffix: (column, y label)
    "busbw": ("busbw_GBps", "busbw (GB/s)"),
    "time": ("time_us", "time (us)"),
}


def read_csv(path: str) -> list[dict]:
    """The rows of a bench_collectives.py CSV, numbers converted."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = dict(r)
            row["world"] = int(r["world"])
            row["bytes"] = int(r["bytes"])
            for k in ("time_us", "busbw_GBps", "busbw_fraction_of_memcpy"):
                row[k] = float(r[k]) if r.get(k) not in (None, "") else None
            rows.append(row)
    return rows


def memcpy_from_rows(rows: list[dict]) -> float | None:
    """The run's memcpy bandwidth, recovered from busbw / busbw_fraction_of_memcpy."""
    for r in rows:
        if r.get("busbw_fraction_of_memcpy") and r.get("busbw_GBps"):
            return r["busbw_GBps"] / r["busbw_fraction_of_memcpy"]
    return None


def matplotlib_missing() -> str | None:
    """Why plots cannot be made here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return (f"matplotlib is not installed ({e}); pip install matplotlib "
                "(scripts/setup_env.sh installs it)")
    return None


def _first_seen(values):
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def plot_rows(rows: list[dict], stem: str, memcpy: float | None = None) -> list[str]:
    """Writes <stem>_busbw.png and <stem>_time.png from bench rows; their
    paths. Raises ImportError when matplotlib is missing, ValueError when
    there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["op"] != HOST_OP and r.get("time_us")]
    if not rows:
        raise ValueError("no size-sweep rows to plot")
    worlds = sorted({r["world"] for r in rows})
    present = _first_seen(r["op"] for r in rows)
    ops = [op for op in OP_ORDER if op in present] + [op for op in present if op not in OP_ORDER]
    backends = _first_seen(r["backend"] for r in rows)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    style = {b: (colors[k % len(colors)], "-" if k == 0 else "--") for k, b in enumerate(backends)}

    paths = []
    for suffix, (column, ylabel) in METRICS.items():
        fig, axes = plt.subplots(len(worlds), len(ops), figsize=(3.8 * len(ops), 3.2 * len(worlds)),
                                 squeeze=False)
        for i, world in enumerate(worlds):
            for j, op in enumerate(ops):
                ax = axes[i][j]
                for backend in backends:
                    pts = sorted((r["bytes"], r[column]) for r in rows
                                 if r["world"] == world and r["op"] == op and r["backend"] == backend
                                 and r.get(column))
                    if pts:
                        color, line = style[backend]
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color,
                                linestyle=line, marker=".", label=backend)
                if suffix == "busbw" and memcpy:
                    ax.axhline(memcpy, color="gray", linewidth=0.8, linestyle=":", label="1-core memcpy")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"{op}, {world} ranks")
                ax.set_xlabel("size (bytes)")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", linewidth=0.3)
                if i == 0 and j == 0:
                    ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{stem}_{suffix}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_csv(csv_path: str, out_dir: str | None = None) -> list[str]:
    """Plots one CSV (see plot_rows); the PNGs go next to it or into out_dir."""
    stem = os.path.splitext(csv_path)[0]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, os.path.basename(stem))
    rows = read_csv(csv_path)
    return plot_rows(rows, stem, memcpy_from_rows(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", help="CSV files written by bench_collectives.py")
    p.add_argument("--out-dir", help="where the PNGs go (default: next to each CSV)")
    args = p.parse_args(argv)
    missing = matplotlib_missing()
    if missing:
        print(f"no plots: {missing}", file=sys.stderr)
        return 1
    for path in args.csv:
        for png in plot_csv(path, args.out_dir):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
