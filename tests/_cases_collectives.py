"""Collectives: every op x dtype x reduce op, at sizes 0, 1, 1023 and LARGE,
and hostile inputs (suite "coll", reported by tests/test_collectives.py)."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from _dist_ops import all_gather_tensor, reduce_scatter_tensor
from _messages import DTYPE_ALIASES, OP_RE, REDOP_ALIASES
from _reference import (DTYPES, FLOATS, LARGE, LARGE_PART, REDOPS, SPAN_NUMEL, input_kind, make_redop, mid_numel,
                        redop_error, special_input)
from _registry import add


def _redop_cause_re(dtype: str, redop: str) -> str:
    names = DTYPE_ALIASES[dtype] + REDOP_ALIASES.get(redop, [redop.lower()])
    return "|".join(re.escape(n) for n in names) + "|unsupported|not supported"


def _reduction_error(ctx, op: str, dtype: str, redop: str, fn) -> None:
    ctx.expect_error(fn, OP_RE[op], _redop_cause_re(dtype, redop),
                     f"{op} with {redop} on {dtype}")
    ctx.check_usable()


def c_all_reduce(ctx, dtype, redop, n, async_op=False):
    W, r = ctx.world, ctx.rank
    xs = [ctx.inp(s, n, dtype, input_kind(redop)) for s in range(W)]
    t = xs[r].clone()
    op = make_redop(redop)
    if redop_error(dtype, redop):
        return _reduction_error(ctx, "all_reduce", dtype, redop,
                                lambda: dist.all_reduce(t, op=op))
    work = dist.all_reduce(t, op=op, async_op=async_op)
    if async_op:
        work.wait()
    ctx.check_allreduce(t, xs, dtype, redop, f"all_reduce {redop}")
    ctx.digest(t)


def c_reduce(ctx, dtype, redop, n):
    W, r = ctx.world, ctx.rank
    root = W - 1
    xs = [ctx.inp(s, n, dtype, input_kind(redop)) for s in range(W)]
    t = xs[r].clone()
    op = make_redop(redop)
    if redop_error(dtype, redop):
        return _reduction_error(ctx, "reduce", dtype, redop,
                                lambda: dist.reduce(t, dst=root, op=op))
    dist.reduce(t, dst=root, op=op)
    if r == root:
        ctx.check_reduce(t, xs, dtype, redop, f"reduce {redop} at root {root}")


def c_reduce_scatter(ctx, dtype, redop, n):
    W, r = ctx.world, ctx.rank
    ins = [[ctx.inp(s, n, dtype, input_kind(redop), tag=j) for j in range(W)]
           for s in range(W)]
    out = ctx.garbage(n, dtype)
    op = make_redop(redop)
    if redop_error(dtype, redop):
        return _reduction_error(ctx, "reduce_scatter", dtype, redop,
                                lambda: dist.reduce_scatter(out, ins[r], op=op))
    dist.reduce_scatter(out, ins[r], op=op)
    mine = [ins[s][r] for s in range(W)]
    ctx.check_reduce_scatter(out, mine, dtype, redop, f"reduce_scatter {redop}")


def c_reduce_scatter_tensor(ctx, dtype, redop, n):
    W, r = ctx.world, ctx.rank
    xs = [ctx.inp(s, W * n, dtype, input_kind(redop)) for s in range(W)]
    out = ctx.garbage(n, dtype)
    op = make_redop(redop)
    if redop_error(dtype, redop):
        return _reduction_error(ctx, "reduce_scatter_tensor", dtype, redop,
                                lambda: reduce_scatter_tensor(out, xs[r], op))
    reduce_scatter_tensor(out, xs[r], op)
    mine = [x[r * n:(r + 1) * n] for x in xs]
    ctx.check_reduce_scatter(out, mine, dtype, redop, f"reduce_scatter_tensor {redop}")


def c_broadcast(ctx, dtype, n):
    W, r = ctx.world, ctx.rank
    root = W - 1
    exp = ctx.inp(root, n, dtype)
    t = exp.clone() if r == root else ctx.garbage(n, dtype)
    dist.broadcast(t, src=root)
    ctx.same_bits(t, exp, f"broadcast from {root}")
    if root != 0:  # and a second one from rank 0 on the same group
        exp0 = ctx.inp(0, n, dtype, tag="second")
        t0 = exp0.clone() if r == 0 else ctx.garbage(n, dtype)
        dist.broadcast(t0, src=0)
        ctx.same_bits(t0, exp0, "broadcast from 0")


def c_all_gather(ctx, dtype, n):
    W, r = ctx.world, ctx.rank
    outs = [ctx.garbage(n, dtype) for _ in range(W)]
    dist.all_gather(outs, ctx.inp(r, n, dtype))
    for s in range(W):
        ctx.same_bits(outs[s], ctx.inp(s, n, dtype), f"all_gather output[{s}]")


def c_all_gather_into_tensor(ctx, dtype, n, stacked=False):
    W, r = ctx.world, ctx.rank
    shape = (W, n) if stacked else (W * n,)
    out = ctx.garbage(shape, dtype)
    all_gather_tensor(out, ctx.inp(r, n, dtype))
    exp = torch.stack([ctx.inp(s, n, dtype) for s in range(W)]).reshape(shape)
    ctx.same_bits(out, exp, "all_gather_into_tensor output")
    ctx.digest(out)


def c_gather(ctx, dtype, n):
    W, r = ctx.world, ctx.rank
    dst = W - 1
    outs = [ctx.garbage(n, dtype) for _ in range(W)] if r == dst else None
    dist.gather(ctx.inp(r, n, dtype), gather_list=outs, dst=dst)
    if r == dst:
        for s in range(W):
            ctx.same_bits(outs[s], ctx.inp(s, n, dtype), f"gather output[{s}] at {dst}")


def c_scatter(ctx, dtype, n):
    W, r = ctx.world, ctx.rank
    src = W - 1
    ins = [ctx.inp(src, n, dtype, tag=j) for j in range(W)] if r == src else None
    out = ctx.garbage(n, dtype)
    dist.scatter(out, scatter_list=ins, src=src)
    ctx.same_bits(out, ctx.inp(src, n, dtype, tag=r), f"scatter from {src}")


def c_all_to_all_single(ctx, dtype, n):
    W, r = ctx.world, ctx.rank
    out = ctx.garbage(W * n, dtype)
    dist.all_to_all_single(out, ctx.inp(r, W * n, dtype))
    exp = torch.cat([ctx.inp(s, W * n, dtype)[r * n:(r + 1) * n] for s in range(W)])
    ctx.same_bits(out, exp, "all_to_all_single output")


PAGE = 4096


def _view_at(numel: int, page_offset: int, fill: float):
    """(buffer, view): a float32 view of `numel` elements whose first byte
    lies `page_offset` bytes past a page boundary, in a buffer of `fill`
    around it (the bytes on either side must stay as they are)."""
    buf = torch.full((numel + 2 * PAGE // 4,), fill, dtype=torch.float32)
    shift = (page_offset - buf.data_ptr()) % PAGE // 4
    return buf, buf[shift:shift + numel]


def _guards_intact(buf, view, fill: float, what: str) -> None:
    start = view.storage_offset()
    outside = torch.cat([buf[:start], buf[start + view.numel():]])
    if not bool((outside == fill).all()):
        raise AssertionError(f"{what}: wrote outside its tensor")


def c_page_offset_views(ctx, in_offset: int, out_offset: int, n: int = 3000):
    """Every op on views placed so that the core's copies run between
    addresses a few bytes apart modulo 4096 (the distances its copy routine
    takes away from memcpy), in both directions: results and the bytes
    around each view checked."""
    W, r = ctx.world, ctx.rank
    dt = "float32"
    xs = [ctx.inp(s, W * n, dt, input_kind("SUM")) for s in range(W)]
    fill = -7.5

    buf, t = _view_at(W * n, out_offset, fill)
    t.copy_(xs[r])
    dist.all_reduce(t)
    ctx.check_allreduce(t, xs, dt, "SUM", "all_reduce at a page offset")
    _guards_intact(buf, t, fill, "all_reduce")

    ibuf, inp = _view_at(n, in_offset, fill)
    inp.copy_(xs[r][:n])
    obuf, out = _view_at(W * n, out_offset, fill)
    all_gather_tensor(out, inp)
    ctx.same_bits(out, torch.cat([x[:n] for x in xs]), "all_gather_into_tensor at page offsets")
    _guards_intact(obuf, out, fill, "all_gather_into_tensor")
    _guards_intact(ibuf, inp, fill, "all_gather_into_tensor's input")

    ibuf, inp = _view_at(W * n, in_offset, fill)
    inp.copy_(xs[r])
    obuf, out = _view_at(n, out_offset, fill)
    reduce_scatter_tensor(out, inp, make_redop("SUM"))
    ctx.check_reduce_scatter(out, [x[r * n:(r + 1) * n] for x in xs], dt, "SUM",
                             "reduce_scatter_tensor at page offsets")
    _guards_intact(obuf, out, fill, "reduce_scatter_tensor")

    obuf, out = _view_at(W * n, out_offset, fill)
    dist.all_to_all_single(out, inp)
    exp = torch.cat([x[r * n:(r + 1) * n] for x in xs])
    ctx.same_bits(out, exp, "all_to_all_single at page offsets")
    _guards_intact(obuf, out, fill, "all_to_all_single")

    buf, t = _view_at(W * n, out_offset, fill)
    t.copy_(xs[r])
    dist.broadcast(t, src=W - 1)
    ctx.same_bits(t, xs[W - 1], "broadcast at a page offset")
    _guards_intact(buf, t, fill, "broadcast")

    if W >= 2:
        buf, t = _view_at(W * n, out_offset, fill)
        if r == 0:
            dist.send(inp, dst=1)
        elif r == 1:
            dist.recv(t, src=0)
            ctx.same_bits(t, ctx.inp(0, W * n, dt, input_kind("SUM")), "recv at a page offset")
            _guards_intact(buf, t, fill, "recv")


def _splits(i: int, j: int, pattern: str) -> int:
    """Rows rank i sends to rank j (includes zeros)."""
    if pattern == "uneven":
        return (2 * i + 3 * j + 1) % 4
    if pattern == "rank0_silent":  # rank 0 sends and receives nothing at all
        return 0 if 0 in (i, j) else 1 + (i + j) % 3
    raise ValueError(pattern)


def c_all_to_all_single_uneven(ctx, dtype, pattern, cols=3):
    W, r = ctx.world, ctx.rank
    send = [_splits(r, j, pattern) for j in range(W)]
    recv = [_splits(j, r, pattern) for j in range(W)]
    inputs = [ctx.inp(s, (sum(_splits(s, j, pattern) for j in range(W)), cols), dtype)
              for s in range(W)]
    out = ctx.garbage((sum(recv), cols), dtype)
    dist.all_to_all_single(out, inputs[r], output_split_sizes=recv, input_split_sizes=send)
    parts = []
    for s in range(W):
        off = sum(_splits(s, j, pattern) for j in range(r))
        parts.append(inputs[s][off:off + _splits(s, r, pattern)])
    ctx.same_bits(out, torch.cat(parts), f"all_to_all_single ({pattern} splits {send}/{recv})")


def c_all_to_all(ctx, dtype, pattern, cols=3):
    W, r = ctx.world, ctx.rank
    ins = [ctx.inp(r, (_splits(r, j, pattern), cols), dtype, tag=j) for j in range(W)]
    outs = [ctx.garbage((_splits(j, r, pattern), cols), dtype) for j in range(W)]
    dist.all_to_all(outs, ins)
    for j in range(W):
        ctx.same_bits(outs[j], ctx.inp(j, (_splits(j, r, pattern), cols), dtype, tag=r),
                      f"all_to_all output[{j}]")


def c_send_recv(ctx, dtype, n):
    W, r = ctx.world, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    buf = ctx.garbage(n, dtype)
    x = ctx.inp(r, n, dtype)
    if r % 2 == 0:
        dist.send(x, dst=nxt, tag=11)
        dist.recv(buf, src=prv, tag=11)
    else:
        dist.recv(buf, src=prv, tag=11)
        dist.send(x, dst=nxt, tag=11)
    ctx.same_bits(buf, ctx.inp(prv, n, dtype), f"recv from {prv}")


SPECIAL_N = 515  # a full 512-element block of the core's kernels plus an odd tail


def c_special_reduction(ctx, dtypes, redop):
    """all_reduce, reduce and reduce_scatter_tensor of hostile inputs (NaN,
    Inf, -0.0, subnormals, the largest finite values, integer extremes): for
    tccomm every element must be what ref_reduce defines, bit for bit (any
    NaN for a NaN); a backend with an unspecified order must match some order."""
    W, r = ctx.world, ctx.rank
    op, root, n = make_redop(redop), W - 1, SPECIAL_N
    check = ctx.check_reduction if ctx.strict else ctx.check_any_order
    results = []
    for dtype in dtypes:
        xs = [special_input((ctx.case, dtype), q, n, dtype) for q in range(W)]
        t = xs[r].clone()
        dist.all_reduce(t, op=op)
        check(t, xs, dtype, redop, f"all_reduce {redop} on {dtype}")
        results.append(t)
        t = xs[r].clone()
        dist.reduce(t, dst=root, op=op)
        if r == root:
            check(t, xs, dtype, redop, f"reduce {redop} on {dtype} at root {root}")
        full = [special_input((ctx.case, dtype, "rs"), q, W * n, dtype) for q in range(W)]
        out = ctx.garbage(n, dtype)
        reduce_scatter_tensor(out, full[r], op)
        check(out, [x[r * n:(r + 1) * n] for x in full], dtype, redop,
              f"reduce_scatter_tensor {redop} on {dtype}")
    ctx.digest(*results)


def c_special_movement(ctx, dtypes):
    """broadcast, all_gather_into_tensor, all_to_all_single, scatter, gather
    and send/recv of hostile bit patterns (NaN payloads, signalling NaNs,
    -0.0, subnormals, integer extremes): every bit must arrive."""
    W, r = ctx.world, ctx.rank
    n, root = SPECIAL_N, W - 1
    nxt, prv = (r + 1) % W, (r - 1) % W
    for dtype in dtypes:
        def x(q, tag, size=n, dtype=dtype):
            return special_input((ctx.case, dtype, tag), q, size, dtype)
        t = x(root, "bc") if r == root else ctx.garbage(n, dtype)
        dist.broadcast(t, src=root)
        ctx.same_bits(t, x(root, "bc"), f"broadcast of {dtype} from {root}")
        out = ctx.garbage(W * n, dtype)
        all_gather_tensor(out, x(r, "ag"))
        ctx.same_bits(out, torch.cat([x(q, "ag") for q in range(W)]),
                      f"all_gather_into_tensor of {dtype}")
        out = ctx.garbage(W * n, dtype)
        dist.all_to_all_single(out, x(r, "a2a", W * n))
        ctx.same_bits(out, torch.cat([x(q, "a2a", W * n)[r * n:(r + 1) * n] for q in range(W)]),
                      f"all_to_all_single of {dtype}")
        out = ctx.garbage(n, dtype)
        dist.scatter(out, [x(j, "sc") for j in range(W)] if r == root else None, src=root)
        ctx.same_bits(out, x(r, "sc"), f"scatter of {dtype} from {root}")
        outs = [ctx.garbage(n, dtype) for _ in range(W)] if r == 0 else None
        dist.gather(x(r, "ga"), gather_list=outs, dst=0)
        if r == 0:
            for q in range(W):
                ctx.same_bits(outs[q], x(q, "ga"), f"gather of {dtype} at 0, output[{q}]")
        buf = ctx.garbage(n, dtype)
        if r % 2 == 0:
            dist.send(x(r, "p2p"), dst=nxt)
            dist.recv(buf, src=prv)
        else:
            dist.recv(buf, src=prv)
            dist.send(x(r, "p2p"), dst=nxt)
        ctx.same_bits(buf, x(prv, "p2p"), f"recv of {dtype} from {prv}")


# Hostile-input cases per group of dtypes (gloo lacks int16 and bool).
SPECIAL_GROUPS = {"floats": FLOATS, "ints": ("int8", "int32", "int64", "uint8"),
                  "int16_bool": ("int16", "bool")}


def _register_special_values(S):
    for redop in REDOPS:
        for group, dtypes in SPECIAL_GROUPS.items():
            dtypes = tuple(d for d in dtypes if not redop_error(d, redop))
            if not dtypes:
                continue
            if redop in ("AVG", "PREMUL_SUM"):
                gs = f"gloo does not implement {redop}"
            elif group == "int16_bool":
                gs = "gloo does not implement int16 and bool"
            elif group == "floats" and redop in ("MIN", "MAX"):
                gs = (f"gloo's {redop} keeps a NaN only when it comes first "
                      "(std::min/std::max), so its result depends on the order")
            else:
                gs = None
            add(f"special_values-{redop}-{group}", S, c_special_reduction, dtypes=dtypes,
                redop=redop, gloo_skip=gs)
    for group, dtypes in SPECIAL_GROUPS.items():
        add(f"special_values-movement-{group}", S, c_special_movement, dtypes=dtypes,
            gloo_skip="gloo does not implement int16 and bool" if group == "int16_bool"
            else None)


def _register_collectives():
    S = "coll"
    sizes_all = [1023]
    for dtype in DTYPES:
        for redop in REDOPS:
            for n in sizes_all:
                gs = None
                err = redop_error(dtype, redop)
                if redop in ("AVG", "PREMUL_SUM"):
                    gs = f"gloo does not implement {redop}"
                elif dtype in ("int16", "bool"):
                    gs = f"gloo does not implement {dtype}"
                elif err:
                    gs = "gloo's error for this combination is not under test"
                suffix = f"{dtype}-{redop}-n{n}"
                add(f"all_reduce-{suffix}", S, c_all_reduce, dtype=dtype, redop=redop,
                    n=n, gloo_skip=gs)
                add(f"reduce-{suffix}", S, c_reduce, dtype=dtype, redop=redop, n=n,
                    gloo_skip=gs)
                add(f"reduce_scatter-{suffix}", S, c_reduce_scatter, dtype=dtype,
                    redop=redop, n=n, gloo_skip=gs)
                add(f"reduce_scatter_tensor-{suffix}", S, c_reduce_scatter_tensor,
                    dtype=dtype, redop=redop, n=n, gloo_skip=gs)
    # small and empty sizes for every dtype (SUM), and the big chunked paths
    for dtype in DTYPES:
        gs = f"gloo does not implement {dtype}" if dtype in ("int16", "bool") else None
        for n in (0, 1):
            add(f"all_reduce-{dtype}-SUM-n{n}", S, c_all_reduce, dtype=dtype,
                redop="SUM", n=n, gloo_skip=gs)
        add(f"reduce_scatter_tensor-{dtype}-SUM-n1", S, c_reduce_scatter_tensor,
            dtype=dtype, redop="SUM", n=1, gloo_skip=gs)
    for redop in ("SUM", "AVG", "MAX", "PRODUCT", "PREMUL_SUM"):
        gs = f"gloo does not implement {redop}" if redop in ("AVG", "PREMUL_SUM") else None
        add(f"all_reduce-float32-{redop}-n{LARGE}", S, c_all_reduce, dtype="float32",
            redop=redop, n=LARGE, gloo_skip=gs)
    for dtype in ("float16", "bfloat16", "int32"):
        add(f"all_reduce-{dtype}-SUM-n{LARGE}", S, c_all_reduce, dtype=dtype,
            redop="SUM", n=LARGE)
    # mid-sized: over TCP, the reduce-scatter with the descriptors
    for dtype, redop in (("float32", "SUM"), ("float32", "AVG"), ("float32", "PREMUL_SUM"),
                         ("float64", "MAX"), ("bfloat16", "SUM"), ("int32", "PRODUCT")):
        gs = f"gloo does not implement {redop}" if redop in ("AVG", "PREMUL_SUM") else None
        add(f"all_reduce-{dtype}-{redop}-n{mid_numel(dtype)}", S, c_all_reduce, dtype=dtype,
            redop=redop, n=mid_numel(dtype), gloo_skip=gs)
    add(f"all_reduce-float64-SUM-n{LARGE}-async", S, c_all_reduce, dtype="float64",
        redop="SUM", n=LARGE, async_op=True)
    add(f"reduce-float32-SUM-n{LARGE}", S, c_reduce, dtype="float32", redop="SUM", n=LARGE)
    add(f"reduce_scatter_tensor-float32-SUM-n{LARGE_PART}", S, c_reduce_scatter_tensor,
        dtype="float32", redop="SUM", n=LARGE_PART)
    add(f"reduce_scatter_tensor-bfloat16-SUM-n{LARGE_PART}", S, c_reduce_scatter_tensor,
        dtype="bfloat16", redop="SUM", n=LARGE_PART)
    add("reduce_scatter_tensor-float32-SUM-n0", S, c_reduce_scatter_tensor,
        dtype="float32", redop="SUM", n=0)
    add(f"reduce_scatter-float32-SUM-n{LARGE_PART}", S, c_reduce_scatter, dtype="float32",
        redop="SUM", n=LARGE_PART)

    data_ops = [("broadcast", c_broadcast), ("all_gather", c_all_gather),
                ("all_gather_into_tensor", c_all_gather_into_tensor),
                ("gather", c_gather), ("scatter", c_scatter),
                ("all_to_all_single", c_all_to_all_single), ("send_recv", c_send_recv)]
    for opname, fn in data_ops:
        for dtype in DTYPES:
            gs = f"gloo does not implement {dtype}" if dtype in ("int16", "bool") else None
            add(f"{opname}-{dtype}-n1023", S, fn, dtype=dtype, n=1023, gloo_skip=gs)
        for n in (0, 1):
            add(f"{opname}-float32-n{n}", S, fn, dtype="float32", n=n)
        big = LARGE if opname in ("broadcast", "send_recv") else LARGE_PART
        add(f"{opname}-float32-n{big}", S, fn, dtype="float32", n=big)
    # Rooted ops whose parts fill several slots of the slot rings.
    for opname, fn in (("broadcast", c_broadcast), ("gather", c_gather), ("scatter", c_scatter)):
        for dtype in ("float32", "bfloat16", "int64"):
            add(f"{opname}-{dtype}-n{SPAN_NUMEL}", S, fn, dtype=dtype, n=SPAN_NUMEL)
    for dtype, redop in (("float32", "SUM"), ("float32", "MAX"), ("bfloat16", "SUM"), ("int64", "PRODUCT"),
                         ("float32", "PREMUL_SUM")):
        gs = f"gloo does not implement {redop}" if redop == "PREMUL_SUM" else None
        add(f"reduce-{dtype}-{redop}-n{SPAN_NUMEL}", S, c_reduce, dtype=dtype, redop=redop,
            n=SPAN_NUMEL, gloo_skip=gs)
    # The core's copies at the distances modulo 4096 its copy routine treats apart.
    for in_off, out_off in ((0, 4), (0, 16), (4080, 0), (64, 4032)):
        add(f"page_offset_views-in{in_off}-out{out_off}", S, c_page_offset_views,
            in_offset=in_off, out_offset=out_off)
    add("all_gather_into_tensor-int64-n257-stacked", S, c_all_gather_into_tensor,
        dtype="int64", n=257, stacked=True,
        gloo_skip="gloo only takes the concatenated output form")
    for pattern in ("uneven", "rank0_silent"):
        for dtype in ("float32", "int64", "bfloat16", "bool", "uint8"):
            gs = f"gloo does not implement {dtype}" if dtype == "bool" else None
            add(f"all_to_all_single-{dtype}-{pattern}", S, c_all_to_all_single_uneven,
                dtype=dtype, pattern=pattern, gloo_skip=gs)
            add(f"all_to_all-{dtype}-{pattern}", S, c_all_to_all, dtype=dtype,
                pattern=pattern, gloo_skip=gs or "gloo does not implement all_to_all (lists)")
    add("all_to_all_single-float32-uneven-wide", S, c_all_to_all_single_uneven,
        dtype="float32", pattern="uneven", cols=70001)
    _register_special_values(S)


_register_collectives()
