"""Cases for behaviour off the happy path: future continuations that issue
and wait on further ops of the same group (DDP communication hooks),
Work.wait(timeout) with a late peer.

Registered into the registry (tests/_registry.py) and
reported by tests/test_reliability.py (suite "reliability"). References are
plain torch computations on every rank's inputs, or the same training run on
gloo in the same processes.
"""

from __future__ import annotations

import copy
import datetime
import re
import time

import torch
import torch.distributed as dist

from _messages import OP_RE
from _reference import ref_reduce
from _registry import add
from _training import KEEP_ALIVE, assert_same_params, train_steps

S = "reliability"


# --------------------------------------------------------------------------
# continuations that wait on later ops of their own group
# --------------------------------------------------------------------------

def _hook_states(name: str, pg):
    """(hook, state) for one of torch's DDP communication hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    if name == "powerSGD":
        # start at iteration 2: the later steps run the compressed path, whose
        # continuations wait on all_reduces of the same group.
        return ps.powerSGD_hook, ps.PowerSGDState(
            process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5, random_seed=7)
    if name == "batched_powerSGD":
        return ps.batched_powerSGD_hook, ps.PowerSGDState(
            process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5, random_seed=7)
    if name == "fp16_compress":
        return dh.fp16_compress_hook, pg
    if name == "bf16_compress":
        return dh.bf16_compress_hook, pg
    if name == "allreduce":
        return dh.allreduce_hook, pg
    raise ValueError(name)


def c_ddp_comm_hook_matches_gloo(ctx, hook):
    """6 DDP steps with one of torch's communication hooks end with the same
    parameters as the same run on gloo in the same processes."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    W, r = ctx.world, ctx.rank
    torch.manual_seed(4321 + r)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    ref_model = copy.deepcopy(model)
    gloo = dist.new_group(list(range(W)), backend="gloo")
    runs = {}
    for name, m, pg in (("test", model, dist.group.WORLD), ("gloo", ref_model, gloo)):
        # PowerSGD's continuations issue and wait on further all_reduces: with
        # several buckets, continuations of different buckets would race to
        # issue them, in a different order on each rank (on every backend
        # whose futures complete asynchronously; gloo deadlocks). One bucket
        # for them, several for the hooks whose continuations issue nothing.
        several = "powerSGD" not in hook
        ddp = DDP(m, process_group=pg, bucket_cap_mb=0.002 if several else 25)
        KEEP_ALIVE.append(ddp)  # see c_ddp_matches_gloo
        fn, state = _hook_states(hook, pg)
        ddp.register_comm_hook(state, fn)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        runs[name] = train_steps(ddp, opt, 6, "hook", r, 24)
    KEEP_ALIVE.append(gloo)
    # tccomm sums float16/bfloat16 in float32 and rounds once, gloo rounds
    # after every addition: the compressed gradients may differ by a few
    # units in the last place of the compressed dtype, times the learning
    # rate, per step. Uncompressed hooks differ only in float32 rounding.
    eps = {"fp16_compress": 2.0 ** -10, "bf16_compress": 2.0 ** -7}.get(hook, 2.0 ** -20)
    assert_same_params(ctx, runs["test"], runs["gloo"], hook, rtol=4 * eps, atol=6 * 0.05 * eps)


def c_future_chain(ctx):
    """Continuations that issue and wait on more collectives of the same
    group, two levels deep, and an irecv continuation that sends."""
    W, r = ctx.world, ctx.rank
    xs = [ctx.inp(s, 257, "int64", tag="a") for s in range(W)]
    a, b, c = xs[r].clone(), xs[r].clone() * 3, xs[r].clone() * 5
    exp = ref_reduce(xs, "int64", "SUM")

    def second(fut):
        dist.all_reduce(b)  # synchronous: waits inside the continuation

        def third(_):
            w = dist.all_reduce(c, async_op=True)
            return w.get_future().wait()[0]
        return dist.all_reduce(b, async_op=True).get_future().then(third).wait()

    fut = dist.all_reduce(a, async_op=True).get_future().then(second)
    out = fut.wait()
    ctx.compare(a, exp, "first all_reduce")
    ctx.compare(b, exp * 3 * W, "all_reduce issued and waited in a continuation")
    ctx.compare(c, exp * 5, "all_reduce two continuations deep")
    ctx.compare(out, c, "value of the chained future")

    # ring: each rank's irecv continuation sends on to the next rank.
    nxt, prv = (r + 1) % W, (r - 1) % W
    got = torch.zeros(64, dtype=torch.int64)
    if r == 0:
        dist.send(torch.full((64,), 11, dtype=torch.int64), nxt, tag=5)
        dist.recv(got, prv, tag=5)
    else:
        def forward(f):
            dist.send(f.value()[0] + 1, nxt, tag=5)  # waits inside the continuation
            return f.value()[0]
        dist.irecv(got, prv, tag=5).get_future().then(forward).wait()
    ctx.compare(got, torch.full((64,), 11 + (r - 1 if r else W - 1), dtype=torch.int64),
                "message passed along the ring by irecv continuations")
    dist.barrier()


def c_wait_timeout(ctx):
    """work.wait(timeout) raises after about `timeout` when a peer is late,
    naming the op; the op keeps its own deadline and a later wait() sees it
    complete once the peer arrives (as on gloo)."""
    W, r = ctx.world, ctx.rank
    late = W - 1
    xs = [ctx.inp(s, 1000, "float64") for s in range(W)]
    t = xs[r].clone()
    if r == late:
        ctx.store_count_wait("timed_out", W - 1)
        dist.all_reduce(t)
    else:
        work = dist.all_reduce(t, async_op=True)
        t0 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=1))
        except Exception as e:  # noqa: BLE001
            elapsed = time.monotonic() - t0
            msg = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError(f"wait(1 s) returned although rank {late} had not called all_reduce")
        finally:
            ctx.store.add(ctx.key("timed_out"), 1)
        assert 0.8 <= elapsed < 3.0, f"wait(timeout=1 s) returned after {elapsed:.2f} s"
        if ctx.strict:
            assert re.search(OP_RE["all_reduce"], msg, re.I), f"the error does not name the op: {msg!r}"
            assert re.search(r"time", msg, re.I), f"the error does not say it timed out: {msg!r}"
        assert work.wait() is True, "a later wait() did not complete the op"
    ctx.check_reduction(t, xs, "float64", "SUM", "all_reduce completed after wait(timeout)")


def c_recv_any_source(ctx):
    """dist.recv / irecv without src receive from whichever rank sends first
    and say which; matched by tag (as on gloo)."""
    W, r = ctx.world, ctx.rank
    for tag in (0, 3):
        if r == 0:
            senders = set()
            for k in range(W - 1):
                t = torch.full((77,), -1, dtype=torch.int64)
                if k % 2 == 0:
                    src = dist.recv(t, tag=tag)
                else:
                    w = dist.irecv(t, tag=tag)
                    w.wait()
                    src = w._source_rank()
                assert 1 <= src < W, f"recv without src returned sender {src}"
                ctx.compare(t, torch.full((77,), 100 * tag + src, dtype=torch.int64),
                            f"message from rank {src} (tag {tag})")
                senders.add(src)
            assert senders == set(range(1, W)), f"senders {sorted(senders)}"
        else:
            dist.send(torch.full((77,), 100 * tag + r, dtype=torch.int64), 0, tag=tag)
    dist.barrier()


def _register():
    # (batched_powerSGD_hook is left out: torch 2.14's own _orthogonalize
    # rejects the 2-D matrix it passes, on every backend.)
    for hook in ("powerSGD", "fp16_compress", "bf16_compress", "allreduce"):
        add(f"ddp_comm_hook-{hook}", S, c_ddp_comm_hook_matches_gloo, hook=hook,
            specs=("w2-shm-env", "w3-tcp-env", "w4-shm-tcpinit"))
    add("future_continuation_chains", S, c_future_chain,
        gloo_skip="gloo runs continuations on its worker threads: one that waits on a "
                  "later collective of the same group hangs")
    add("wait_timeout_then_complete", S, c_wait_timeout)
    add("recv_from_any_source", S, c_recv_any_source)


_register()
