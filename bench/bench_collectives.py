"""nccl-tests style benchmark of tccomm against gloo (CPU) or nccl (CUDA).

    python bench/bench_collectives.py                 # world sizes 2 and 4, 8 B .. 64 MiB
    python bench/bench_collectives.py --quick         # up to 1 MiB, shorter timing
    python bench/bench_collectives.py --worlds 2 --max-bytes 4M --ops allreduce
    python bench/bench_collectives.py --device cuda    # tccomm vs nccl on CUDA tensors

--device cuda compares tccomm with nccl (default --backends tccomm,nccl;
default worlds: 1 and the number of GPUs). Rank r uses GPU r % #GPUs; when
ranks outnumber GPUs each rank claims its own host (NCCL_HOSTID) and NCCL
talks over sockets on lo, so any world size runs on one GPU. Times are taken
after a device synchronize. At world size 1 it also measures the host time
per eager dist.all_reduce(..., async_op=True) call on a small CUDA tensor
(--host-count floats; only the calls are timed, in chunks of --host-chunk,
with the device synchronized between chunks outside the clock), tccomm
against nccl: the target is at most 0.7x of ProcessGroupNCCL's host time.
--host-only measures just that (world size 1, no sweep).

For every world size the script spawns that many processes on this machine.
Each process creates a tccomm group (the default group), a gloo group over
the same ranks, and a second gloo group that is never measured (barriers
between timed batches, agreement on results). Every (op, size) point is first
verified on both backends: rank-dependent small-integer inputs, one run, the
output compared exactly with a plain-torch reference built from all ranks'
inputs; a wrong result on any rank aborts the run. Then warm-up, calibration
and --samples timed batches per backend (together about --time-per-point
seconds), the backends' order rotating from point to point and from batch to
batch. A batch's time is the slowest rank's average time per iteration, as in
nccl-tests; a point reports the median batch and the spread (max - min) /
median, in microseconds; algbw is size / time and busbw = algbw x factor:

    allreduce 2(n-1)/n   allgather, reduce_scatter, alltoall (n-1)/n   broadcast 1

"size" is the whole buffer as nccl-tests counts it (allgather: the gathered
output; reduce_scatter: the input; alltoall: one rank's send buffer).
The script also measures this machine's single-core memcpy bandwidth (torch
copy_ of a 64 MiB tensor in one thread) and reports the large-message busbw
of each backend as a fraction of it. On CPU it measures, for each world
size n, the bandwidth each of n processes gets while all copy at once
("shared memcpy"): the ranks of a large collective all move memory at the
same time and share the memory bus (and, with more ranks than cores, the
cores), so that is the most a rank's own copies can reach in the run; the
busbw is reported as a fraction of it too.

Writes bench/results/bench_<time>.csv and, with matplotlib, the plots
bench_<time>_busbw.png and bench_<time>_time.png (busbw and time against
size, one line per backend; bench/plot_results.py, which also plots an
existing CSV) and prints a table of ratios (gloo time / tccomm time: above 1
means tccomm is faster).

--backends tccomm,gloo,openmpi adds Open MPI (CPU only, optional: needs
mpirun and mpi4py; when missing, one line says so and the run goes on
without it). The ranks are then started by mpirun, every rank also
initializes MPI (bench_mpi.py), and each point is verified and timed on
Open MPI exactly as on the torch.distributed groups: the same tensors, in
the same processes, batch by batch with the others, into the same CSV,
table (openmpi time / tccomm time) and plots. Measured in separate jobs,
one after the other, two peers meet different minutes of a machine whose
speed drifts (by 2x on a shared or virtual one); batch by batch they meet
the same ones.

--rounds R repeats each world size's sweep R times, one op at a time, so
that each op's rounds are spread over the run. Each point then reports the
median of its R round medians, and the spread is that of the round medians;
the CSV's "rounds" column says how many.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from _local_ranks import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall"]
FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
# The element types --dtype offers and their sizes. Inputs are small
# integers (rank_input), so every result is exact in each of them: bfloat16
# holds every integer up to 256, enough for sums over 15 ranks.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def parse_bytes(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            text, mult = text[:-1], m
    return int(float(text) * mult)


def human(nbytes: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= m and nbytes % m == 0:
            return f"{nbytes // m} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------------
# worker (one rank)
# ---------------------------------------------------------------------------


def rank_input(torch, rank: int, count: int, dtype=None):
    """Rank `rank`'s input: small positive integers, so that sums over any
    realistic number of ranks are exact in every --dtype and a block that
    lands at the wrong place or from the wrong rank shows up as a wrong value."""
    return ((torch.arange(count, dtype=torch.int64) + 3 * rank) % 17 + 1).to(dtype or torch.float32)


def expected_output(torch, op: str, rank: int, world: int, count: int, per: int, dtype=None):
    """The result rank `rank` must hold after one `op`, computed with plain
    torch from the inputs every rank was given (rank_input); the sums are
    taken in float64 (exact) and then converted."""
    def inp(r, n):
        return rank_input(torch, r, n, torch.float64)

    mine = slice(rank * per, (rank + 1) * per)
    if op == "allreduce":
        want = sum(inp(r, count) for r in range(world))
    elif op == "broadcast":
        want = inp(0, count)
    elif op == "allgather":
        want = torch.cat([inp(r, per) for r in range(world)])
    elif op == "reduce_scatter":
        want = sum(inp(r, per * world)[mine] for r in range(world))
    elif op == "alltoall":
        want = torch.cat([inp(r, per * world)[mine] for r in range(world)])
    else:
        raise ValueError(op)
    return want.to(dtype or torch.float32)


def mismatch(torch, got, want) -> str:
    """'' when got equals want exactly, else where and how they differ."""
    got = got.cpu()
    if got.shape == want.shape and torch.equal(got, want):
        return ""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    bad = (got != want).nonzero().flatten()
    i = int(bad[0])
    return (f"{bad.numel()} of {want.numel()} elements differ, first at index {i}: "
            f"{got[i].item()} instead of {want[i].item()}")


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def worker(args) -> None:
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backends = args.backends.split(",")
    torch_backends = [b for b in backends if b != MPI]
    if MPI in backends:  # started by mpirun (run_world): MPI first, its rank is ours
        import bench_mpi
        mpi, mpi_comm = bench_mpi.open_world()
        for name, ompi in (("RANK", "RANK"), ("WORLD_SIZE", "SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                           ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")):
            os.environ[name] = os.environ[f"OMPI_COMM_WORLD_{ompi}"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dtype = getattr(torch, args.dtype)
    elem = DTYPE_BYTES[args.dtype]
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # Open MPI alone: the default group is a gloo one, never measured.
    dist.init_process_group(torch_backends[0] if torch_backends else "gloo",
                            timeout=datetime.timedelta(seconds=300))
    groups = {torch_backends[0]: None} if torch_backends else {}
    for b in torch_backends[1:]:
        groups[b] = dist.new_group(list(range(world)), backend=b)
    # A gloo group of its own, never measured: barriers between timed batches
    # and the agreement on results go through it, so no backend's own barrier
    # or latency enters another backend's figures.
    ctl = dist.new_group(list(range(world)), backend="gloo")

    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def torch_call(op, g, inp, out):
        """One iteration of `op` on group g (a callable taking no argument)."""
        if op == "allreduce":
            return lambda: dist.all_reduce(inp, group=g)
        if op == "broadcast":
            return lambda: dist.broadcast(inp, src=0, group=g)
        if op == "allgather":
            return lambda: ag(out, inp, group=g)
        if op == "reduce_scatter":
            return lambda: rs(out, inp, group=g)
        if op == "alltoall":
            return lambda: dist.all_to_all_single(out, inp, group=g)
        raise ValueError(op)

    def make(op, size_bytes):
        """Returns (fns, reset, output, actual size in bytes, per-rank block):
        fns[b] runs one iteration of `op` on backend b, all on the same
        tensors; reset refills the inputs with this rank's rank_input,
        output is the tensor to verify after one call."""
        count = max(1, size_bytes // elem)
        per = max(1, count // world)
        n_in = {"allreduce": count, "broadcast": count, "allgather": per}.get(op, per * world)
        inp = torch.empty(n_in, device=device, dtype=dtype)
        n_out = {"allreduce": 0, "broadcast": 0, "reduce_scatter": per}.get(op, per * world)
        out = torch.empty(n_out, device=device, dtype=dtype) if n_out else None
        actual = (count if n_out == 0 else per * world) * elem

        def reset():
            inp.copy_(rank_input(torch, rank, n_in, dtype))
        fns = {b: torch_call(op, groups[b], inp, out) for b in torch_backends}
        if MPI in backends and not bench_mpi.not_available(op, args.dtype):
            fns[MPI] = bench_mpi.op_call(mpi, mpi_comm, op, inp, out, args.dtype)
        return fns, reset, inp if out is None else out, actual, per

    def agree_max(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctl)
        return float(t.item())

    def verify(b, op, actual, fn, reset, output, per) -> None:
        """Runs `op` once on backend b from known inputs and compares every
        rank's output with the plain-torch reference; any wrong rank stops
        every rank (agreed over ctl, so no rank is left waiting in a
        collective), before a figure of b for this point is recorded."""
        output.fill_(-1.0)  # rank_input is never negative: stale data cannot pass
        reset()  # after the fill: allreduce and broadcast work in place
        sync()
        fn()
        sync()
        want = expected_output(torch, op, rank, world, actual // elem, per, dtype)
        problem = mismatch(torch, output, want)
        if problem:
            print(f"WRONG RESULT: backend {b}, op {op}, size {human(actual)}, "
                  f"{world} ranks, rank {rank}: {problem}", file=sys.stderr, flush=True)
        if agree_max(1.0 if problem else 0.0):
            raise SystemExit(f"rank {rank}: backend {b} computed a wrong {op} of "
                             f"{human(actual)} on {world} ranks; benchmark aborted")

    def timed_batch(fn, iters: int) -> float:
        """Slowest rank's seconds per iteration over one batch; the ranks
        start together at a barrier of the neutral group."""
        sync()
        dist.barrier(group=ctl)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return agree_max((time.perf_counter() - t0) / iters)

    def record(row: dict) -> None:
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    out = open(args.results, "a") if rank == 0 else None
    sizes = []
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 2
    point = 0
    for op in [] if args.host_only else args.ops.split(","):
        why = bench_mpi.not_available(op, args.dtype) if MPI in backends else None
        if why and rank == 0:
            print(f"  n={world} {op:15s} {MPI}: {why}", flush=True)
        for size in sizes:
            fns, reset, output, actual, per = make(op, size)
            # Under one element per rank: no such point. A world size that
            # does not divide the size (3, 5 ranks) runs the largest multiple
            # of it below, recorded as what it is.
            if actual > size or not fns:
                continue
            point += 1
            measured = [b for b in backends if b in fns]
            # Which backend goes first changes from point to point and from
            # batch to batch, so none always meets a cold (or warm) cache.
            for b in rotated(measured, point):
                verify(b, op, actual, fns[b], reset, output, per)
            iters = {}
            for b in rotated(measured, point + 1):
                for _ in range(args.warmup):
                    fns[b]()
                iters[b] = calibrated_iters(lambda n, b=b: timed_batch(fns[b], n), args)
            samples = {b: [] for b in measured}
            for k in range(args.samples):
                for b in rotated(measured, point + k):
                    samples[b].append(timed_batch(fns[b], iters[b]))
            row = {}
            for b in measured:
                med = statistics.median(samples[b])
                lo, hi = min(samples[b]), max(samples[b])
                row[b] = (med, lo, hi)
                algbw = actual / med / 1e9
                record({"world": world, "backend": b, "device": args.device, "op": op,
                        "bytes": actual, "count": actual // elem, "dtype": args.dtype,
                        "iters": iters[b], "samples": args.samples, "time_us": med * 1e6,
                        "time_min_us": lo * 1e6, "time_max_us": hi * 1e6,
                        "spread_pct": 100 * (hi - lo) / med, "verified": True,
                        "algbw_GBps": algbw, "busbw_GBps": algbw * FACTOR[op](world)})
            if rank == 0:
                # median, and (max - min) / median of the batches
                cells = "  ".join(f"{b}: {row[b][0] * 1e6:10.1f} us "
                                  f"({100 * (row[b][2] - row[b][1]) / row[b][0]:5.1f}%)"
                                  for b in measured)
                ratio = ""
                if len(measured) > 1:
                    ratio = f"  ratio {row[measured[1]][0] / row[measured[0]][0]:6.2f}x"
                print(f"  n={world} {op:15s} {human(actual):>9s}  {cells}{ratio}", flush=True)
    if cuda and world == 1:
        host = {b: host_time_per_call(dist, torch, device, b, groups[b], args)
                for b in rotated(torch_backends, point + 1)}
        for b, secs in host.items():
            record({"world": world, "backend": b, "device": "cuda", "op": HOST_OP,
                    "bytes": args.host_count * DTYPE_BYTES["float32"], "count": args.host_count, "dtype": "float32",
                    "iters": args.host_iters, "time_us": secs * 1e6, "algbw_GBps": 0.0,
                    "busbw_GBps": 0.0})
        if rank == 0:
            cells = "  ".join(f"{b}: {host[b] * 1e6:8.2f} us" for b in torch_backends)
            print(f"  host time per eager all_reduce ({args.host_count} floats): {cells}", flush=True)
    dist.barrier(group=ctl)
    dist.destroy_process_group()


HOST_OP = "allreduce_host_time"
MPI = "openmpi"  # not a torch.distributed backend: MPI calls in the same ranks (bench_mpi.py)


def host_time_per_call(dist, torch, device, backend, group, args) -> float:
    """Seconds of host time per eager dist.all_reduce(..., async_op=True) call
    on a small tensor.

    What is timed is the Python call alone: the calling thread validating,
    enqueueing and bookkeeping the op, which is what limits small-message
    training steps. CUDA is never synchronized inside the timed region: the
    calls run in chunks of --host-chunk (their Work objects kept alive, so no
    destructor is timed either), and between two chunks, outside the clock,
    the last Work is waited for and the device synchronized, so the GPU's
    queue never fills up and makes the host wait for the device. The best of
    5 rounds of --host-iters calls. Runs at world size 1 only, where the sum
    is the input itself: checked once before timing."""
    want = rank_input(torch, 0, args.host_count)
    t = want.to(device)
    dist.all_reduce(t, group=group, async_op=True).wait()
    torch.cuda.synchronize()
    problem = mismatch(torch, t, want)
    if problem:
        raise SystemExit(f"WRONG RESULT: backend {backend}, host-time all_reduce of {args.host_count} floats, "
                         f"1 rank, rank 0: {problem}; benchmark aborted")
    for _ in range(50):
        dist.all_reduce(t, group=group, async_op=True)
    torch.cuda.synchronize()
    chunk = max(1, args.host_chunk)
    works = []
    best = float("inf")
    for _ in range(5):
        spent, done = 0.0, 0
        while done < args.host_iters:
            n = min(chunk, args.host_iters - done)
            keep = works.append
            t0 = time.perf_counter()
            for _ in range(n):
                keep(dist.all_reduce(t, group=group, async_op=True))
            spent += time.perf_counter() - t0
            done += n
            works[-1].wait()
            torch.cuda.synchronize()
            works.clear()
        best = min(best, spent / args.host_iters)
    return best


# ---------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------


def memcpy_bandwidth(nbytes: int = 64 << 20, reps: int = 10) -> float:
    """Single-thread copy bandwidth in GB/s (bytes copied per second)."""
    import torch
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _copier(nbytes: int, reps: int, start, results) -> None:
    """One of shared_memcpy_bandwidth's processes: reps copies after a common start."""
    import torch
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    results.put(nbytes * reps / (time.perf_counter() - t0) / 1e9)


def shared_memcpy_bandwidth(copiers: int, nbytes: int = 64 << 20, reps: int = 10) -> float:
    """Copy bandwidth in GB/s of each of `copiers` single-thread processes
    copying at the same time (the mean over them): what one rank's memcpy
    gets while every rank of a `copiers`-rank job moves memory, as all do
    in a large collective. Below the single-core figure where the copiers
    share the memory bus, and about 1/k of it where k ranks share a CPU."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")  # no fork of a process that has loaded torch
    start, results = ctx.Barrier(copiers), ctx.Queue()
    procs = [ctx.Process(target=_copier, args=(nbytes, reps, start, results)) for _ in range(copiers)]
    for p in procs:
        p.start()
    rates = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return sum(rates) / len(rates)


def run_world(args, world: int, results: str) -> None:
    """Runs one world size's ranks; rank 0 appends its rows (JSON lines) to
    `results`. A failed rank removes `results` and stops the run."""
    port = free_port()
    if MPI in args.backends.split(","):
        run_under_mpirun(args, world, port, results)
        return
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore::FutureWarning")
        if args.device == "cuda" and world > args.gpus:
            # More ranks than GPUs: NCCL must see separate hosts talking over sockets.
            env.update(NCCL_HOSTID=f"tccomm-bench-host-{rank}", NCCL_SOCKET_IFNAME="lo",
                       NCCL_NET="Socket", NCCL_IB_DISABLE="1", NCCL_MNNVL_ENABLE="0")
        procs.append(subprocess.Popen(worker_command(args, results), env=env))
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"world {world}: the benchmark did not finish within "
                             f"{args.timeout} s")
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        if os.path.exists(results):
            os.remove(results)  # a run with a failed rank reports nothing
        raise SystemExit(f"world {world}: a rank failed (exit codes {bad}); no results written")


def worker_command(args, results: str) -> list[str]:
    """The rank program's command line."""
    return [sys.executable, os.path.abspath(__file__), "--worker", "--results", results,
            "--device", args.device, "--host-count", str(args.host_count),
            "--host-iters", str(args.host_iters), "--host-chunk", str(args.host_chunk),
            "--backends", args.backends, "--ops", args.ops,
            "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
            "--warmup", str(args.warmup), "--time-per-point", str(args.time_per_point),
            "--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters),
            "--samples", str(args.samples), "--dtype", args.dtype] + (["--host-only"] if args.host_only else [])


def run_under_mpirun(args, world: int, port: int, results: str) -> None:
    """The ranks as one mpirun job (bench_mpi.mpirun_command): with Open MPI
    among the backends every rank also initializes MPI, and takes its rank
    from mpirun."""
    import bench_mpi
    cmd, note = bench_mpi.mpirun_command(world)
    print(f"-- {world} ranks under mpirun: {note}", flush=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore::FutureWarning")
    # A session of its own, so that a job past the timeout goes down with all its ranks.
    proc = subprocess.Popen(cmd + worker_command(args, results), env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise SystemExit(f"world {world}: the benchmark did not finish within {args.timeout} s")
    if code != 0:
        if os.path.exists(results):
            os.remove(results)  # a run with a failed rank reports nothing
        raise SystemExit(f"world {world}: a rank failed (mpirun exit code {code}); no results written")


def report(args, rows: list[dict], memcpy: float, stem: str, shared: dict[int, float] | None = None) -> None:
    backends = args.backends.split(",")
    host_rows = [r for r in rows if r["op"] == HOST_OP]
    rows = [r for r in rows if r["op"] != HOST_OP]
    csv_path = stem + ".csv"
    with open(csv_path, "w", newline="") as f:
        fields = ["world", "backend", "op", "bytes", "count", "dtype", "iters", "samples",
                  "time_us", "time_min_us", "time_max_us", "spread_pct", "verified",
                  "algbw_GBps", "busbw_GBps", "busbw_fraction_of_memcpy",
                  "busbw_fraction_of_shared_memcpy", "rounds"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows + host_rows:
            fractions = {"busbw_fraction_of_memcpy": r["busbw_GBps"] / memcpy}
            if shared and r["world"] in shared:
                fractions["busbw_fraction_of_shared_memcpy"] = r["busbw_GBps"] / shared[r["world"]]
            w.writerow({k: v for k, v in {**r, **fractions}.items() if k in fields})
    print(f"\nwrote {csv_path}")
    if host_rows:
        host = {r["backend"]: r["time_us"] for r in host_rows}
        cells = ", ".join(f"{b} {us:.2f} us" for b, us in host.items())
        print(f"\nhost time per eager all_reduce ({host_rows[0]['count']} floats, 1 rank, CUDA): {cells}")
        if "tccomm" in host and "nccl" in host:
            ratio = host["tccomm"] / host["nccl"]
            print(f"tccomm / nccl host time: {ratio:.2f}x (target <= 0.70x: "
                  f"{'met' if ratio <= 0.7 else 'NOT met'})")

    if not rows:  # --host-only: no sweep, nothing more to tabulate or plot
        return
    idx = {(r["world"], r["backend"], r["op"], r["bytes"]): r for r in rows}
    worlds = sorted({r["world"] for r in rows})
    ops = [op for op in args.ops.split(",")]
    a = backends[0]
    for b in backends[1:]:  # one table per peer of the first backend
        for world in worlds:
            sizes = sorted({r["bytes"] for r in rows if r["world"] == world})
            print(f"\n{b} time / {a} time (above 1: {a} is faster), {world} ranks")
            print(f"{'size':>10s} " + " ".join(f"{op:>14s}" for op in ops))
            for size in sizes:
                cells = []
                for op in ops:
                    # ops round small sizes differently: match on the nominal row
                    ra, rb = idx.get((world, a, op, size)), idx.get((world, b, op, size))
                    cells.append(f"{rb['time_us'] / ra['time_us']:14.2f}" if ra and rb
                                 else f"{'-':>14s}")
                print(f"{human(size):>10s} " + " ".join(cells))

    print(f"\nsingle-core memcpy bandwidth (torch copy_ of 64 MiB, 1 thread): "
          f"{memcpy:.2f} GB/s")
    for world in worlds:
        if shared and world in shared:
            print(f"memcpy bandwidth of each of {world} processes copying at once: {shared[world]:.2f} GB/s "
                  f"({100 * shared[world] / memcpy:.0f}% of one alone)")
    for world in worlds:
        for backend in backends:
            lat = idx.get((world, backend, "allreduce", 8))
            if lat:
                print(f"8-byte allreduce latency, {world} ranks, {backend:7s}: "
                      f"{lat['time_us']:9.1f} us")
    for world in worlds:
        for op in ops:
            cand = [r for r in rows if r["world"] == world and r["op"] == op]
            if not cand:
                continue
            big = max(r["bytes"] for r in cand)
            parts = []
            for backend in backends:
                r = idx.get((world, backend, op, big))
                if r:
                    of_shared = (f", {100 * r['busbw_GBps'] / shared[world]:5.1f}% of shared"
                                 if shared and world in shared else "")
                    parts.append(f"{backend} {r['busbw_GBps']:6.2f} GB/s "
                                 f"({100 * r['busbw_GBps'] / memcpy:5.1f}% of memcpy{of_shared})")
            print(f"largest {op:14s} ({human(big)}), {world} ranks: " + ", ".join(parts))

    # Plots: bench/plot_results.py (also usable on an existing CSV); the CSV
    # above is written whether or not they can be made.
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import plot_results

    missing = plot_results.matplotlib_missing()
    if missing:
        print(f"plots skipped: {missing}; the CSV is complete (plot it later with "
              f"python bench/plot_results.py {csv_path})")
        return
    for png in plot_results.plot_rows(rows, stem, memcpy):
        print(f"wrote {png}")


def calibrated_iters(timed, args) -> int:
    """Iterations per timed batch, so that a batch lasts about
    --time-per-point / --samples seconds. timed(n) runs n iterations after a
    barrier and returns the seconds per iteration that every rank agrees on
    (so every rank makes the same choices here). The estimate comes from a
    run of at least a quarter of a batch, doubling from one iteration: one
    call alone also carries the ranks' skew in leaving the barrier, worth
    milliseconds with 4 ranks on 2 CPUs, and sized batches of a few dozen
    iterations whose time was mostly that skew (8 B all_reduce: 31
    iterations, 124 us each, against 26-42 us in longer runs)."""
    batch_seconds = args.time_per_point / args.samples
    n = 1
    while True:
        per = timed(n)
        if per * n >= batch_seconds / 4 or n >= args.max_iters:
            break
        n = min(2 * n, args.max_iters)
    return int(min(args.max_iters, max(args.min_iters, batch_seconds / max(per, 1e-7))))


def round_parts(args) -> list[argparse.Namespace]:
    """What one round runs, one job each: every op at once when there is a
    single round, else one op at a time, so that each op's rounds are spread
    over the run's minutes rather than run back to back."""
    if args.rounds == 1:
        return [args]
    return [argparse.Namespace(**{**vars(args), "ops": op}) for op in args.ops.split(",")]


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per (world, backend, op, bytes): with several rounds, the
    median of the rounds' medians, its min .. max over the rounds, and the
    bandwidths of that median. A single round's rows pass through."""
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        points.setdefault((r["world"], r["backend"], r["op"], r["bytes"]), []).append(r)
    out = []
    for (world, _, op, nbytes), group in points.items():
        times = sorted(r["time_us"] for r in group)
        row = {k: v for k, v in group[0].items() if k != "round"}
        row["rounds"] = len(group)
        if len(group) > 1 and op != HOST_OP:
            med = statistics.median(times)
            algbw = nbytes / (med * 1e-6) / 1e9
            row.update(time_us=med, time_min_us=times[0], time_max_us=times[-1],
                       spread_pct=100 * (times[-1] - times[0]) / med,
                       algbw_GBps=algbw, busbw_GBps=algbw * FACTOR[op](world))
        out.append(row)
    return out


def add_sweep_options(p: argparse.ArgumentParser) -> None:
    """The options of a sweep that every peer's benchmark shares (ops, dtype,
    sizes, timing conventions, output), so all are measured alike."""
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float32",
                   help="element type of every tensor (bfloat16: what tensor-parallel inference sends)")
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    p.add_argument("--quick", action="store_true",
                   help="sizes up to 1 MiB and shorter timing (a smoke run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time-per-point", type=float, default=0.25,
                   help="seconds of timed iterations per (op, size, backend), "
                        "all --samples batches together")
    p.add_argument("--samples", type=int, default=5,
                   help="timed batches per (op, size, backend); the median is reported, "
                        "with the spread (min .. max) of the batches")
    p.add_argument("--min-iters", type=int, default=3, help="iterations per timed batch, at least")
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--timeout", type=float, default=1800, help="per world size, seconds")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="tensors on CPU (peer: gloo) or CUDA (peer: nccl)")
    p.add_argument("--worlds", default=None,
                   help="world sizes, e.g. 2,4 (default: 2,4 on CPU; 1 and #GPUs on CUDA)")
    p.add_argument("--backends", default=None,
                   help="the first is the default group; ratios are second / first "
                        "(default: tccomm,gloo on CPU, tccomm,nccl on CUDA); "
                        "openmpi adds Open MPI, measured in the same ranks (CPU, optional)")
    p.add_argument("--host-count", type=int, default=256,
                   help="CUDA, world 1: floats per all_reduce in the host-time measurement")
    p.add_argument("--host-iters", type=int, default=2000,
                   help="CUDA, world 1: calls per round of the host-time measurement")
    p.add_argument("--host-chunk", type=int, default=50,
                   help="CUDA, world 1: calls timed between two device synchronizes "
                        "(outside the clock) in the host-time measurement")
    p.add_argument("--host-only", action="store_true",
                   help="CUDA: only the host time per eager all_reduce call, at world size 1 "
                        "(no sweep)")
    p.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    add_sweep_options(p)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each world size's sweep this many times, one op at a time; "
                        "each point reports the median of its rounds' medians and their "
                        "spread (default 1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backends is None:
        args.backends = "tccomm,nccl" if args.device == "cuda" else "tccomm,gloo"
    if args.device == "cuda" and not args.worker:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA GPU is visible")
        args.gpus = torch.cuda.device_count()
    if args.host_only:
        if args.device != "cuda":
            p.error("--host-only measures CUDA ops: it needs --device cuda")
        if args.worlds not in (None, "1"):
            p.error("--host-only runs at world size 1 only")
        args.worlds = "1"
    if args.worlds is None:
        args.worlds = "2,4" if args.device == "cpu" else ",".join(
            str(w) for w in sorted({1, max(2, args.gpus)}))
    if args.samples < 1:
        p.error("--samples must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.quick:
        args.max_bytes = min(args.max_bytes, 1 << 20)
        args.time_per_point = min(args.time_per_point, 0.05)
        args.warmup = min(args.warmup, 2)
    if MPI in args.backends.split(",") and args.device == "cuda":
        p.error("openmpi is measured on CPU tensors only")
    if args.worker:
        if "tccomm" in args.backends.split(","):
            import torch  # noqa: F401  (the entry point registers tccomm)
            import torchcomm_backend  # noqa: F401
        worker(args)
        return

    mpi = MPI in args.backends.split(",")
    if mpi:
        import bench_mpi
        why = bench_mpi.missing()
        if why:
            print(f"{MPI}: not available ({why}); going on without it")
            mpi = False
            args.backends = ",".join(b for b in args.backends.split(",") if b != MPI)
            if not args.backends:
                raise SystemExit("no backend left to measure")

    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "bench_" + time.strftime("%Y%m%d-%H%M%S"))
    memcpy = memcpy_bandwidth()  # the CPU reference line; on CUDA only for context
    print(f"single-core memcpy bandwidth: {memcpy:.2f} GB/s; "
          f"transport: TCCOMM_TRANSPORT={os.environ.get('TCCOMM_TRANSPORT', '(unset: auto)')}")
    worlds = [int(w) for w in args.worlds.split(",")]
    shared = ({w: shared_memcpy_bandwidth(w) for w in worlds}
              if args.device == "cpu" and not args.host_only else {})
    t0 = time.monotonic()
    rows = []
    for world in worlds:
        what = ("host time per eager all_reduce call only" if args.host_only
                else f"{human(args.min_bytes)} .. {human(args.max_bytes)}")
        print(f"\n== {world} ranks, {args.backends}, {what}", flush=True)
        for k in range(args.rounds):
            raw = f"{stem}.round{k}.jsonl"
            for part in round_parts(args):
                if args.rounds > 1:
                    print(f"-- round {k + 1}/{args.rounds}, {part.ops}: {args.backends}", flush=True)
                run_world(part, world, raw)
            if os.path.exists(raw):
                rows += [dict(json.loads(line), round=k) for line in open(raw)]
                os.remove(raw)
    report(args, combine_rounds(rows), memcpy, stem, shared)
    print(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
