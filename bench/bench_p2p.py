"""Point-to-point latency: round trips of dist.send / dist.recv between 2
ranks on one host, tccomm (shared memory, and TCP with
TCCOMM_TRANSPORT=tcp) against gloo in the same processes.

    python bench/bench_p2p.py                    # 8 B, 64 KiB, 1 MiB
    python bench/bench_p2p.py --sizes 8,4096 --csv p2p.csv

Rank 0 sends, rank 1 receives and sends the same buffer back; a round
trip is the time between rank 0's send and the end of its receive. Each
point: warm-up, then the median of 5 batches of rank 0's mean round trip.
Every payload is checked on both ranks.

At 8 B, rows core-shm and core-tcp time the same round trip of a C
program driving the core directly (csrc/c_core/tests/bench_latency.c,
tcc_send/tcc_recv + tcc_op_wait, built if missing): what the layers above
the core (dist.send/recv, c10d, the shim) add is the difference.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from _local_ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "c_core")
BATCHES = 5


def core_round_trip(transport: str) -> tuple[float, list[float]]:
    """The C program's 8 B round trip over `transport`: median and batches (us)."""
    subprocess.run(["make", "-s", "-C", CORE, "build/bench_latency"], check=True)
    exe = os.path.join(CORE, "build", "bench_latency")
    out = subprocess.run([exe, "2", transport, "p2p"], check=True, capture_output=True, text=True).stdout
    batches = [float(b) for b in re.findall(r"batch \d+: ([0-9.]+) us per round trip", out)]
    m = re.search(r"round trip, ranks 0-1 of \d+, \S+: median ([0-9.]+) us", out)
    if not m or len(batches) != BATCHES:
        raise RuntimeError(f"bench_latency printed no round trips:\n{out}")
    return float(m.group(1)), batches


def rank_main(rank: int, sizes: list[int], calls: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import torchcomm_backend  # noqa: F401  (registers the backend)

    dist.init_process_group("tccomm", rank=rank, world_size=2)
    gloo = dist.new_group(backend="gloo")
    rows = []
    for backend, group in (("tccomm", None), ("gloo", gloo)):
        for size in sizes:
            n = max(1, size // 4)
            ping = torch.arange(n, dtype=torch.float32)
            buf = torch.empty(n, dtype=torch.float32)
            reps = calls if backend == "tccomm" else max(10, calls // 10)  # gloo is far slower

            def trips(k: int) -> None:
                for _ in range(k):
                    if rank == 0:
                        dist.send(ping, 1, group=group)
                        dist.recv(buf, 1, group=group)
                    else:
                        dist.recv(buf, 0, group=group)
                        dist.send(buf, 0, group=group)

            trips(max(10, reps // 10))
            assert torch.equal(buf, ping), (backend, size)
            batches = []
            for _ in range(BATCHES):
                buf.fill_(-1)
                dist.barrier(group=gloo)
                start = time.perf_counter()
                trips(reps)
                batches.append((time.perf_counter() - start) / reps * 1e6)
                assert torch.equal(buf, ping), (backend, size)
            rows.append((backend, size, statistics.median(batches), batches))
    if rank == 0:
        with open(out_path, "w") as f:
            for backend, size, med, batches in rows:
                f.write(f"{backend},{size},{med:.3f},{';'.join(f'{b:.3f}' for b in batches)}\n")
    dist.destroy_process_group()


def run(transport: str, sizes: list[int], calls: int) -> list[tuple[str, int, float, list[float]]]:
    """One pair of ranks with TCCOMM_TRANSPORT=transport: its rows."""
    out = os.path.join(ROOT, "bench", "results", f"p2p.{transport}.tmp")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    argv_of = lambda rank: [__file__, "--rank", str(rank), ",".join(map(str, sizes)), str(calls), out]  # noqa: E731
    if not run_ranks(2, argv_of, {"TCCOMM_TRANSPORT": transport}):
        sys.exit(f"bench_p2p: a rank failed ({transport})")
    rows = []
    with open(out) as f:
        for line in f:
            backend, size, med, batches = line.strip().split(",")
            rows.append((backend, int(size), float(med), [float(b) for b in batches.split(";")]))
    os.remove(out)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,65536,1048576", help="message bytes, comma-separated")
    ap.add_argument("--calls", type=int, default=5000, help="round trips per batch (gloo: a tenth)")
    ap.add_argument("--csv", help="also write the table here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    table = []
    for transport in ("shm", "tcp"):
        for backend, size, med, batches in run(transport, sizes, args.calls):
            name = f"tccomm-{transport}" if backend == "tccomm" else "gloo"
            if backend == "gloo" and transport == "tcp":
                continue  # the same gloo as in the first run
            table.append((name, size, med, batches))
    if 8 in sizes:
        for transport in ("shm", "tcp"):
            table.append((f"core-{transport}", 8, *core_round_trip(transport)))
    lines = [f"send/recv round trip, 2 ranks on one host, us (median of {BATCHES} batches, rank 0)",
             f"{'backend':<12} {'bytes':>9} {'us':>9}  batches"]
    for name, size, med, batches in table:
        lines.append(f"{name:<12} {size:>9} {med:9.1f}  {' '.join(f'{b:.1f}' for b in batches)}")
    print("\n".join(lines))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("backend,bytes,us_round_trip\n")
            for name, size, med, _ in table:
                f.write(f"{name},{size},{med:.3f}\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4]), sys.argv[5])
    else:
        main()
