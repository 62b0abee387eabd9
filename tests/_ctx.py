"""The context handed to every multi-process case: this rank, its inputs,
the checks against the references (tests/_reference.py) and the error
messages (tests/_messages.py), and the harness's own store."""

from __future__ import annotations

import datetime
import hashlib
import itertools
import re
import time
from typing import Callable

import torch
import torch.distributed as dist

from _messages import group_re, join_and, missing_parts_phrase, rank_label_re
from _reference import (FLOATS, compare, make_input, mismatch_report, reduction_bound, ref_reduce,
                        same_value, tolerance_mismatch)
from _registry import Skip

# Reductions of this many bytes of input and more go by hosts on a group
# that spans hosts (HIER_MIN_BYTES in csrc/c_core/src/coll/coll_hier.c).
HIER_MIN_BYTES = 64 << 10
# On hosts with different rank counts, reduce_scatter runs hierarchically
# from this much input, and only where the leaders' exchange relieves the
# links (HIER_MIN_UNEVEN_BYTES, tcc__hier_leaders_relieve_links).
HIER_MIN_UNEVEN_BYTES = 2 << 20


class Ctx:
    def __init__(self, cfg: dict, rank: int, store, baseline: dict):
        self.cfg = cfg
        self.rank = rank
        self.world = cfg["world"]
        self.backend = cfg["backend"]
        self.strict = self.backend == "tccomm"  # message checks and exact floats
        self.transport = cfg["transport"]
        self.hosts = cfg.get("hosts") or []  # simulated host of each global rank ("hybrid")
        self.store = store           # the harness store: independent of the backend
        self.baseline = baseline     # resources measured before init_process_group
        self.case = ""
        self.digest_value = None
        self.timeout = datetime.timedelta(seconds=cfg["pg_timeout"])

    # inputs -------------------------------------------------------------
    def inp(self, rank: int, shape, dtype: str, kind: str = "any", tag="") -> torch.Tensor:
        return make_input((self.case, tag), rank, shape, dtype, kind)

    def garbage(self, shape, dtype: str) -> torch.Tensor:
        """An output buffer filled with values that are surely not the answer."""
        return make_input((self.case, "garbage"), 1000 + self.rank, shape, dtype)

    # checks -------------------------------------------------------------
    def digest(self, *tensors: torch.Tensor) -> None:
        """Record the result; the harness asserts it is identical on every rank."""
        h = hashlib.sha1()
        for t in tensors:
            t = t.detach().contiguous().reshape(-1)
            h.update(str(t.dtype).encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        self.digest_value = h.hexdigest()

    def compare(self, actual, expected, what: str, exact: bool = True, *,
                bound: torch.Tensor | None = None) -> None:
        compare(actual, expected, what, exact, self.world, bound=bound)

    def same_bits(self, actual, expected, what: str) -> None:
        """For data that is only moved: every bit must arrive, NaN payloads too."""
        compare(actual, expected, what, bits=True)

    def exact_for(self, dtype: str, redop: str) -> bool:
        """Exact comparison for integers, MIN/MAX, and for tccomm every float
        reduction: README specifies them bit for bit (rank order 0..n-1,
        float16/bfloat16 accumulated in float32 and rounded once, AVG divided
        in that precision, PREMUL_SUM's factor applied to each input)."""
        if dtype not in FLOATS or redop in ("MIN", "MAX"):
            return True
        return self.strict

    def check_any_order(self, actual, xs: list[torch.Tensor], dtype: str, redop: str,
                        what: str) -> None:
        """For a backend that reduces in an unspecified order (gloo): each
        element must be the result of combining the inputs in some order of
        the ranks, accumulating in float32 or in `dtype` itself (where
        Inf - Inf, overflow and underflow depend on the order), or be within
        reduction_bound of the rank-order result. Integer reductions (wrapping,
        bitwise, MIN/MAX) do not depend on the order: they are exact."""
        if dtype not in FLOATS:
            return self.check_reduction(actual, xs, dtype, redop, what)
        ref = ref_reduce(xs, dtype, redop)
        ok = ~tolerance_mismatch(actual, ref, reduction_bound(xs, dtype, redop))
        ok &= torch.isfinite(actual) & torch.isfinite(ref)
        accs = (None, dtype) if dtype in ("float16", "bfloat16") else (None,)
        for order in itertools.permutations(range(len(xs))):
            for acc in accs:
                ok |= same_value(actual, ref_reduce([xs[q] for q in order], dtype, redop,
                                                    accumulate=acc))
        if not bool(ok.all()):
            raise AssertionError(f"{what} (compared with every order of the ranks): "
                                 f"{mismatch_report(actual, ref, ~ok)}")

    def check_reduction(self, actual, xs: list[torch.Tensor], dtype: str, redop: str,
                        what: str, blocks: list[list[int]] | None = None) -> None:
        """`actual` is the reduction of the inputs `xs` (in rank order, or
        block by block: see ref_reduce): exact where exact_for says so, else
        within reduction_bound."""
        exact = self.exact_for(dtype, redop)
        bound = None if exact else reduction_bound(xs, dtype, redop)
        self.compare(actual, ref_reduce(xs, dtype, redop, blocks=blocks), what, exact, bound=bound)

    def check_allreduce(self, actual, xs: list[torch.Tensor], dtype: str, redop: str,
                        what: str, group=None) -> None:
        """check_reduction for an all_reduce on `group`, in the order tccomm
        reduces it there (hier_blocks)."""
        blocks = self.hier_blocks("all_reduce", xs[0].numel(), dtype, redop, group)
        self.check_reduction(actual, xs, dtype, redop, what, blocks)

    def check_reduce(self, actual, xs: list[torch.Tensor], dtype: str, redop: str,
                     what: str, group=None) -> None:
        """check_reduction for the root's output of a reduce on `group`, in
        the order tccomm reduces it there."""
        blocks = self.hier_blocks("reduce", xs[0].numel(), dtype, redop, group)
        self.check_reduction(actual, xs, dtype, redop, what, blocks)

    def check_reduce_scatter(self, actual, xs: list[torch.Tensor], dtype: str, redop: str,
                             what: str, group=None) -> None:
        """check_reduction for a reduce_scatter on `group` (xs: this rank's
        block of every rank's input), in the order tccomm reduces it there."""
        n = len(xs)
        blocks = self.hier_blocks("reduce_scatter", n * xs[0].numel(), dtype, redop, group)
        self.check_reduction(actual, xs, dtype, redop, what, blocks)

    def hier_blocks(self, op: str, count: int, dtype: str, redop: str, group=None):
        """The order in which tccomm reduces `op` (all_reduce, reduce or
        reduce_scatter) with `count` elements of input per rank on `group`:
        None for rank order, else the group ranks of each host, hosts in the
        order of their lowest rank (README: "Groups that span hosts").
        Hierarchical when the group has ranks on several hosts and some host
        has several, from HIER_MIN_BYTES of input, except for float16 and
        bfloat16 (AVG sums in this order and divides once); reduce_scatter
        on uneven hosts as HIER_MIN_UNEVEN_BYTES says
        (csrc/c_core/src/coll/coll_hier.c)."""
        if not self.strict or not self.hosts:
            return None
        if dtype in ("float16", "bfloat16"):
            return None
        nbytes = count * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if nbytes < HIER_MIN_BYTES:
            return None
        ranks = dist.get_process_group_ranks(group) if group is not None else range(self.world)
        by_host: dict[int, list[int]] = {}
        for i, g in enumerate(ranks):
            by_host.setdefault(self.hosts[g], []).append(i)
        blocks = sorted(by_host.values())
        if len(blocks) < 2 or len(blocks) == len(ranks):
            return None  # one host (shm) or one rank per host (tcp): flat
        sizes, n = [len(b) for b in blocks], len(ranks)
        if op == "reduce_scatter" and len(set(sizes)) > 1:
            relieved = all(k * (len(sizes) - 1) < n - 1 and n - k < n - 1 for k in sizes)
            if nbytes < HIER_MIN_UNEVEN_BYTES or not relieved:
                return None  # uneven hosts: flat below the size, or where a ring loads the links no more
        return blocks

    def expect_error(self, fn: Callable, op_re: str, cause_re: str | None,
                     what: str, group=None) -> str:
        """`fn` must raise; for tccomm the message must name the op, the group,
        this rank and the cause (README: "Bad input raises an error that names
        the op, the group, the rank and the cause")."""
        try:
            fn()
        except Skip:
            raise
        except Exception as e:  # noqa: BLE001 - any exception type is acceptable
            msg = f"{type(e).__name__}: {e}"
            if self.strict:
                parts = [("the op", op_re), ("the group", group_re(group)),
                         ("the rank", rank_label_re(group)), ("the cause", cause_re)]
                missing = [(name, pat) for name, pat in parts
                           if pat and not re.search(pat, msg, re.I)]
                if missing:
                    expected = "; ".join(f"{name} as /{pat}/" for name, pat in missing)
                    raise AssertionError(
                        f"{what}: {missing_parts_phrase(join_and([n for n, _ in missing]))}"
                        f"expected {expected}): {msg!r}")
            return msg
        raise AssertionError(f"{what}: expected an error, but the call returned normally")

    def check_usable(self, group=None, what: str = "after the error") -> None:
        """A correct all_reduce on the group must still work."""
        ranks = dist.get_process_group_ranks(group) if group is not None else range(self.world)
        t = torch.full((5,), float(self.rank + 1), dtype=torch.float64)
        try:
            dist.all_reduce(t, group=group)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"the group is not usable {what}: all_reduce raised "
                                 f"{type(e).__name__}: {e}") from None
        exp = float(sum(r + 1 for r in ranks))
        if not torch.equal(t, torch.full((5,), exp, dtype=torch.float64)):
            raise AssertionError(f"the group is not usable {what}: all_reduce gave "
                                 f"{t.tolist()} instead of {exp}")

    # harness-store helpers (do not depend on the backend under test) -----
    def key(self, name: str) -> str:
        return f"{self.cfg['store_prefix']}/{self.case}/{name}"

    def store_count_wait(self, name: str, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        k = self.key(name)
        while self.store.add(k, 0) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"harness: timed out waiting for {count} ranks on {k}")
            time.sleep(0.02)
