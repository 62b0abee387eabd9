"""The TorchComm-style API of tccomm: a communicator from the torchrun
environment, sync and async collectives, point-to-point, and a split.

    torchrun --nproc-per-node 2 examples/torchcomm_allreduce.py

Code written for TorchComm runs by changing the backend string to "tccomm".
Prints one line per rank and exits nonzero if any result is wrong.
"""

import argparse
import sys

import torch

import torchcomm_backend as tc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="tccomm")
    args = parser.parse_args()

    comm = tc.new_comm(args.backend, torch.device("cpu"))  # store: the torchrun environment
    rank, world = comm.get_rank(), comm.get_size()
    errors = []

    # all_reduce, synchronous: rank r contributes r everywhere.
    t = torch.ones(10) * rank
    comm.all_reduce(t, tc.ReduceOp.SUM, async_op=False)
    if not torch.equal(t, torch.full((10,), float(sum(range(world))))):
        errors.append(f"all_reduce: {t.tolist()}")

    # all_to_all_v_single, asynchronous: rank r sends j + 1 elements to rank j.
    in_splits = [j + 1 for j in range(world)]
    out_splits = [rank + 1] * world
    inp = torch.cat([torch.full((j + 1,), float(rank * 100 + j)) for j in range(world)])
    out = torch.empty(sum(out_splits))
    work = comm.all_to_all_v_single(out, inp, out_splits, in_splits, async_op=True)
    work.wait()
    want = torch.cat([torch.full((rank + 1,), float(r * 100 + rank)) for r in range(world)])
    if not torch.equal(out, want):
        errors.append(f"all_to_all_v_single: {out.tolist()}")

    # send / recv around a ring (even ranks send first).
    if world > 1:
        got = torch.empty(3)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            comm.send(torch.full((3,), float(rank)), nxt, async_op=False)
            comm.recv(got, prv, async_op=False)
        else:
            comm.recv(got, prv, async_op=False)
            comm.send(torch.full((3,), float(rank)), nxt, async_op=False)
        if not torch.equal(got, torch.full((3,), float(prv))):
            errors.append(f"recv: {got.tolist()}")

    # split: every rank calls it; here one group of all ranks in reverse order.
    sub = comm.split(list(range(world))[::-1])
    x = torch.tensor([float(sub.get_rank())])
    sub.all_reduce(x, tc.ReduceOp.MAX, async_op=False)
    if x.item() != world - 1 or sub.get_rank() != world - 1 - rank:
        errors.append(f"split: rank {sub.get_rank()}, max {x.item()}")
    sub.finalize()

    comm.barrier(async_op=False)
    comm.finalize()
    status = "OK" if not errors else "FAILED: " + "; ".join(errors)
    print(f"rank {rank}/{world} torchcomm api: {status}", flush=True)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
