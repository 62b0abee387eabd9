"""DDP on the backend under test ends with the same parameters as on gloo
(suite "ddp", reported by tests/test_ddp.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _registry import add
from _training import KEEP_ALIVE, assert_same_params, train_steps


def c_ddp_matches_gloo(ctx):
    """5 DDP steps on the backend under test end with the same parameters
    as the same run on gloo (a gloo group in the same processes)."""
    import copy
    from torch.nn.parallel import DistributedDataParallel as DDP
    W, r = ctx.world, ctx.rank
    torch.manual_seed(1234 + r)  # different init per rank: DDP's broadcast matters
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 4))
    ref_model = copy.deepcopy(model)
    gloo = dist.new_group(list(range(W)), backend="gloo")
    try:
        runs = {}
        for name, m, pg in (("test", model, None), ("gloo", ref_model, gloo)):
            ddp = DDP(m, process_group=pg, bucket_cap_mb=0.001)  # several buckets
            # Kept alive for the rest of the process: with torch 2.13, freeing
            # the last reference to a gloo group from Python (here: the DDP
            # reducer's) deadlocks (~ProcessGroupGloo joins a gloo thread that
            # waits for the GIL held by the destructor's caller).
            KEEP_ALIVE.append(ddp)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            runs[name] = train_steps(ddp, opt, 5, "ddp", r, 16)
        assert_same_params(ctx, runs["test"], runs["gloo"], None, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group(gloo)


add("ddp_matches_gloo", "ddp", c_ddp_matches_gloo,
    specs=("w2-shm-env", "w3-tcp-env", "w4-shm-tcpinit"))
