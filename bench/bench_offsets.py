"""How collectives fare on tensors that start a few bytes past a page
boundary: all_reduce and all_gather_into_tensor on views at chosen offsets
(bytes past a 4096-byte boundary) of larger buffers, tccomm and gloo in the
same ranks, batch by batch.

    python bench/bench_offsets.py                       # 2 ranks, 1 MiB
    python bench/bench_offsets.py --bytes 8M --offsets 0,4,16,64,4080
    python bench/bench_offsets.py --csv offsets.csv

Why: on AMD Zen CPUs a `rep movsb` copy (glibc's memcpy from a few KiB to
about half a megabyte, and the kernel's process_vm_readv) runs 10-17x
slower when its destination lies 1 to 31 bytes after its source modulo
4096. Torch aligns tensors to 64 bytes, but a view at an odd element offset
lands anywhere; the core copies such distances its own way (csrc/c_core/src/
core/copy.h, transport/shm/shm_cma.c). all_reduce's output is its input;
all_gather's input sits on a page boundary and its output at the offset.

Each point: every rank's result checked against the plain-torch value,
warm-up, then the median of --samples batches of the slowest rank's time
per call, the backends alternating batch by batch. The table gives each
offset's time and its ratio to offset 0 of the same backend (1.00: the
offset costs nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _local_ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 4096
OPS = ("all_reduce", "all_gather")


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def view_at(torch, numel: int, offset: int):
    """A float32 view of numel elements whose first byte lies `offset` bytes
    past a page boundary."""
    buf = torch.zeros(numel + 2 * PAGE // 4)
    shift = (offset - buf.data_ptr()) % PAGE // 4
    return buf[shift:shift + numel]


def rank_main(args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    import torchcomm_backend  # noqa: F401  (registers the backend)

    dist.init_process_group("tccomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"tccomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    ctl = dist.new_group(backend="gloo")  # barriers and agreement, never timed
    # torch 2.14 renamed all_gather_into_tensor (the old name warns)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    numel = args.bytes // 4 // world * world
    per = numel // world
    mine = torch.arange(per, dtype=torch.float32) % 251 + rank  # small integers: sums are exact
    want_sum = sum(torch.arange(numel, dtype=torch.float32) % 251 + q for q in range(world))
    want_gather = torch.cat([torch.arange(per, dtype=torch.float32) % 251 + q for q in range(world)])

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctl)
        return t.item()

    rows = []
    for op in args.ops.split(","):
        for offset in [int(o) for o in args.offsets.split(",")]:
            if offset % 4:
                raise SystemExit(f"offset {offset}: float32 views start at multiples of 4 bytes")
            calls, checks = {}, {}
            for name, group in groups.items():
                if op == "all_reduce":
                    t = view_at(torch, numel, offset)
                    t.copy_(torch.arange(numel, dtype=torch.float32) % 251 + rank)
                    dist.all_reduce(t, group=group)
                    checks[name] = torch.equal(t, want_sum)
                    calls[name] = lambda t=t, g=group: dist.all_reduce(t, group=g)
                else:
                    inp = view_at(torch, per, 0)
                    inp.copy_(mine)
                    out = view_at(torch, numel, offset)
                    all_gather(out, inp, group=group)
                    checks[name] = torch.equal(out, want_gather)
                    calls[name] = lambda o=out, i=inp, g=group: all_gather(o, i, group=g)
            if slowest(0.0 if all(checks.values()) else 1.0):
                raise SystemExit(f"rank {rank}: wrong {op} result at offset {offset}: {checks}")
            batches = {name: [] for name in calls}
            for name, call in calls.items():
                for _ in range(args.iters // 4):
                    call()
            for _ in range(args.samples):
                for name, call in calls.items():
                    dist.barrier(group=ctl)
                    start = time.perf_counter()
                    for _ in range(args.iters):
                        call()
                    batches[name].append(slowest((time.perf_counter() - start) / args.iters) * 1e6)
            for name, times in batches.items():
                rows.append((op, offset, name, statistics.median(times)))
    if rank == 0:
        with open(out_path, "w") as f:
            for op, offset, name, us in rows:
                f.write(f"{op},{offset},{name},{us:.3f}\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--bytes", type=parse_bytes, default=1 << 20, help="the whole tensor (default 1M)")
    ap.add_argument("--offsets", default="0,4,16,64,4080", help="bytes past a page boundary (multiples of 4)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--iters", type=int, default=50, help="calls per batch")
    ap.add_argument("--samples", type=int, default=5, help="batches per point and backend")
    ap.add_argument("--csv", help="also write the table here")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad_ops = set(args.ops.split(",")) - set(OPS)
    if bad_ops:
        ap.error(f"unknown op(s) {sorted(bad_ops)}: choose from {', '.join(OPS)}")
    if args.rank_worker:
        rank_main(args, args.out)
        return
    out = os.path.join(ROOT, "bench", "results", f"offsets.{os.getpid()}.tmp")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if not run_ranks(args.world, lambda rank: [__file__, *sys.argv[1:], "--rank-worker", "--out", out], timeout=1200):
        sys.exit("bench_offsets: a rank failed")
    with open(out) as f:
        rows = [line.strip().split(",") for line in f]
    os.remove(out)
    base = {(op, name): float(us) for op, offset, name, us in rows if offset == "0"}
    lines = [f"{args.world} ranks, {args.bytes} bytes, float32, us per call (median of {args.samples} batches,"
             f" slowest rank); x: against the same backend at offset 0",
             f"{'op':<11} {'offset':>6} {'tccomm':>10} {'x':>6} {'gloo':>10} {'x':>6}"]
    table = {}
    for op, offset, name, us in rows:
        table.setdefault((op, offset), {})[name] = float(us)
    for (op, offset), by in table.items():
        cells = "".join(f" {by[n]:10.1f} {by[n] / base[(op, n)]:6.2f}" if (op, n) in base else f" {by[n]:10.1f} {'':>6}"
                        for n in ("tccomm", "gloo"))
        lines.append(f"{op:<11} {offset:>6}{cells}")
    print("\n".join(lines))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("op,offset,backend,world,bytes,us_per_call,ratio_to_offset_0\n")
            for op, offset, name, us in rows:
                ratio = f"{float(us) / base[(op, name)]:.3f}" if (op, name) in base else ""
                f.write(f"{op},{offset},{name},{args.world},{args.bytes},{us},{ratio}\n")


if __name__ == "__main__":
    main()
