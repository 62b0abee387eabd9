"""Bad input: each kind raises a clear error on every rank and leaves the
group usable (suite "err", reported by tests/test_bad_input.py). The one
exception, a disagreement on small rooted ops over the slot rings, fails
the group and runs last in its own."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _dist_ops import all_gather_tensor, reduce_scatter_tensor
from _messages import OP_RE
from _reference import tdtype
from _registry import add

MISMATCH_SKIP = "gloo does not check that ranks agree (it hangs or corrupts instead)"


def c_bad_mismatch_numel(ctx):
    r = ctx.rank
    t = torch.ones(8 if r == 1 else 7)
    ctx.expect_error(lambda: dist.all_reduce(t), OP_RE["all_reduce"],
                     r"mismatch|disagree|differ|shape|size|count|numel|element",
                     "all_reduce with a different numel on rank 1")
    ctx.check_usable()


def c_bad_mismatch_dtype(ctx, other):
    r = ctx.rank
    t = torch.ones(16, dtype=tdtype(other) if r == 0 else torch.float32)
    ctx.expect_error(lambda: dist.all_reduce(t), OP_RE["all_reduce"],
                     r"mismatch|disagree|differ|dtype|type",
                     f"all_reduce with {other} on rank 0 and float32 elsewhere")
    ctx.check_usable()


def c_bad_mismatch_root(ctx):
    """Larger than a slot ring holds (a part may fill its 32 slots: 2095104
    bytes by default up to 4 ranks, less in larger groups): over the staging
    windows, where every rank checks every rank's descriptor in the op
    itself."""
    r = ctx.rank
    t = torch.ones(600_000)
    ctx.expect_error(lambda: dist.broadcast(t, src=0 if r == 0 else 1), OP_RE["broadcast"],
                     r"mismatch|disagree|differ|root|src",
                     "broadcast where rank 0 names root 0 and the others root 1")
    ctx.check_usable()


def c_bad_mismatch_root_slots(ctx):
    """Over the slot rings a root sends and returns: ranks 0 and 1 both
    name themselves the root, rank 2 names rank 1, so every broadcast
    returns (rank 2 got rank 1's tensor). The next op over the staging
    windows compares the ranks' digests of their small rooted ops: it fails
    on every rank, and so does the group, its ranks out of step (README,
    "Errors and timeouts")."""
    r = ctx.rank
    t = torch.full((16,), float(r))
    dist.broadcast(t, src=0 if r == 0 else 1)
    if r == 2:
        ctx.same_bits(t, torch.full((16,), 1.0), "rank 2's broadcast from rank 1")
    ctx.expect_error(lambda: dist.barrier(), OP_RE["barrier"], r"disagree.*digest",
                     "barrier after a broadcast whose ranks named different roots")
    ctx.expect_error(lambda: dist.all_reduce(t), OP_RE["all_reduce"],
                     r"out of step|disagree",
                     "all_reduce on the group that failed")


def c_bad_mismatch_root_one_sided(ctx):
    """Over TCP a small broadcast's root sends its frames and returns, and
    a receiver waits for the root's frame alone: ranks 0 and 1 both name
    themselves the root, rank 2 names rank 1, so every broadcast returns
    (rank 2 got rank 1's tensor). Each rank finds the others' frames of it
    when it next reads from them (the barrier): it fails on every rank,
    and so does the group, its ranks out of step (README, "Errors and
    timeouts")."""
    r = ctx.rank
    t = torch.full((16,), float(r))
    dist.broadcast(t, src=0 if r == 0 else 1)
    if r == 2:
        ctx.same_bits(t, torch.full((16,), 1.0), "rank 2's broadcast from rank 1")
    ctx.expect_error(lambda: dist.barrier(), OP_RE["barrier"], r"root mismatch|out of step",
                     "barrier after a broadcast whose ranks named different roots")
    ctx.expect_error(lambda: dist.all_reduce(t), OP_RE["all_reduce"],
                     r"out of step|disagree|mismatch",
                     "all_reduce on the group that failed")


def c_bad_mismatch_splits(ctx):
    """Rank 1 sends 3 rows to rank 0, but rank 0 expects 2 from rank 1."""
    W, r = ctx.world, ctx.rank
    send = [2] * W
    recv = [2] * W
    if r == 1:
        send[0] = 3
    inp = torch.ones(sum(send), 2)
    out = torch.zeros(sum(recv), 2)
    ctx.expect_error(lambda: dist.all_to_all_single(out, inp, output_split_sizes=recv,
                                                    input_split_sizes=send),
                     OP_RE["all_to_all_single"], r"mismatch|disagree|differ|split|size|count",
                     "all_to_all_single whose split sizes disagree between ranks 0 and 1")
    ctx.check_usable()


def c_bad_agit_size(ctx):
    W = ctx.world
    out = torch.zeros(W * 10 + 1)
    ctx.expect_error(lambda: all_gather_tensor(out, torch.ones(10)),
                     OP_RE["all_gather_into_tensor"],
                     r"size|numel|shape|element|count|length",
                     "all_gather_into_tensor with an output one element too long")
    ctx.check_usable()


def c_bad_rst_size(ctx):
    W = ctx.world
    out = torch.zeros(10)
    ctx.expect_error(lambda: reduce_scatter_tensor(out, torch.ones(W * 10 - 1),
                                                    dist.ReduceOp.SUM),
                     OP_RE["reduce_scatter_tensor"], r"size|numel|shape|element|count|length",
                     "reduce_scatter_tensor with an input one element too short")
    ctx.check_usable()


def c_bad_ag_list_len(ctx):
    W = ctx.world
    outs = [torch.zeros(4) for _ in range(W - 1)]
    ctx.expect_error(lambda: dist.all_gather(outs, torch.ones(4)), OP_RE["all_gather"],
                     r"size|length|number|list|count|world|expected",
                     f"all_gather with {W - 1} output tensors for {W} ranks")
    ctx.check_usable()


def c_bad_ag_dtype(ctx):
    W = ctx.world
    outs = [torch.zeros(4, dtype=torch.float64) for _ in range(W)]
    # torch's Python wrapper rejects mixed dtypes itself; the ProcessGroup call
    # reaches the backend directly.
    pg = dist.distributed_c10d._get_default_group()
    ctx.expect_error(lambda: pg.allgather([outs], [torch.ones(4)]).wait(), OP_RE["all_gather"],
                     r"dtype|type|mismatch|float",
                     "all_gather with float64 outputs for a float32 input")
    ctx.check_usable()


def c_bad_root(ctx, op, root):
    W = ctx.world
    root = {"W": W, "-1": -1, "big": 1000}[root]
    t = torch.ones(4)
    pg = dist.distributed_c10d._get_default_group()
    cause = r"root|rank|src|dst|range|invalid|peer"
    if op == "broadcast":
        fn = lambda: dist.broadcast(t, src=root)  # noqa: E731
    elif op == "reduce":
        def fn():
            opts = dist.ReduceOptions()
            opts.rootRank = root
            pg.reduce([t], opts).wait()
    elif op == "gather":
        def fn():
            opts = dist.GatherOptions()
            opts.rootRank = root
            pg.gather([[torch.zeros(4) for _ in range(W)]], [t], opts).wait()
    elif op == "scatter":
        def fn():
            opts = dist.ScatterOptions()
            opts.rootRank = root
            pg.scatter([torch.zeros(4)], [[torch.ones(4) for _ in range(W)]], opts).wait()
    elif op == "send":
        fn = lambda: pg.send([t], root, 0).wait()  # noqa: E731
    elif op == "recv":
        fn = lambda: pg.recv([t], root, 0).wait()  # noqa: E731
    else:
        raise ValueError(op)
    ctx.expect_error(fn, OP_RE[op], cause, f"{op} with root/peer {root} in a group of {W}")
    ctx.check_usable()


def c_bad_splits(ctx, kind):
    W = ctx.world
    n = 2 * W
    if kind == "negative":
        send = [2] * W
        send[0], send[-1] = (3, 1) if W == 1 else (4, 0)
        recv = [2] * W
        recv[0], recv[-1] = 5, -1
        what = f"output_split_sizes {recv} (negative)"
    else:
        send, recv = [2] * W, [2] * W
        send[0] = 3  # sums to n + 1 but the input has n rows
        what = f"input_split_sizes {send} that do not sum to the input's {n} rows"
    inp, out = torch.ones(n, 3), torch.zeros(n, 3)
    ctx.expect_error(lambda: dist.all_to_all_single(out, inp, output_split_sizes=recv,
                                                    input_split_sizes=send),
                     OP_RE["all_to_all_single"], r"split|negative|sum|size|invalid", what)
    ctx.check_usable()


def _register_bad_input():
    S = "err"
    # Mismatches between ranks are detected by the core: its errors name everything.
    add("bad-mismatched_numel", S, c_bad_mismatch_numel, gloo_skip=MISMATCH_SKIP)
    add("bad-mismatched_dtype-float64", S, c_bad_mismatch_dtype, other="float64",
        gloo_skip=MISMATCH_SKIP)
    add("bad-mismatched_dtype-int32", S, c_bad_mismatch_dtype, other="int32",
        gloo_skip=MISMATCH_SKIP)
    add("bad-mismatched_broadcast_root", S, c_bad_mismatch_root, gloo_skip=MISMATCH_SKIP)
    add("bad-mismatched_broadcast_root-slots", S, c_bad_mismatch_root_slots,
        specs=("w3-shm-env-slots",), order=100, gloo_skip=MISMATCH_SKIP)
    add("bad-mismatched_broadcast_root-one-sided", S, c_bad_mismatch_root_one_sided,
        specs=("w3-tcp-env-onesided",), order=100, gloo_skip=MISMATCH_SKIP)
    add("bad-mismatched_alltoall_splits", S, c_bad_mismatch_splits, gloo_skip=MISMATCH_SKIP)
    add("bad-all_gather_into_tensor_output_size", S, c_bad_agit_size)
    add("bad-reduce_scatter_tensor_input_size", S, c_bad_rst_size,
        gloo_skip="gloo kills the process on this input")
    add("bad-all_gather_list_length", S, c_bad_ag_list_len)
    add("bad-all_gather_output_dtype", S, c_bad_ag_dtype)
    for op in ("broadcast", "reduce", "gather", "scatter", "send", "recv"):
        for root in ("W", "-1"):
            add(f"bad-{op}_rank_out_of_range_{root}", S, c_bad_root, op=op, root=root,
                gloo_skip="gloo kills the process on this input" if op in ("send", "recv")
                else None)
    add("bad-alltoall_negative_split", S, c_bad_splits, kind="negative")
    add("bad-alltoall_splits_not_summing", S, c_bad_splits, kind="nonsum")


_register_bad_input()
