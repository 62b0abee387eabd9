"""Host time per functional-collective call: tccomm's fast path, tccomm
without it, and gloo, on small CPU tensors (or nccl on CUDA tensors).

    python bench/bench_funcol.py                  # world sizes 1 and 2
    python bench/bench_funcol.py --worlds 1 --iters 5000
    python bench/bench_funcol.py --device cuda    # tccomm vs nccl, one GPU per rank

A functional collective (`torch.distributed._functional_collectives`, and
what `torch.compile` turns collectives into) is a `torch.ops._c10d_functional`
op plus a `wait_tensor`. tccomm installs its own kernels for those ops
(csrc/functional.cpp); `TCCOMM_FUNCOL_FASTPATH=0` leaves torch's kernels,
which go through the generic ProcessGroup dispatch. Each world size is run
twice, once per setting, and gloo is measured in both runs as the control.

Three ways of calling, each timed as microseconds per call (mean over
--iters calls, best of --repeats):
  op        torch.ops._c10d_functional.all_reduce + wait_tensor, as the code
            Inductor generates calls them
  eager     funcol.all_reduce(t, "sum", group) + wait
  compiled  a torch.compile(fullgraph=True) function calling funcol.all_reduce

At world size 1 this is pure host overhead; at 2 it includes the exchange.

--device cuda: CUDA tensors, nccl as the control, rank r on GPU r (a world
size needs that many GPUs; default worlds 1, and 2 with 2 GPUs or more).
The device is never synchronized inside the timed region: the calls are
timed in chunks of --chunk, the device synchronized between two chunks
outside the clock (wait_tensor on CUDA makes the stream wait, not the host).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _local_ranks import free_port


def time_per_call(fn, iters: int, repeats: int, sync=None, chunk: int = 0) -> float:
    """Microseconds per fn() call, best of `repeats` rounds of `iters` calls.
    With `sync` (CUDA), the calls are timed in chunks of `chunk` and sync()
    runs between two chunks, outside the clock."""
    for _ in range(max(10, iters // 10)):
        fn()
    if sync is None:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter_ns() - start) / iters / 1e3)
        return best
    sync()
    best = float("inf")
    for _ in range(repeats):
        spent, done = 0, 0
        while done < iters:
            n = min(max(1, chunk), iters - done)
            start = time.perf_counter_ns()
            for _ in range(n):
                fn()
            spent += time.perf_counter_ns() - start
            done += n
            sync()
        best = min(best, spent / iters / 1e3)
    return best


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    rank = int(os.environ["RANK"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else None
    dist.init_process_group("tccomm")
    peer = "nccl" if cuda else "gloo"
    groups = {"tccomm": dist.group.WORLD, peer: dist.new_group(backend=peer)}
    ops = torch.ops._c10d_functional
    results = []
    for backend, group in groups.items():
        name = group.group_name
        t = torch.ones(args.elems, device=device)

        def op_call():
            ops.wait_tensor(ops.all_reduce(t, "sum", name))

        def eager_call():
            funcol.all_reduce(t, "sum", group).wait()

        @torch.compile(fullgraph=True)
        def compiled_fn(x):
            return funcol.all_reduce(x, "sum", group) + 0

        def compiled_call():
            compiled_fn(t)

        # The result is checked once, so a broken path cannot look fast.
        expected = torch.full((args.elems,), float(dist.get_world_size()), device=device)
        for call, label in ((op_call, "op"), (eager_call, "eager"), (compiled_call, "compiled")):
            if label == "compiled":
                got = compiled_fn(t)
            elif label == "eager":
                got = funcol.all_reduce(t, "sum", group).wait()
            else:
                got = ops.wait_tensor(ops.all_reduce(t, "sum", name))
            assert torch.equal(got, expected), (backend, label)
            dist.barrier(group)
            us = time_per_call(call, args.iters, args.repeats, sync, args.chunk)
            results.append({"backend": backend, "call": label, "us": us})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run_world(args, world: int, fastpath: bool) -> list[dict]:
    out = f"/tmp/bench_funcol_{os.getpid()}_{world}_{int(fastpath)}.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), TCCOMM_FUNCOL_FASTPATH="1" if fastpath else "0",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", "--out", out,
           "--iters", str(args.iters), "--repeats", str(args.repeats), "--elems", str(args.elems)]
    if args.device == "cuda":
        cmd += ["--device", "cuda", "--chunk", str(args.chunk)]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
    if any(p.wait() != 0 for p in procs):
        sys.exit(f"a rank of world size {world} failed")
    with open(out) as f:
        rows = json.load(f)
    os.unlink(out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="CPU tensors (control: gloo) or CUDA tensors (control: nccl)")
    parser.add_argument("--worlds", default=None,
                        help="world sizes (default 1,2; CUDA: 1, and 2 with 2 GPUs or more)")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--elems", type=int, default=2, help="float32 elements per tensor")
    parser.add_argument("--chunk", type=int, default=50,
                        help="CUDA: calls timed between two device synchronizes (outside the clock)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    peer = "gloo"
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            sys.exit("--device cuda: no CUDA GPU is visible")
        if args.worlds is None:
            args.worlds = "1,2" if gpus >= 2 else "1"
        if max(int(w) for w in args.worlds.split(",")) > gpus:
            sys.exit(f"--device cuda: world sizes {args.worlds} need a GPU per rank; {gpus} visible")
        peer = "nccl"
    if args.worlds is None:
        args.worlds = "1,2"

    print(f"host time per call, us (float32 x {args.elems}; best of {args.repeats} x {args.iters} calls)")
    print(f"{'world':>5} {'call':>9} {'fast path':>10} {'no fast path':>13} {peer:>8} {peer + '/fast':>10} {'nofast/fast':>12}")
    for world in (int(w) for w in args.worlds.split(",")):
        fast = {(r["backend"], r["call"]): r["us"] for r in run_world(args, world, True)}
        slow = {(r["backend"], r["call"]): r["us"] for r in run_world(args, world, False)}
        for call in ("op", "eager", "compiled"):
            f, s = fast[("tccomm", call)], slow[("tccomm", call)]
            g = (fast[(peer, call)] + slow[(peer, call)]) / 2
            print(f"{world:>5} {call:>9} {f:>10.2f} {s:>13.2f} {g:>8.2f} {g / f:>10.2f} {s / f:>12.2f}")


if __name__ == "__main__":
    main()
