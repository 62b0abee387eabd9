"""DistributedDataParallel on tccomm: a small MLP learns a fixed random
linear map from synthetic data, each rank on its own shard.

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 200

Rank 0 prints the loss; at the end every rank checks that its parameters are
bit-identical to rank 0's (DDP keeps replicas in sync only if every rank
receives exactly the same averaged gradients) and exits nonzero otherwise.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="tccomm")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same target map on every rank
    target = torch.randn(32, 8)
    torch.manual_seed(100 + rank)  # different initial weights: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard

    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.equal(flat, ref)
    sys.stdout.write(f"rank {rank}/{world}: parameters "
                     f"{'identical to' if same else 'DIFFER from'} rank 0's after "
                     f"{args.steps} steps\n")
    sys.stdout.flush()
    del ddp, opt  # release DDP's hold on the group before destroying it
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
