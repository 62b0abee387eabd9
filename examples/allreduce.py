"""A few collectives on CPU tensors over tccomm, each checked against the
value it must produce.

    torchrun --nproc-per-node 4 examples/allreduce.py
    TCCOMM_TRANSPORT=tcp torchrun --nproc-per-node 4 examples/allreduce.py

Prints one line per rank and exits nonzero if any result is wrong.
`import torchcomm_backend` is not needed: the package's entry point registers
the "tccomm" backend when torch is imported.
"""

import argparse
import sys

import torch
import torch.distributed as dist

# torch 2.14 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
# (the old names still work there, with a deprecation warning).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="tccomm")
    parser.add_argument("--numel", type=int, default=1 << 20)
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # env:// rendezvous, set up by torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.numel
    errors = []

    def check(name, got, expected):
        if not torch.equal(got, expected):
            bad = (got != expected).sum().item()
            errors.append(f"{name}: {bad} of {got.numel()} elements wrong")

    # all_reduce SUM: rank r contributes r + 1 everywhere -> 1 + 2 + ... + world
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t)
    check("all_reduce(SUM)", t, torch.full((n,), world * (world + 1) / 2))

    # all_reduce MAX on integers
    t = torch.arange(n, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    check("all_reduce(MAX)", t, torch.arange(n, dtype=torch.int64) * world)

    # async all_reduce AVG, bfloat16 (accumulated in float32, rounded once)
    t = torch.full((1000,), float(2 * rank), dtype=torch.bfloat16)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    check("all_reduce(AVG, async)", t, torch.full((1000,), float(world - 1),
                                                  dtype=torch.bfloat16))

    # broadcast from the last rank
    t = torch.arange(n, dtype=torch.float32) if rank == world - 1 else torch.zeros(n)
    dist.broadcast(t, src=world - 1)
    check("broadcast", t, torch.arange(n, dtype=torch.float32))

    # all_gather_into_tensor: rank r contributes [r, r, ...]
    out = torch.empty(world * 1000, dtype=torch.int32)
    all_gather_single(out, torch.full((1000,), rank, dtype=torch.int32))
    check("all_gather_into_tensor", out,
          torch.arange(world, dtype=torch.int32).repeat_interleave(1000))

    # reduce_scatter_tensor: everyone sends [0, 1, ..., world-1] blocks; rank r gets world * r
    inp = torch.arange(world, dtype=torch.float64).repeat_interleave(1000)
    out = torch.empty(1000, dtype=torch.float64)
    reduce_scatter_single(out, inp)
    check("reduce_scatter_tensor", out, torch.full((1000,), float(world * rank),
                                                   dtype=torch.float64))

    # all_to_all_single: block j of rank r's input goes to rank j
    inp = torch.tensor([100 * rank + j for j in range(world)])
    out = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(out, inp)
    check("all_to_all_single", out, torch.tensor([100 * j + rank for j in range(world)]))

    # all_gather_object
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    if objs != [{"rank": q} for q in range(world)]:
        errors.append(f"all_gather_object: got {objs}")

    dist.barrier()
    status = "OK" if not errors else "FAILED: " + "; ".join(errors)
    # one write per line, so the lines of the ranks do not interleave
    sys.stdout.write(f"rank {rank}/{world} backend={dist.get_backend()}: "
                     f"8 collectives, {status}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
