"""One-sided windows of tccomm's TorchComm-style API (ranks on one host).

    torchrun --nproc-per-node 2 examples/torchcomm_window.py

Every rank registers a buffer, puts a block into its right neighbour's
buffer, signals it, waits for its left neighbour's signal, and checks what
landed in its own buffer and what a zero-copy view of the neighbour shows.
"""

import argparse
import sys

import torch

import torchcomm_backend as tc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="tccomm")
    args = parser.parse_args()

    comm = tc.new_comm(args.backend, torch.device("cpu"))
    rank, world = comm.get_rank(), comm.get_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    block = 4

    win = comm.new_window()
    buf = torch.zeros(block * world)
    win.tensor_register(buf)  # collective; buf now lives in the window
    comm.barrier(async_op=False)  # every buffer is registered before any put

    # Write my block at offset block * rank of my right neighbour, then tell it.
    win.put(torch.full((block,), float(rank + 1)), nxt, block * rank, async_op=False)
    win.signal(nxt, async_op=False)
    win.wait_signal(prv, async_op=False)  # the left neighbour's put is visible now

    errors = []
    want = torch.zeros(block * world)
    want[block * prv:block * (prv + 1)] = prv + 1
    if not torch.equal(buf, want):
        errors.append(f"own buffer {buf.tolist()}")
    comm.barrier(async_op=False)  # every rank's put has landed
    view = win.map_remote_tensor(nxt)
    if view[block * rank].item() != rank + 1:
        errors.append(f"view of rank {nxt}: {view.tolist()}")

    comm.barrier(async_op=False)
    win.tensor_deregister()
    comm.finalize()
    status = "OK" if not errors else "FAILED: " + "; ".join(errors)
    print(f"rank {rank}/{world} torchcomm window: {status}", flush=True)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
