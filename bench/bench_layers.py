"""Where the time of a small all_reduce goes: the same 8-byte all_reduce
(2 float32) through every entry point, from the C core up, at 2 ranks on
one host.

    python bench/bench_layers.py                 # 2 ranks, shared memory
    python bench/bench_layers.py --world 4 --csv layers.csv
    python bench/bench_layers.py --busy 1        # one core kept busy meanwhile
    python bench/bench_layers.py --cpus 1        # every rank confined to one CPU
    python bench/bench_layers.py --op p2p        # send/recv round trips instead
    python bench/bench_layers.py --cold 2M       # every call after 2 MiB streamed through the caches

Layers, each timed in the conventions of bench/bench_collectives.py
(warm-up, then the median of 5 batches of the slowest rank's time per call):
  core      a C program driving the core directly (csrc/c_core/tests/
            bench_latency.c: tcc_allreduce + tcc_op_wait), built if missing
  torchcomm the TorchComm-style API: comm.all_reduce(t, SUM, async_op=False)
  funcol    torch.ops._c10d_functional.all_reduce + wait_tensor, what
            compiled code calls
  c10d      dist.all_reduce(t), eager c10d
  pg        ProcessGroup.allreduce([t]).wait(): c10d without torch's Python
            wrapper (torch's dispatcher, then the backend)
  backend   the backend's own allreduce([t]).wait() through torch's binding:
            the shim and the core, without the dispatcher
  gloo      dist.all_reduce(t) on a gloo group, for reference
  floor     torch.ops.aten.clone + wait_tensor on its result (no work behind
            it): what torch itself costs for the two op calls funcol makes,
            the lowest a backend's funcol time can be
Each layer's "above core" column is its time minus the core's: what the
layers above the core add. Every result is checked. "cpu us" is the CPU
time a rank's process used per call over the batch (all its threads: the
caller's and the backend's), "switches" its context switches per call
(voluntary and involuntary), both the mean over the ranks: where ranks
share CPUs (--world 4 on 2 CPUs, --busy, --cpus) the time per call is
bounded by the CPU all ranks need for one call, and these show how much
each needs and how often the CPUs changed hands. Not measured with
--cold (the copies between the calls would count).

--op p2p times 8-byte send/recv round trips between 2 ranks instead (rank 0
sends and receives the echo, rank 1 receives and sends it back; both check
what they got) through the same layers but funcol and floor, which have no
point-to-point op; the core's row is bench_latency's round trip (2 shm p2p).

--busy N keeps N other processes spinning (one core each, as another job
or a data loader would) for the whole measurement, the core's included:
how waiting holds up when cores are shared.

--cold BYTES copies that many bytes (a torch copy_ between two buffers of
half that size) before every call, outside the clock, which then times each
call alone: how each layer runs when a large op's data has just streamed
through the CPU's caches and pushed its code and data out, as in a loop of
1 MiB collectives or the compute between two collectives. floor is a purely
local pair of ops: its growth is torch's own cold-cache cost, with no peer
to wait for. The core's row is bench_latency's same mode (`cold BYTES`).
All-reduce only.

--cpus K confines every rank, and the core's program, to the first K CPUs
this process may use, as a container's CPU set, taskset or a batch
system's binding would: fewer CPUs than ranks means each op hands a CPU
from one rank to another.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

from _local_ranks import run_ranks
from bench_collectives import parse_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "c_core")
WARMUP = 2000
BATCHES = 5


def start_busy(n: int) -> list[subprocess.Popen]:
    """n processes that keep a core each busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def core_time(world: int, op: str, cold: int) -> float:
    """Median microseconds per call (per round trip for p2p) of the C program
    (one line it prints)."""
    exe = os.path.join(CORE, "build", "bench_latency")
    subprocess.run(["make", "-s", "-C", CORE, "build/bench_latency"], check=True)
    what = "p2p" if op == "p2p" else "allreduce"
    cold_args = ["cold", str(cold)] if cold else []
    out = subprocess.run([exe, str(world), "shm", what] + cold_args, check=True, capture_output=True,
                         text=True).stdout
    m = re.search(r"median ([0-9.]+) us", out)
    if not m:
        raise RuntimeError(f"bench_latency printed no median:\n{out}")
    return float(m.group(1))


def p2p_layers(rank, comm, pg, backend, gloo):
    """(name, call, make_input, want) for round trips: call(x) returns the
    tensor whose values must equal `want` (rank 0: the echo; rank 1: what
    rank 0 sent). x is made outside the clock."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank

    def round_trip(send, recv):
        if rank == 0:
            def call(x):
                send(x[0])
                recv(x[1])
                return x[1]
        else:
            def call(x):
                recv(x[0])
                send(x[0])
                return x[0]
        return call

    def make_input():  # rank 0 sends 1.0 and receives into zeros; rank 1 receives into zeros
        return (torch.full((2,), 1.0) if rank == 0 else torch.zeros(2), torch.zeros(2))

    layers = [
        ("torchcomm", round_trip(lambda t: comm.send(t, peer), lambda t: comm.recv(t, peer))),
        ("c10d", round_trip(lambda t: dist.send(t, peer), lambda t: dist.recv(t, peer))),
        ("pg", round_trip(lambda t: pg.send([t], peer, 0).wait(), lambda t: pg.recv([t], peer, 0).wait())),
        ("backend", round_trip(lambda t: backend.send([t], peer, 0).wait(),
                               lambda t: backend.recv([t], peer, 0).wait())),
        ("gloo", round_trip(lambda t: dist.send(t, peer, group=gloo), lambda t: dist.recv(t, peer, group=gloo))),
    ]
    return [(name, call, make_input, 1.0) for name, call in layers]


def process_spent() -> tuple[float, int]:
    """CPU seconds this process has used so far, all its threads (the
    caller's and the backend's), and the context switches they made
    (voluntary and involuntary)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), usage.ru_nvcsw + usage.ru_nivcsw


def rank_main(rank: int, world: int, calls: int, out_path: str, op: str, cold: int) -> None:
    import torch
    import torch.distributed as dist

    import torchcomm_backend

    dist.init_process_group("tccomm", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    store = dist.PrefixStore("layers-comm", dist.distributed_c10d._get_default_store())
    comm = torchcomm_backend.new_comm("tccomm", torch.device("cpu"), store=store)
    group_name = dist.group.WORLD.group_name
    want = float(world * (world + 1) // 2)  # the sum of every rank's rank + 1
    ops = torch.ops._c10d_functional

    def c10d(t):
        dist.all_reduce(t)
        return t

    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))

    def pg_call(t):
        pg.allreduce([t]).wait()
        return t

    def backend_call(t):
        backend.allreduce([t]).wait()
        return t

    def gloo_call(t):
        dist.all_reduce(t, group=gloo)
        return t

    def funcol(t):
        return ops.wait_tensor(ops.all_reduce(t, "sum", group_name))

    def torchcomm(t):
        comm.all_reduce(t, torchcomm_backend.ReduceOp.SUM, async_op=False)
        return t

    def floor(t):
        return ops.wait_tensor(torch.ops.aten.clone(t))

    def own_value():
        return torch.full((2,), float(rank + 1))

    half = max(1, cold // 8)  # float32 elements of each of the two buffers
    cold_src, cold_dst = torch.ones(half), torch.empty(half)

    def timed(call, inputs, outputs) -> float:
        """Seconds of the calls alone."""
        if not cold:
            start = time.perf_counter()
            for i, t in enumerate(inputs):
                outputs[i] = call(t)  # funcol's result is a new tensor
            return time.perf_counter() - start
        total = 0.0
        for i, t in enumerate(inputs):
            cold_dst.copy_(cold_src)  # streams `cold` bytes through the caches
            start = time.perf_counter()
            outputs[i] = call(t)
            total += time.perf_counter() - start
        return total

    rows = []
    layers = [("torchcomm", torchcomm, own_value, want), ("funcol", funcol, own_value, want),
              ("c10d", c10d, own_value, want), ("pg", pg_call, own_value, want),
              ("backend", backend_call, own_value, want), ("gloo", gloo_call, own_value, want),
              ("floor", floor, own_value, float(rank + 1))]
    if op == "p2p":
        layers = p2p_layers(rank, comm, pg, backend, gloo)
    for name, call, make_input, want in layers:
        n = calls // 10 if name == "gloo" else calls  # gloo is ~10x slower
        for _ in range(WARMUP // (10 if name == "gloo" else 1)):
            got = call(make_input())
            assert got[0].item() == want, (name, got)
        batches, cpu, switches = [], [], []
        for _ in range(BATCHES):
            dist.barrier(group=gloo)
            inputs = [make_input() for _ in range(n)]  # made outside the clock
            outputs = [None] * n
            spent_before = process_spent()
            elapsed = timed(call, inputs, outputs) / n * 1e6
            spent = [(a - b) / n for a, b in zip(process_spent(), spent_before)]
            assert all(t[0].item() == want for t in outputs[:: max(1, n // 100)]), name
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
            batches.append(slowest.item())
            per_rank = torch.tensor([spent[0] * 1e6, spent[1]], dtype=torch.float64)
            dist.all_reduce(per_rank, op=dist.ReduceOp.SUM, group=gloo)
            cpu.append(per_rank[0].item() / world)
            switches.append(per_rank[1].item() / world)
        rows.append((name, statistics.median(batches), batches, statistics.median(cpu), statistics.median(switches)))
    if rank == 0:
        with open(out_path, "w") as f:
            for name, med, batches, cpu_us, switched in rows:
                # A cold batch's process counts take in the copies between the calls.
                usage = ",," if cold else f",{cpu_us:.3f},{switched:.3f}"
                f.write(f"{name},{med:.3f},{';'.join(f'{b:.3f}' for b in batches)}{usage}\n")
    comm.finalize()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--op", choices=["allreduce", "p2p"], default="allreduce",
                    help="8 B all_reduce (default) or send/recv round trips (2 ranks)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per batch (gloo: a tenth)")
    ap.add_argument("--csv", help="also write the table here")
    ap.add_argument("--busy", type=int, default=0, help="processes that keep a core busy meanwhile (default 0)")
    ap.add_argument("--cold", type=parse_bytes, default=0,
                    help="bytes streamed through the caches before every call, outside the clock (default 0)")
    ap.add_argument("--cpus", type=int, default=0,
                    help="confine the ranks (and the busy processes) to the first K CPUs allowed (default: all)")
    args = ap.parse_args()
    if args.op == "p2p" and args.world != 2:
        ap.error("--op p2p takes 2 ranks (--world 2)")
    if args.op == "p2p" and args.cold:
        ap.error("--cold times all_reduce only")
    allowed = sorted(os.sched_getaffinity(0))
    if args.cpus < 0 or args.cpus > len(allowed):
        ap.error(f"--cpus takes 1 to {len(allowed)} (the CPUs this process may use)")
    if args.cpus:
        os.sched_setaffinity(0, allowed[:args.cpus])  # every process started from here inherits it
    args.cpus = len(os.sched_getaffinity(0))
    busy = start_busy(args.busy)
    try:
        measure(args)
    finally:
        for p in busy:
            p.kill()
            p.wait()


def measure(args: argparse.Namespace) -> None:

    out = os.path.join(ROOT, "bench", "results", f"layers.w{args.world}.tmp")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if not run_ranks(args.world, lambda rank: [__file__, "--rank", str(rank), str(args.world), str(args.calls), out,
                                               args.op, str(args.cold)]):
        sys.exit("bench_layers: a rank failed")
    core = core_time(args.world, args.op, args.cold)
    rows = [("core", core, [], "", "")]
    with open(out) as f:
        for line in f:
            name, med, batches, cpu, switches = line.strip().split(",")
            rows.append((name, float(med), [float(b) for b in batches.split(";")], cpu, switches))
    os.remove(out)

    load = f", {args.busy} core(s) kept busy by other processes" if args.busy else ""
    load += f", on {args.cpus} CPU(s)"
    if args.cold:
        load += f", {args.cold} bytes through the caches before each call"
    what, per = ("8 B send/recv round trip", "round trip") if args.op == "p2p" else ("8 B all_reduce", "call")
    lines = [f"{what}, {args.world} ranks on one host{load}, us per {per} (median of {BATCHES} batches,"
             f" slowest rank)", f"{'layer':<10} {'us':>8} {'above core':>11} {'cpu us':>8} {'switches':>8}  batches"]
    for name, med, batches, cpu, switches in rows:
        above = "" if name == "core" else f"{med - core:+.2f}"
        cpu_text = f"{float(cpu):.2f}" if cpu else ""
        switch_text = f"{float(switches):.2f}" if switches else ""
        lines.append(f"{name:<10} {med:8.2f} {above:>11} {cpu_text:>8} {switch_text:>8}  "
                     f"{' '.join(f'{b:.2f}' for b in batches)}")
    if not args.cold:
        lines.append(f"cpu us: CPU time per {per} of each rank's process (every thread), switches: its context "
                     f"switches per {per}; both the mean over ranks")
    print("\n".join(lines))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("layer,op,world,busy,cpus,cold_bytes,us_per_call,us_above_core,cpu_us_per_call,switches_per_call\n")
            for name, med, _, cpu, switches in rows:
                f.write(f"{name},{args.op},{args.world},{args.busy},{args.cpus},{args.cold},{med:.3f},{med - core:.3f},"
                        f"{cpu},{switches}\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], int(sys.argv[7]))
    else:
        main()
