"""Training runs that the DDP and parallelism cases compare with the same run
on gloo in the same processes."""

from __future__ import annotations

import torch

from _reference import seed

# DDP models and gloo groups kept alive for the rest of the process: with
# torch 2.13, freeing the last reference to a gloo group from Python deadlocks
# (see c_ddp_matches_gloo in _cases_ddp.py).
KEEP_ALIVE: list = []


def assert_same_params(ctx, got, ref, what, rtol: float, atol: float) -> None:
    """The parameters of a run on the backend under test equal those of the
    same run on gloo (`ref`), within rtol/atol; the result is also recorded
    for the harness's check that every rank ended alike."""
    prefix = f"{what}: " if what else ""
    for k, (a, b) in enumerate(zip(got, ref)):
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"{prefix}parameter {k} differs from the gloo run: {e}") from None
    ctx.digest(*got)


def train_steps(ddp, opt, steps: int, key: str, rank: int, in_dim: int, out_dim: int = 4):
    """`steps` optimizer steps of a DDP model on seeded random batches (the
    same for a given key and rank on every backend); the parameters after."""
    for step in range(steps):
        g = torch.Generator().manual_seed(seed(key, step, rank))
        x = torch.randn(8, in_dim, generator=g)
        y = torch.randn(8, out_dim, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]
