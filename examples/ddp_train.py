"""DistributedDataParallel on tccomm: a small MLP learns a fixed random
linear map from synthetic data, each rank on its own shard.

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 200

Rank 0 prints the loss. Every rank also trains, in the same process, a
single-process reference: the same model with rank 0's initial weights
(which DDP broadcasts) on all ranks' shards at once. With equal shards the
loss of the whole batch is the mean of the ranks' losses, so its gradient is
exactly what DDP averages: the two must stay together. At the end every rank
checks, and exits nonzero otherwise, that
  * its parameters are bit-identical to rank 0's, compared through the
    launcher's key-value store (not through the backend under test);
  * its parameters and the loss on its shard match the reference's;
  * the loss (of all shards, by the reference) went down by at least 10%.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# Float32 sums in a different order (DDP averages per-rank gradients, the
# reference takes one gradient of the whole batch) drift apart slowly;
# anything beyond this is a wrong result, not rounding.
RTOL, ATOL = 1e-3, 1e-4


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_as_rank0(flat: torch.Tensor, rank: int) -> bool:
    """Rank 0's parameters reach every rank through the store that the
    launcher set up for the rendezvous, independently of the backend."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("ddp_train/params0", flat.numpy().tobytes())
    return store.get("ddp_train/params0") == flat.numpy().tobytes()


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
    model = make_model(100 + rank)  # different initial weights: DDP broadcasts rank 0's
    reference = make_model(100)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=3e-3)
    shards = [torch.Generator().manual_seed(1000 + q) for q in range(world)]  # one per rank

    first_loss = last_loss = None
    worst_loss_gap = 0.0
    for step in range(args.steps):
        batches = [torch.randn(args.batch, 32, generator=g) for g in shards]
        x = batches[rank]
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()

        with torch.no_grad():
            ref_local = torch.nn.functional.mse_loss(reference(x), x @ target).item()
        worst_loss_gap = max(worst_loss_gap, abs(loss.item() - ref_local) / max(ref_local, 1e-12))
        everything = torch.cat(batches)
        ref_loss = torch.nn.functional.mse_loss(reference(everything), everything @ target)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        first_loss = ref_loss.item() if first_loss is None else first_loss
        last_loss = ref_loss.item()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {ref_loss.item():.5f} (all shards)", flush=True)

    flat = flat_params(model)
    identical = same_as_rank0(flat, rank)
    ref_flat = flat_params(reference)
    close = torch.allclose(flat, ref_flat, rtol=RTOL, atol=ATOL) and worst_loss_gap <= RTOL
    learned = last_loss < 0.9 * first_loss
    sys.stdout.write(
        f"rank {rank}/{world}: parameters {'identical to' if identical else 'DIFFER from'} "
        f"rank 0's after {args.steps} steps; "
        f"{'matches' if close else 'DOES NOT match'} the single-process run "
        f"(parameters within {(flat - ref_flat).abs().max().item():.1e}, "
        f"loss within {worst_loss_gap:.1e} relative); "
        f"loss {first_loss:.4f} -> {last_loss:.4f}{'' if learned else ' (NOT LEARNING)'}\n")
    sys.stdout.flush()
    del ddp, opt  # release DDP's hold on the group before destroying it
    dist.destroy_process_group()
    return 0 if identical and close and learned else 1


if __name__ == "__main__":
    sys.exit(main())
