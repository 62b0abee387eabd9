"""Open MPI as one more peer of bench_collectives.py: the same points, measured
and verified the same way, written as CSV rows with backend "openmpi".

    python bench/bench_mpi.py --worlds 2 --max-bytes 4M             # Open MPI alone
    python bench/bench_collectives.py --backends tccomm,gloo,openmpi  # next to tccomm and gloo

Optional: needs Open MPI's mpirun and mpi4py (apt-get install openmpi-bin
libopenmpi-dev; pip install mpi4py, which builds against that Open MPI).
Without them it says so in one line (this script then exits 2;
bench_collectives.py goes on with its other backends).

This file is both the launcher and the rank program. The launcher starts, for
each world size, one job

    mpirun --allow-run-as-root --oversubscribe -np N --bind-to none
           --mca pml ob1 --mca btl self,vader
           --mca btl_vader_single_copy_mechanism cma|none  python bench_mpi.py --rank ...

(pml ob1: otherwise a UCX pml, when Open MPI has one, takes over and the btl
choice means nothing; vader with CMA single copy is what Open MPI uses on one
host, and the launcher first checks that CMA is permitted here, falling back
to vader's copy through shared memory when the ptrace policy forbids it).

Per point, as in bench_collectives.worker: rank-dependent small-integer
inputs, one run whose whole output every rank compares with the plain-torch
reference (a wrong result on any rank aborts the run), --warmup iterations,
one timed iteration to choose the iterations per batch, --samples batches
each started at a barrier of a communicator that is never measured; a
batch's time is the slowest rank's time per iteration, a point reports the
median. Buffers are torch tensors handed to MPI as numpy views (no copy):
float32 as MPI_FLOAT, float64 as MPI_DOUBLE, bfloat16 and float16 as their
raw 16-bit words (MPI_UINT16_T): fine for moving data, but Open MPI has no
MPI_SUM on 16-bit floats, so allreduce and reduce_scatter in those types are
reported as not available rather than measured on some other type.

MPI calls: allreduce MPI_Allreduce(MPI_IN_PLACE, SUM) (in place, as
dist.all_reduce), allgather MPI_Allgather, reduce_scatter
MPI_Reduce_scatter_block (SUM), broadcast MPI_Bcast (root 0), alltoall
MPI_Alltoall. Sizes, busbw factors and the CSV are bench_collectives.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import bench_collectives as bc  # noqa: E402  (sizes, inputs, reference, report)

BACKEND = "openmpi"
INSTALL = "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"
REDUCTIONS = ("allreduce", "reduce_scatter")


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------


def missing() -> str | None:
    """Why Open MPI cannot be measured here (every missing part), or None."""
    why = []
    try:
        import mpi4py  # noqa: F401  (the package alone: MPI is not initialized)
    except ImportError as e:
        why.append(f"mpi4py is not installed in {sys.executable} ({e})")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        why.append("mpirun is not on PATH")
    else:
        version = mpirun_version(mpirun)
        if "Open MPI" not in version:
            why.append(f"{mpirun} is not Open MPI's mpirun ({version or 'no --version'})")
    return "; ".join(why) + f"; {INSTALL}" if why else None


def mpirun_version(mpirun: str) -> str:
    """First line of `mpirun --version`, e.g. 'mpirun (Open MPI) 4.1.4'."""
    try:
        out = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def cma_problem() -> str:
    """'' when one process may read another's memory with process_vm_readv
    (Linux cross-memory attach, vader's single-copy path), else why not.

    Two forked siblings, as two ranks are: the first allows any process to
    attach to it (as Open MPI does for its ranks, which matters under Yama
    ptrace_scope 1) and holds a pattern; the second reads it."""
    import ctypes

    class IOVec(ctypes.Structure):
        _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    pattern = b"tccomm-cma-probe"
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    buf = ctypes.create_string_buffer(len(pattern))
    holder = os.fork()
    if holder == 0:  # child 1: holds the pattern until the reader is done
        os.close(ready_r)
        os.close(done_w)
        libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
        buf.raw = pattern
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)
    reader = os.fork()
    if reader == 0:  # child 2: reads child 1's buffer (same address after fork)
        got = ctypes.create_string_buffer(len(pattern))
        local = IOVec(ctypes.cast(got, ctypes.c_void_p), len(pattern))
        remote = IOVec(ctypes.cast(buf, ctypes.c_void_p), len(pattern))
        libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(IOVec), ctypes.c_ulong,
                                          ctypes.POINTER(IOVec), ctypes.c_ulong, ctypes.c_ulong]
        n = libc.process_vm_readv(holder, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        err = ctypes.get_errno()
        os._exit(0 if n == len(pattern) and got.raw == pattern else min(255, err or 254))
    _, status = os.waitpid(reader, 0)
    os.write(done_w, b"x")
    os.waitpid(holder, 0)
    for fd in (ready_r, done_r, done_w):
        os.close(fd)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return ""
    if code == 254:
        return "process_vm_readv read something else"
    return f"process_vm_readv failed: {os.strerror(code)} (ptrace policy or seccomp)"


_CMA: list[str] = []  # the probe's answer, once per launcher process


def mpirun_command(world: int) -> tuple[list[str], str]:
    """The mpirun command line (without the rank program) and a line saying
    what it runs on."""
    if not _CMA:
        _CMA.append(cma_problem())
    mechanism = "none" if _CMA[0] else "cma"
    note = ("single copy: CMA (process_vm_readv between ranks works)" if not _CMA[0] else
            f"no single copy: {_CMA[0]}; vader copies through shared memory twice")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world),
           "--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "self,vader",
           "--mca", "btl_vader_single_copy_mechanism", mechanism]
    return cmd, f"{mpirun_version(shutil.which('mpirun') or 'mpirun')}, btl self,vader, {note}"


def run_world(args, world: int, results: str) -> None:
    """Runs the MPI job for one world size; rank 0 appends its rows (JSON
    lines) to `results`. A failed job removes `results` and stops the run, as
    a failed rank does in bench_collectives.run_world."""
    cmd, note = mpirun_command(world)
    print(f"-- {world} ranks, {BACKEND}: {note}", flush=True)
    cmd += [sys.executable, os.path.abspath(__file__), "--rank", "--results", results,
            "--ops", args.ops, "--dtype", args.dtype,
            "--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes),
            "--warmup", str(args.warmup), "--time-per-point", str(args.time_per_point),
            "--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters),
            "--samples", str(args.samples)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    # A session of its own, so that a job past the timeout goes down with all its ranks.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise SystemExit(f"world {world}: {BACKEND} did not finish within {args.timeout} s")
    if code != 0:
        if os.path.exists(results):
            os.remove(results)  # a run with a failed rank reports nothing
        raise SystemExit(f"world {world}: the {BACKEND} job failed (mpirun exit code {code}); "
                         "no results written")


# ---------------------------------------------------------------------------
# rank program (under mpirun)
# ---------------------------------------------------------------------------


def say(line: str, stream=sys.stderr) -> None:
    """One write per line: mpirun forwards the ranks' output in pieces, and
    print() under PYTHONUNBUFFERED writes the text and its newline apart."""
    stream.write(line + "\n")
    stream.flush()


def rank_main(args) -> None:
    import statistics

    import mpi4py
    # One thread calls MPI, as one thread calls tccomm: no MPI_THREAD_MULTIPLE
    # locking in Open MPI's path (mpi4py asks for it by default).
    mpi4py.rc.thread_level = "single"
    from mpi4py import MPI
    import torch

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    # Barriers between timed batches and the agreement on results: a
    # communicator of their own, never measured (bench_collectives' ctl group).
    ctl = comm.Dup()
    rank, world = comm.Get_rank(), comm.Get_size()
    vendor = MPI.get_vendor()
    if vendor[0] != "Open MPI":
        say(f"mpi4py runs on {vendor[0]}, not Open MPI: rebuild it "
            "(pip install --no-binary mpi4py --force-reinstall mpi4py)")
        raise SystemExit(1)
    dtype = getattr(torch, args.dtype)
    elem = bc.DTYPE_BYTES[args.dtype]
    # 16-bit floats travel as raw 16-bit words; only data movement is valid on them.
    mpi_type = {"float32": MPI.FLOAT, "float64": MPI.DOUBLE}.get(args.dtype, MPI.UINT16_T)
    has_sum = args.dtype in ("float32", "float64")

    def buf(t):
        """The tensor's memory for MPI: a numpy view (bfloat16 has no numpy type)."""
        return [(t.view(torch.int16) if elem == 2 else t).numpy(), mpi_type]

    def make(op, size_bytes):
        """As bench_collectives.worker's make: (fn, reset, output, actual
        bytes, per-rank block)."""
        count = max(1, size_bytes // elem)
        per = max(1, count // world)
        n_in = {"allreduce": count, "broadcast": count, "allgather": per}.get(op, per * world)
        inp = torch.empty(n_in, dtype=dtype)
        b_in = buf(inp)

        def reset():
            inp.copy_(bc.rank_input(torch, rank, n_in, dtype))
        if op == "allreduce":
            return (lambda: comm.Allreduce(MPI.IN_PLACE, b_in, MPI.SUM)), reset, inp, count * elem, per
        if op == "broadcast":
            return (lambda: comm.Bcast(b_in, root=0)), reset, inp, count * elem, per
        out = torch.empty(per if op == "reduce_scatter" else per * world, dtype=dtype)
        b_out = buf(out)
        if op == "allgather":
            fn = lambda: comm.Allgather(b_in, b_out)  # noqa: E731
        elif op == "reduce_scatter":
            fn = lambda: comm.Reduce_scatter_block(b_in, b_out, MPI.SUM)  # noqa: E731
        elif op == "alltoall":
            fn = lambda: comm.Alltoall(b_in, b_out)  # noqa: E731
        else:
            raise ValueError(op)
        return fn, reset, out, per * world * elem, per

    def agree_max(value: float) -> float:
        return ctl.allreduce(value, op=MPI.MAX)

    def verify(op, actual, fn, reset, output, per) -> None:
        output.fill_(-1.0)  # rank_input is never negative: stale data cannot pass
        reset()  # after the fill: allreduce and broadcast work in place
        fn()
        want = bc.expected_output(torch, op, rank, world, actual // elem, per, dtype)
        problem = bc.mismatch(torch, output, want)
        if problem:
            say(f"WRONG RESULT: backend {BACKEND}, op {op}, size {bc.human(actual)}, "
                f"{world} ranks, rank {rank}: {problem}")
        if agree_max(1.0 if problem else 0.0):
            say(f"rank {rank}: backend {BACKEND} computed a wrong {op} of "
                f"{bc.human(actual)} on {world} ranks; benchmark aborted")
            raise SystemExit(1)

    def timed_batch(fn, iters: int) -> float:
        ctl.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return agree_max((time.perf_counter() - t0) / iters)

    out = open(args.results, "a") if rank == 0 else None
    sizes = []  # bench_collectives.worker's sizes
    s = args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 2
    for op in args.ops.split(","):
        if op in REDUCTIONS and not has_sum:
            if rank == 0:
                say(f"  n={world} {op:15s} {BACKEND}: not available in {args.dtype} "
                    "(Open MPI has no MPI_SUM on 16-bit floats)", sys.stdout)
            continue
        for size in sizes:
            fn, reset, output, actual, per = make(op, size)
            if actual != size:  # under one element per rank: no such point
                continue
            verify(op, actual, fn, reset, output, per)
            for _ in range(args.warmup):
                fn()
            iters = bc.calibrated_iters(lambda n: timed_batch(fn, n), args)
            samples = [timed_batch(fn, iters) for _ in range(args.samples)]
            med = statistics.median(samples)
            lo, hi = min(samples), max(samples)
            if out:
                algbw = actual / med / 1e9
                out.write(json.dumps({
                    "world": world, "backend": BACKEND, "device": "cpu", "op": op,
                    "bytes": actual, "count": actual // elem, "dtype": args.dtype,
                    "iters": iters, "samples": args.samples, "time_us": med * 1e6,
                    "time_min_us": lo * 1e6, "time_max_us": hi * 1e6,
                    "spread_pct": 100 * (hi - lo) / med, "verified": True,
                    "algbw_GBps": algbw, "busbw_GBps": algbw * bc.FACTOR[op](world)}) + "\n")
                out.flush()
                say(f"  n={world} {op:15s} {bc.human(actual):>9s}  {BACKEND}: {med * 1e6:10.1f} us "
                    f"({100 * (hi - lo) / med:5.1f}%)", sys.stdout)
    ctl.Barrier()
    if out:
        out.close()


# ---------------------------------------------------------------------------
# standalone run
# ---------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="world sizes, e.g. 2,4")
    bc.add_sweep_options(p)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.max_bytes = min(args.max_bytes, 1 << 20)
        args.time_per_point = min(args.time_per_point, 0.05)
        args.warmup = min(args.warmup, 2)
    if args.rank:
        rank_main(args)
        return 0
    why = missing()
    if why:
        print(f"{BACKEND}: not available ({why})")
        return 2
    if args.samples < 1:
        p.error("--samples must be at least 1")
    unknown = set(args.ops.split(",")) - set(bc.OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}; choose from {','.join(bc.OPS)}")

    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "bench_mpi_" + time.strftime("%Y%m%d-%H%M%S"))
    raw = stem + ".jsonl"
    memcpy = bc.memcpy_bandwidth()
    print(f"single-core memcpy bandwidth: {memcpy:.2f} GB/s")
    t0 = time.monotonic()
    for world in [int(w) for w in args.worlds.split(",")]:
        print(f"\n== {world} ranks, {BACKEND}, {bc.human(args.min_bytes)} .. "
              f"{bc.human(args.max_bytes)}", flush=True)
        run_world(args, world, raw)
    rows = [json.loads(line) for line in open(raw)] if os.path.exists(raw) else []
    if os.path.exists(raw):
        os.remove(raw)
    if not rows:
        print("no points measured (nothing available in this dtype, or no size fits)")
        return 0
    args.backends = BACKEND  # report() tabulates and plots the backends it is given
    bc.report(args, rows, memcpy, stem)
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
