"""How steady large all_reduces are: the same call timed one by one, run
after run.

    python bench/bench_stability.py                    # 2 ranks, 8/32/64 MiB, 5 runs
    python bench/bench_stability.py --runs 3 --sizes 32M --calls 15

Each run starts fresh ranks (one process each, shared memory), warms each
size up with 3 calls, then times `--calls` calls of `dist.all_reduce` one
at a time: a barrier of a separate group, then the call, timed on every
rank; a call's time is the slowest rank's. Per run and size it prints the
median, the spread of the calls ((max - min) / median) and the slowest
call against the median, and at the end how far each run's median lies
from the median of all runs. The results are checked after the timed
calls (every element must equal the sum the calls made of it).

`--barrier` chooses the backend of the barrier group: `tccomm` (default), a
second tccomm group, whose barrier is over when it returns; or `gloo`,
whose barrier leaves its worker thread finishing the barrier's work while
the timed call runs. With as many ranks as CPUs that thread takes a CPU
from a rank in the middle of the call (bench/README, "Steadiness of large
all_reduces").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _local_ranks import free_port

SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in SIZE_UNITS:
        return int(float(text[:-1]) * SIZE_UNITS[text[-1]])
    return int(text)


BARRIERS = ("tccomm", "gloo")


def rank_main(rank: int, world: int, sizes: list[int], calls: int, barrier: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import torchcomm_backend  # noqa: F401  (registers the backend)

    dist.init_process_group("tccomm", rank=rank, world_size=world)
    # gloo gathers the times (and, with --barrier gloo, separates the calls).
    gloo = dist.new_group(backend="gloo")
    between = gloo if barrier == "gloo" else dist.new_group(backend=barrier)
    report = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(calls):
            dist.barrier(group=between)
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        # 3 + calls sums of `world` ones: world ** (3 + calls) everywhere.
        want = float(world) ** (3 + calls)
        if not torch.all(t == want):
            bad = int((t != want).sum())
            raise SystemExit(f"WRONG RESULT at {nbytes} B, rank {rank}: {bad} elements differ from {want}")
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
        report[nbytes] = slowest.tolist()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def one_run(world: int, sizes: list[int], calls: int, barrier: str) -> dict[int, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        port = free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world))
            args = [sys.executable, __file__, "--rank-main", str(rank), "--world", str(world), "--calls",
                    str(calls), "--barrier", barrier, "--out", out, "--sizes", ",".join(str(s) for s in sizes)]
            procs.append(subprocess.Popen(args, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed (exit codes {codes})")
        with open(out) as f:
            return {int(k): v for k, v in json.load(f).items()}


def label(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= SIZE_UNITS[unit] and nbytes % SIZE_UNITS[unit] == 0:
            return f"{nbytes // SIZE_UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="8M,32M,64M")
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--barrier", choices=BARRIERS, default="tccomm",
                   help="backend of the barrier before each timed call (default: tccomm)")
    p.add_argument("--rank-main", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.rank_main is not None:
        rank_main(a.rank_main, a.world, sizes, a.calls, a.barrier, a.out)
        return
    medians: dict[int, list[float]] = {s: [] for s in sizes}
    for run in range(a.runs):
        result = one_run(a.world, sizes, a.calls, a.barrier)
        for nbytes in sizes:
            ms = [t * 1e3 for t in result[nbytes]]
            med = statistics.median(ms)
            medians[nbytes].append(med)
            print(f"run {run + 1}: {label(nbytes):>7}  median {med:9.3f} ms  min {min(ms):9.3f}  "
                  f"max {max(ms):9.3f}  spread {(max(ms) - min(ms)) / med:6.1%}  slowest {max(ms) / med:.2f}x",
                  flush=True)
    print(f"\n{a.world} ranks, {a.calls} calls per run, {a.runs} runs, {a.barrier} barrier between calls:")
    for nbytes in sizes:
        overall = statistics.median(medians[nbytes])
        worst = max(abs(m - overall) / overall for m in medians[nbytes])
        runs = " ".join(f"{m:.3f}" for m in medians[nbytes])
        print(f"{label(nbytes):>7}: run medians {runs} ms; farthest {worst:.1%} from their median")


if __name__ == "__main__":
    main()
