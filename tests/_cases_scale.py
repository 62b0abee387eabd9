"""Scale: every collective kind at 8 ranks, dozens of groups alive at once
(and released after), tensors over 2**31 bytes and over 2**31 elements.

References are plain torch on every rank's recomputed inputs (the per-op
cases of _cases_collectives.py, run here at 8 ranks) or, for the huge tensors, values
derived from the element index and checked over the whole tensor.
"""

from __future__ import annotations

import gc
import os
import random
import time

import torch
import torch.distributed as dist

import _cases_collectives as coll
import _cases_features as feat
from _dist_ops import all_gather_tensor
from _reference import LARGE, ref_reduce
from _registry import Skip, add
from _resources import open_sockets, shm_mappings
from _cases_coverage import GROUP_SPECS, HUGE_SPECS, SUITE, W8_SPECS

# --------------------------------------------------------------------------
# 8 ranks: every collective kind, small (one-shot) and large (pipelined)
# --------------------------------------------------------------------------

W8_MID = 70001  # 280 KB of float32 per rank: above the shared-memory small path


def _register_w8():
    def w8(name, fn, **params):
        add(f"w8-{name}", SUITE, fn, specs=W8_SPECS, **params)

    w8("all_reduce-float32-SUM-n1023", coll.c_all_reduce, dtype="float32", redop="SUM", n=1023)
    w8(f"all_reduce-float32-SUM-n{LARGE}", coll.c_all_reduce, dtype="float32", redop="SUM",
       n=LARGE)
    w8("all_reduce-int64-MAX-n1023-async", coll.c_all_reduce, dtype="int64", redop="MAX",
       n=1023, async_op=True)
    w8("all_reduce-bfloat16-SUM-n1023", coll.c_all_reduce, dtype="bfloat16", redop="SUM", n=1023)
    w8("broadcast-int32-n1023", coll.c_broadcast, dtype="int32", n=1023)
    w8(f"broadcast-float32-n{LARGE}", coll.c_broadcast, dtype="float32", n=LARGE)
    w8("reduce-float64-SUM-n1023", coll.c_reduce, dtype="float64", redop="SUM", n=1023)
    w8(f"reduce-float32-MIN-n{W8_MID}", coll.c_reduce, dtype="float32", redop="MIN", n=W8_MID)
    w8("all_gather-int16-n1023", coll.c_all_gather, dtype="int16", n=1023,
       gloo_skip="gloo does not implement int16")
    w8(f"all_gather_into_tensor-float32-n{W8_MID}", coll.c_all_gather_into_tensor,
       dtype="float32", n=W8_MID)
    w8("gather-uint8-n1023", coll.c_gather, dtype="uint8", n=1023)
    w8(f"gather-float32-n{W8_MID}", coll.c_gather, dtype="float32", n=W8_MID)
    w8("scatter-int64-n1023", coll.c_scatter, dtype="int64", n=1023)
    w8(f"scatter-float32-n{W8_MID}", coll.c_scatter, dtype="float32", n=W8_MID)
    w8("reduce_scatter-int32-SUM-n1023", coll.c_reduce_scatter, dtype="int32", redop="SUM",
       n=1023)
    w8("reduce_scatter_tensor-float32-SUM-n1023", coll.c_reduce_scatter_tensor,
       dtype="float32", redop="SUM", n=1023)
    w8(f"reduce_scatter_tensor-float32-SUM-n{W8_MID}", coll.c_reduce_scatter_tensor,
       dtype="float32", redop="SUM", n=W8_MID)
    w8("all_to_all_single-float32-n1023", coll.c_all_to_all_single, dtype="float32", n=1023)
    w8("all_to_all_single-int64-uneven", coll.c_all_to_all_single_uneven, dtype="int64",
       pattern="uneven")
    w8("all_to_all-float32-uneven", coll.c_all_to_all, dtype="float32", pattern="uneven",
       gloo_skip="gloo does not implement all_to_all (lists)")
    w8("barrier", feat.c_barrier)
    w8("send_recv_ring-float64-n1023", coll.c_send_recv, dtype="float64", n=1023)
    w8(f"send_recv_ring-float32-n{LARGE}", coll.c_send_recv, dtype="float32", n=LARGE)
    w8("batch_isend_irecv-n1000", feat.c_batch_isend_irecv, n=1000)


# --------------------------------------------------------------------------
# dozens of groups at once, then released
# --------------------------------------------------------------------------

N_GROUPS = 40


def _resources() -> dict:
    """What this process holds that a group could leak."""
    return {"fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")),
            "sockets": open_sockets(),
            "shm mappings": shm_mappings()}


def _segment_names(maps: list[str]) -> set[str]:
    """The /dev/shm names behind shared-memory mappings (the segment files
    are unlinked once every rank has mapped them: "(deleted)")."""
    return {os.path.basename(m.split(" (deleted)")[0]) for m in maps if "/dev/shm/" in m}


def _group_plan(world: int, rng: random.Random) -> list[list[int]]:
    """N_GROUPS member lists, the same on every rank: every size from 1 to
    the world, overlapping, members in scrambled order."""
    plan = []
    for k in range(N_GROUPS):
        size = 1 + k % world
        members = rng.sample(range(world), size)
        plan.append(members)
    return plan


def _issue(ctx, kind: int, gi: int, rnd: int, members: list[int], g):
    """One async op on group gi; returns (work, check) where check() asserts
    the result after the work completed."""
    r = ctx.rank
    ms = sorted(members)
    tag = f"g{gi}r{rnd}"
    n = 33 + gi
    if kind == 0:
        t = ctx.inp(r, n, "int64", tag=tag)
        w = dist.all_reduce(t, group=g, async_op=True)
        exp = ref_reduce([ctx.inp(q, n, "int64", tag=tag) for q in ms], "int64", "SUM")
        return w, lambda: ctx.compare(t, exp, f"all_reduce on group {gi} {members} (round {rnd})")
    if kind == 1:
        root = members[(gi + rnd) % len(members)]
        exp = ctx.inp(root, n, "float32", tag=tag)
        t = exp.clone() if r == root else ctx.garbage(n, "float32")
        w = dist.broadcast(t, src=root, group=g, async_op=True)
        return w, lambda: ctx.compare(t, exp, f"broadcast from {root} on group {gi} {members} "
                                              f"(round {rnd})")
    out = ctx.garbage(len(ms) * n, "int32")
    w = all_gather_tensor(out, ctx.inp(r, n, "int32", tag=tag), group=g, async_op=True)
    exp = torch.cat([ctx.inp(q, n, "int32", tag=tag) for q in ms])
    return w, lambda: ctx.compare(out, exp, f"all_gather_into_tensor on group {gi} {members} "
                                            f"(round {rnd})")


def _create_and_use_one(ctx) -> None:
    """A group created, used (including a future) and destroyed: whatever a
    backend creates once per process (threads, pools) exists afterwards."""
    g = dist.new_group(list(range(ctx.world)))
    t = torch.ones(10)
    dist.all_reduce(t, group=g, async_op=True).get_future().then(lambda f: f.value()).wait()
    dist.destroy_process_group(g)


def _released(ctx, before: dict, seen_segments: set[str]) -> None:
    """Everything held by the destroyed groups is given back (a moment is
    allowed for closes done asynchronously)."""
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        after = _resources()
        grown = {k: (before[k], after[k]) for k in ("fds", "threads")
                 if after[k] > before[k]}
        new_socks = sorted(set(after["sockets"]) - set(before["sockets"]))
        new_maps = sorted(set(after["shm mappings"]) - set(before["shm mappings"]))
        left = sorted(f for f in os.listdir("/dev/shm")
                      if any(f.startswith(s) for s in seen_segments))
        if not (grown or new_socks or new_maps or left) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    problems = [f"{k}: {b} before, {a} after" for k, (b, a) in grown.items()]
    if new_socks:
        problems.append(f"sockets still open: {new_socks}")
    if new_maps:
        problems.append(f"shared memory still mapped: {new_maps}")
    if left:
        problems.append(f"segment files of the destroyed groups left in /dev/shm: {left}")
    assert not problems, (f"after {N_GROUPS} groups were created, used and destroyed: "
                          + "; ".join(problems))


def c_dozens_of_groups(ctx):
    """40 groups of every size (overlapping, members in scrambled order) are
    alive at once; three rounds of async ops interleaved over all of them in
    a shuffled order (the same on every rank), waited in reverse; then all
    are destroyed and this process holds no more fds, threads, sockets or
    shared memory than before, and no segment file of theirs is left."""
    W, r = ctx.world, ctx.rank
    _create_and_use_one(ctx)
    gc.collect()
    before = _resources()
    rng = random.Random(2024 + W)
    plan = _group_plan(W, rng)
    groups = [dist.new_group(members) for members in plan]
    mine = {gi for gi, members in enumerate(plan) if r in members}
    for gi, g in enumerate(groups):
        is_member = g not in (None, dist.GroupMember.NON_GROUP_MEMBER)
        assert is_member == (gi in mine), f"group {gi} {plan[gi]}: membership of rank {r}"
        if is_member:
            assert dist.get_rank(g) == sorted(plan[gi]).index(r), \
                f"group {gi} {plan[gi]}: rank {dist.get_rank(g)} for global rank {r}"
    seen_segments = _segment_names(shm_mappings()) - _segment_names(before["shm mappings"])
    if ctx.strict and ctx.transport == "shm":
        assert seen_segments, "no shared-memory segment mapped for the new groups"
    pending = []
    for rnd in range(3):
        order = list(range(N_GROUPS))
        rng.shuffle(order)
        for gi in order:
            if gi in mine:
                pending.append(_issue(ctx, (gi + rnd) % 3, gi, rnd, plan[gi], groups[gi]))
    for w, _ in reversed(pending):
        w.wait()
    for _, check in pending:
        check()
    del pending
    for g in groups:
        if g not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(g)
    del groups
    ctx.check_usable(what=f"after {N_GROUPS} groups were destroyed")
    if ctx.strict:  # gloo keeps its own per-group threads and sockets alive longer
        _released(ctx, before, seen_segments)


# --------------------------------------------------------------------------
# tensors over 2**31 bytes and over 2**31 elements
# --------------------------------------------------------------------------

PERIOD = 251             # prime: no power-of-two offset is a multiple of it
BLOCK = 1 << 24          # the full-tensor check works block by block
# TCCOMM_TEST_HUGE: "0" skips these cases (they need up to ~8 GiB of memory);
# "1" (default) runs them all on shared memory and the uint8 one on TCP;
# "all" runs every one on TCP too (about a minute more on 2 cores).
HUGE_ENV = "TCCOMM_TEST_HUGE"

_base_cache: dict = {}


def _base(dtype: torch.dtype) -> torch.Tensor:
    """i % PERIOD for i in [0, BLOCK + PERIOD)."""
    if dtype not in _base_cache:
        _base_cache[dtype] = (torch.arange(BLOCK + PERIOD, dtype=torch.int32) % PERIOD).to(dtype)
    return _base_cache[dtype]


def _block_offset(start: int, rank: int, dtype: torch.dtype) -> int:
    """The per-block, per-rank part of the value (the block index enters, so
    a block written at the wrong offset shows)."""
    if dtype == torch.uint8:
        return ((start // BLOCK) * 7 + 17 * rank + 1) % 256
    return (start // BLOCK) % 64 * 256 + rank + 1  # floats: small integers, sums exact


def pattern_value(i: int, rank: int, dtype: torch.dtype) -> int:
    """Element i of rank's input, computed with Python integers."""
    v = i % PERIOD + _block_offset(i - i % BLOCK, rank, dtype)
    return v % 256 if dtype == torch.uint8 else v


def _pattern(start: int, length: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements [start, start + length) of rank's input; start is a multiple of BLOCK."""
    off = start % PERIOD
    return _base(dtype)[off:off + length] + _block_offset(start, rank, dtype)  # uint8 wraps


def _blocks(numel: int):
    for start in range(0, numel, BLOCK):
        yield start, min(BLOCK, numel - start)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _agree_on_memory(ctx, need: int, what: str, extended: bool = False) -> None:
    """Whether to run (see HUGE_ENV; `extended`: a case that runs on TCP only
    with "all"). Rank 0 decides from MemAvailable (the ranks share this
    machine) and every rank follows, so no rank waits in a collective a peer
    skipped."""
    mode = os.environ.get(HUGE_ENV, "1")
    if mode == "0":
        raise Skip(f"{HUGE_ENV}=0")
    if extended and ctx.transport == "tcp" and mode != "all":
        raise Skip(f"on TCP this size runs with {HUGE_ENV}=all (by default only the uint8 "
                   "all_reduce runs over TCP, to keep the run short)")
    if ctx.rank == 0:
        avail = _mem_available()
        verdict = "" if avail >= need else (
            f"{what} needs {need / 2**30:.1f} GiB of available memory for {ctx.world} "
            f"ranks, MemAvailable is {avail / 2**30:.1f} GiB")
        ctx.store.set(ctx.key("memory"), verdict or "ok")
    verdict = ctx.store.get(ctx.key("memory")).decode()
    if verdict != "ok":
        raise Skip(verdict)


def _check_huge(ctx, t: torch.Tensor, ranks: list[int], what: str) -> None:
    """t must hold, element for element, the sum of `ranks`' patterns:
    sampled indices against Python integers, then every block against the
    same sum computed with torch."""
    dt, numel = t.dtype, t.numel()
    samples = sorted(i for i in {0, PERIOD, BLOCK - 1, BLOCK, 2**31 - 1, 2**31, 2**31 + 1,
                                 2**32 - 1, 2**32, numel - 1, numel // 2} if 0 <= i < numel)
    for i in samples:
        exp = sum(pattern_value(i, q, dt) for q in ranks)
        exp = exp % 256 if dt == torch.uint8 else exp
        got = t[i].item()
        assert got == exp, f"{what}: element {i} is {got}, expected {exp}"
    for start, length in _blocks(numel):
        exp = _pattern(start, length, ranks[0], dt)
        for q in ranks[1:]:
            exp = exp + _pattern(start, length, q, dt)
        got = t[start:start + length]
        if not torch.equal(got, exp):
            bad = (got != exp).nonzero().reshape(-1)
            i = start + int(bad[0])
            raise AssertionError(f"{what}: {bad.numel()} of {length} elements differ in "
                                 f"[{start}, {start + length}); first: [{i}] is "
                                 f"{t[i].item()}, expected {exp[i - start].item()}")


def _fill(t: torch.Tensor, rank: int) -> None:
    for start, length in _blocks(t.numel()):
        t[start:start + length].copy_(_pattern(start, length, rank, t.dtype))


def c_huge_all_reduce(ctx, dtype: str, numel: int, extended: bool = False):
    """all_reduce SUM of a tensor over 2**31 elements or bytes, checked on
    every element; then a broadcast of it from the last rank."""
    W, r = ctx.world, ctx.rank
    dt = getattr(torch, dtype)
    nbytes = numel * dt.itemsize
    # Per rank: the tensor, plus a few blocks of workspace; 1.5 GiB margin
    # for the rest of the machine.
    need = W * (nbytes + 8 * BLOCK * dt.itemsize) + (3 << 29)
    _agree_on_memory(ctx, need, f"all_reduce of {numel} x {dtype} ({nbytes / 2**30:.2f} GiB)",
                     extended)
    t = torch.empty(numel, dtype=dt)
    _fill(t, r)
    dist.all_reduce(t)
    _check_huge(ctx, t, list(range(W)), f"all_reduce of {numel} x {dtype}")
    # broadcast from the last rank: the others start from their own inputs
    src = W - 1
    _fill(t, r)
    dist.broadcast(t, src=src)
    _check_huge(ctx, t, [src], f"broadcast of {numel} x {dtype} from rank {src}")


def c_huge_all_gather(ctx):
    """all_gather_into_tensor whose output is over 2**31 bytes (each rank's
    part is 2**28 + 3 float32 elements, 1 GiB + 12 bytes), every element checked."""
    W, r = ctx.world, ctx.rank
    part = (1 << 28) + 3  # float32: 1 GiB + 12 bytes per rank, output over 2**31 bytes
    nbytes = part * 4
    need = W * (nbytes * (W + 1) + 8 * BLOCK * 4) + (3 << 29)
    _agree_on_memory(ctx, need, f"all_gather_into_tensor of {W} x {part} float32",
                     extended=True)
    inp = torch.empty(part, dtype=torch.float32)
    _fill(inp, r)
    out = torch.empty(W * part, dtype=torch.float32)
    all_gather_tensor(out, inp)
    del inp
    for q in range(W):
        _check_huge(ctx, out[q * part:(q + 1) * part], [q],
                    f"all_gather_into_tensor output part of rank {q}")


def _register_scale():
    add("dozens_of_groups", SUITE, c_dozens_of_groups, specs=GROUP_SPECS)
    hang = 400.0  # a single 2 GiB op shows no progress for a while on 2 busy cores
    add(f"huge-all_reduce-uint8-n{2**31 + 17}", SUITE, c_huge_all_reduce, dtype="uint8",
        numel=2**31 + 17, specs=HUGE_SPECS, hang_limit=hang)
    add(f"huge-all_reduce-float32-n{2**29 + 5}", SUITE, c_huge_all_reduce, dtype="float32",
        numel=2**29 + 5, extended=True, specs=HUGE_SPECS, hang_limit=hang)
    add("huge-all_gather_into_tensor-float32", SUITE, c_huge_all_gather, specs=HUGE_SPECS,
        hang_limit=hang)


_register_w8()
_register_scale()
