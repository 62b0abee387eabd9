"""A peer that never arrives, in groups of their own created with a 2 s
timeout (suite "timeout", reported by tests/test_bad_input.py)."""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist

from _messages import OP_RE, group_re
from _registry import add


def c_timeout(ctx):
    W, r = ctx.world, ctx.rank
    missing = W - 1
    done_key = "others_done"
    if r == missing:  # never calls all_reduce; waits until the others have finished
        ctx.store_count_wait(done_key, W - 1)
        return
    try:
        t = torch.ones(1000)
        t0 = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001
            elapsed = time.monotonic() - t0
            msg = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError(f"all_reduce returned although rank {missing} never called it")
        limit = 5 * ctx.cfg["pg_timeout"]
        assert elapsed < limit, (f"all_reduce raised only after {elapsed:.1f} s: the group's "
                                 f"timeout of {ctx.cfg['pg_timeout']} s was not honoured")
        if ctx.strict:
            assert re.search(OP_RE["all_reduce"], msg, re.I), f"the error does not name the op: {msg!r}"
            assert re.search(group_re(), msg), \
                f"the error does not name the group (/{group_re()}/): {msg!r}"
            assert re.search(rf"rank\D{{0,40}}\b{missing}\b", msg, re.I), \
                f"the error does not name the missing rank {missing}: {msg!r}"
            assert re.search(r"time", msg, re.I), f"the error does not say it timed out: {msg!r}"
        # still alive, and a later op on the failed group raises instead of hanging
        assert torch.ones(3).sum().item() == 3.0
        try:
            dist.all_reduce(torch.ones(2))
        except Exception:  # noqa: BLE001
            pass
        else:
            raise AssertionError("a second all_reduce without rank "
                                 f"{missing} returned normally")
    finally:
        ctx.store.add(ctx.key(done_key), 1)


def c_destroy_after_timeout(ctx):
    """destroy_process_group() returns after a timed-out op (no hang, no crash)."""
    dist.destroy_process_group()
    assert not dist.is_initialized()


add("timeout-peer_never_arrives", "timeout", c_timeout,
    specs=("w3-shm-env-timeout", "w2-tcp-env-timeout"))
add("timeout-destroy_afterwards", "timeout", c_destroy_after_timeout,
    specs=("w3-shm-env-timeout", "w2-tcp-env-timeout"), order=99)
