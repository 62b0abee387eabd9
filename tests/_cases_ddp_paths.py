"""DDP's optional paths: gradient accumulation with no_sync, unused
parameters (find_unused_parameters), static_graph, uneven inputs under
torch.distributed.algorithms.join.Join and sparse gradients (an embedding
with sparse=True). Each ends with the same parameters as the same run on
gloo in the same processes. Also the sparse all_reduce those gradients use.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from _reference import seed
from _registry import add
from _training import KEEP_ALIVE, assert_same_params
from _cases_coverage import GROUP_SPECS, SUITE

IN_DIM, OUT_DIM = 12, 4


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; forward(x, head) uses only one head, so the
    other head's parameters get no gradient in that step."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(IN_DIM, 24), torch.nn.Tanh())
        self.head_a = torch.nn.Linear(24, OUT_DIM)
        self.head_b = torch.nn.Linear(24, OUT_DIM)

    def forward(self, x, head: str = "a"):
        h = self.trunk(x)
        return self.head_a(h) if head == "a" else self.head_b(h)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(IN_DIM, 20), torch.nn.ReLU(),
                               torch.nn.Linear(20, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, OUT_DIM))


def _batch(key, step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(seed(key, step, rank, micro))
    return torch.randn(8, IN_DIM, generator=g), torch.randn(8, OUT_DIM, generator=g)


def _loss(ddp, x, y, **kw):
    return torch.nn.functional.mse_loss(ddp(x, **kw), y)


def _versus_gloo(ctx, make_model, ddp_kwargs: dict, run, what: str, make_opt=None) -> None:
    """Builds a model (different initial weights per rank: DDP's broadcast
    matters), trains it with `run(ddp, opt, backend)` once on the group
    under test and once on a gloo group, and requires the same parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    W, r = ctx.world, ctx.rank
    torch.manual_seed(777 + r)
    model = make_model()
    ref_model = copy.deepcopy(model)
    gloo = dist.new_group(list(range(W)), backend="gloo")
    KEEP_ALIVE.append(gloo)  # see c_ddp_matches_gloo in _cases_ddp.py
    params = {}
    for name, m, pg in (("test", model, None), ("gloo", ref_model, gloo)):
        ddp = DDP(m, process_group=pg, bucket_cap_mb=0.001, **ddp_kwargs)
        KEEP_ALIVE.append(ddp)
        opt = (make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)))(ddp.parameters())
        run(ddp, opt, name)
        params[name] = [p.detach().clone() for p in ddp.module.parameters()]
    assert_same_params(ctx, params["test"], params["gloo"], what, rtol=1e-5, atol=1e-6)


def c_ddp_no_sync(ctx):
    """Gradient accumulation: 2 micro-batches under no_sync() (gradients stay
    local: equal to those of the plain module), then one that synchronizes;
    3 optimizer steps."""
    r = ctx.rank

    def run(ddp, opt, backend):
        for step in range(3):
            local = copy.deepcopy(ddp.module)  # the same weights, no DDP
            for micro in range(3):
                x, y = _batch("no_sync", step, r, micro)
                sync = micro == 2
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    _loss(ddp, x, y).backward()
                if not sync:
                    _loss(local, x, y).backward()
                    for (name, p), q in zip(ddp.module.named_parameters(), local.parameters()):
                        if not torch.equal(p.grad, q.grad):
                            raise AssertionError(
                                f"{backend}: step {step} micro-batch {micro}: the gradient of "
                                f"{name} under no_sync() is not the local one")
            opt.step()
            opt.zero_grad()

    _versus_gloo(ctx, _mlp, {}, run, "no_sync")


def c_ddp_find_unused(ctx):
    """find_unused_parameters=True, with head_b unused on even steps and
    head_a on odd ones; 4 steps."""
    r = ctx.rank

    def run(ddp, opt, backend):
        for step in range(4):
            x, y = _batch("unused", step, r)
            opt.zero_grad()
            _loss(ddp, x, y, head="a" if step % 2 == 0 else "b").backward()
            opt.step()

    _versus_gloo(ctx, TwoHeads, {"find_unused_parameters": True}, run, "find_unused_parameters")


def c_ddp_static_graph(ctx):
    """static_graph=True (head_b never used: the static graph records that
    in its first step); 4 steps."""
    r = ctx.rank

    def run(ddp, opt, backend):
        for step in range(4):
            x, y = _batch("static", step, r)
            opt.zero_grad()
            _loss(ddp, x, y, head="a").backward()
            opt.step()

    _versus_gloo(ctx, TwoHeads, {"static_graph": True}, run, "static_graph")


def c_ddp_join_uneven(ctx):
    """Join with uneven inputs: rank r trains on 2 + r batches; the ranks that
    run out join the others' all_reduces with zeros until the last one is done."""
    from torch.distributed.algorithms.join import Join
    r = ctx.rank

    def run(ddp, opt, backend):
        with Join([ddp]):
            for step in range(2 + r):
                x, y = _batch("join", step, r)
                opt.zero_grad()
                _loss(ddp, x, y).backward()
                opt.step()

    _versus_gloo(ctx, _mlp, {}, run, "Join with uneven inputs")


class SparseBag(torch.nn.Module):
    """An embedding bag with sparse gradients, then a dense head: DDP
    all_reduces the bag's gradient as a sparse COO tensor."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(50, 6, mode="sum", sparse=True)
        self.head = torch.nn.Linear(6, OUT_DIM)

    def forward(self, ids):
        return self.head(self.bag(ids))


def c_ddp_sparse_gradients(ctx):
    """DDP over an embedding with sparse=True: 4 SGD steps on ids that
    differ between ranks (and overlap), as on gloo."""
    r = ctx.rank

    def run(ddp, opt, backend):
        for step in range(4):
            g = torch.Generator().manual_seed(seed("sparse", step, r))
            ids = torch.randint(0, 50, (8, 3), generator=g)
            y = torch.randn(8, OUT_DIM, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(ids), y).backward()
            opt.step()

    # Plain SGD: sparse gradients allow no momentum.
    _versus_gloo(ctx, SparseBag, {}, run, "sparse gradients",
                 make_opt=lambda params: torch.optim.SGD(params, lr=0.05))


def _sparse_input(rank: int, shape, nnz: int, dense_tail=()):
    """Rank `rank`'s sparse COO input: `nnz` entries at seeded indices
    (duplicates included, so coalescing matters), small integer values so
    every sum is exact."""
    g = torch.Generator().manual_seed(seed("sparse_all_reduce", rank, tuple(shape)))
    sparse_dims = len(shape) - len(dense_tail)
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dims)])
    vals = torch.randint(-8, 9, (nnz, *dense_tail), generator=g).to(torch.float64)
    return torch.sparse_coo_tensor(idx, vals, shape)


def c_sparse_all_reduce(ctx):
    """all_reduce(SUM) of sparse COO tensors: every rank gets the sum of all
    ranks' tensors (reference: their dense sum), with ranks of different
    entry counts, a rank with none, and dense trailing dimensions. Another
    reduce op or a shape that differs between ranks raises on every rank."""
    W, r = ctx.world, ctx.rank
    for shape, dense_tail, counts in (((30,), (), [5 + 3 * q for q in range(W)]),
                                      ((7, 9, 4), (4,), [0 if q == 1 else 6 for q in range(W)])):
        t = _sparse_input(r, shape, counts[r], dense_tail)
        dist.all_reduce(t)
        want = sum(_sparse_input(q, shape, counts[q], dense_tail).to_dense() for q in range(W))
        if not t.is_sparse:
            raise AssertionError(f"sparse all_reduce of {shape}: the result is no longer sparse")
        ctx.compare(t.to_dense(), want, f"sparse all_reduce of {shape}")
    if ctx.strict:
        t = _sparse_input(r, (30,), 4)
        ctx.expect_error(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), r"allreduce",
                         r"SUM only", "sparse all_reduce with MAX")
        t = _sparse_input(r, (30 + (r == 1),), 4)
        ctx.expect_error(lambda: dist.all_reduce(t), r"allreduce", r"differs",
                         "sparse all_reduce of differing shapes")
        ctx.check_usable()


def _register():
    add("ddp-no_sync_accumulation", SUITE, c_ddp_no_sync, specs=GROUP_SPECS)
    add("ddp-find_unused_parameters", SUITE, c_ddp_find_unused, specs=GROUP_SPECS)
    add("ddp-static_graph", SUITE, c_ddp_static_graph, specs=GROUP_SPECS)
    add("ddp-join_uneven_inputs", SUITE, c_ddp_join_uneven, specs=GROUP_SPECS)
    add("ddp-sparse_gradients", SUITE, c_ddp_sparse_gradients, specs=GROUP_SPECS)
    add("sparse_all_reduce", SUITE, c_sparse_all_reduce, specs=GROUP_SPECS)


_register()
