"""The test cases run inside the spawned process groups.

This module is imported twice: by pytest (to turn every case into a test id)
and by each worker process (tests/_worker.py) to run the cases. It must build
the same registry in both, so everything here is deterministic.

A case is a function ``fn(ctx, **params)`` run on every rank of a group. It
passes by returning, fails by raising AssertionError (any other exception is
reported as an error with its traceback) and skips by raising Skip. Every
expected value is computed from deterministic per-rank inputs: the input of
rank ``r`` in case ``c`` is a pure function of ``(c, tag, r)``, so each rank can
recompute every other rank's input and derive the reference with plain torch
(integer references go through numpy int64 to get well-defined wrap-around).
Results are compared bit for bit wherever the semantics make them exact (any
NaN equals any NaN in a reduction; moved data must keep its NaN payloads),
otherwise within an elementwise rounding bound (see compare()).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import itertools
import os
import re
import time
import zlib
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

# --------------------------------------------------------------------------
# dtypes, reduce ops and reference reductions
# --------------------------------------------------------------------------

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16",
          "int32", "int64", "uint8", "bool"]
FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "int16", "int32", "int64", "uint8")
REDOPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
BITWISE = ("BAND", "BOR", "BXOR")
PREMUL_FACTOR = 0.7  # not a power of two: the multiplication really rounds

# Odd sizes make every chunked path end with a remainder.
LARGE = (1 << 21) + 3       # ~2 Mi elements (8 MiB of float32) per rank
LARGE_PART = (1 << 19) + 1  # per-rank part for gather/scatter-like ops

# Names used to recognise "the message names the dtype" (core or torch names).
DTYPE_ALIASES = {
    "float32": ["float32", "float", "f32"], "float64": ["float64", "double", "f64"],
    "float16": ["float16", "half", "f16"], "bfloat16": ["bfloat16", "bf16"],
    "int8": ["int8", "char"], "int16": ["int16", "short"], "int32": ["int32", "int"],
    "int64": ["int64", "long"], "uint8": ["uint8", "byte"], "bool": ["bool"],
}
REDOP_ALIASES = {
    "BAND": ["band", "bitwise", "and"], "BOR": ["bor", "bitwise", "or"],
    "BXOR": ["bxor", "bitwise", "xor"], "AVG": ["avg", "average", "mean"],
    "PREMUL_SUM": ["premul"],
}


def tdtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def redop_error(dtype: str, redop: str) -> str | None:
    """Why `redop` cannot reduce `dtype` (None when it can)."""
    if redop in BITWISE and dtype in FLOATS:
        return f"bitwise {redop} on {dtype}"
    if redop == "AVG" and dtype == "bool":
        return "AVG on bool"
    if redop == "PREMUL_SUM" and dtype not in FLOATS:
        return f"PREMUL_SUM on {dtype}"
    return None


def make_redop(redop: str):
    if redop == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, redop)


def input_kind(redop: str) -> str:
    return {"PRODUCT": "product", "AVG": "avg"}.get(redop, "any")


def ref_reduce(xs: list[torch.Tensor], dtype: str, redop: str,
               accumulate: str | None = None) -> torch.Tensor:
    """Reduce xs in rank order 0..n-1 the way tccomm specifies it (floats:
    PREMUL_SUM's factor applied to each input, sums in rank order, AVG's
    division in the accumulation type, one rounding to `dtype` at the end).
    `accumulate` overrides the accumulation type of float16/bfloat16 (to
    model a backend that rounds every step)."""
    n = len(xs)
    dt = tdtype(dtype)
    if dtype == "bool":
        acc = xs[0].clone()
        for x in xs[1:]:
            if redop in ("SUM", "MAX", "BOR"):
                acc = acc | x
            elif redop in ("PRODUCT", "MIN", "BAND"):
                acc = acc & x
            elif redop == "BXOR":
                acc = acc ^ x
            else:
                raise ValueError(redop)
        return acc
    if dtype in INTS:
        arrs = [x.to(torch.int64).numpy() for x in xs]
        acc = arrs[0].copy()
        for a in arrs[1:]:  # numpy int64 arrays wrap modulo 2**64
            if redop in ("SUM", "AVG"):
                acc = acc + a
            elif redop == "PRODUCT":
                acc = acc * a
            elif redop == "MIN":
                acc = np.minimum(acc, a)
            elif redop == "MAX":
                acc = np.maximum(acc, a)
            elif redop == "BAND":
                acc = acc & a
            elif redop == "BOR":
                acc = acc | a
            elif redop == "BXOR":
                acc = acc ^ a
            else:
                raise ValueError(redop)
        acc = _wrap(acc, dtype)
        if redop == "AVG":  # the wrapped sum, C division: truncate toward zero
            q = acc // n
            acc = np.where((acc % n != 0) & (acc < 0), q + 1, q)
        return torch.from_numpy(np.ascontiguousarray(acc)).to(dt)
    acc_dt = torch.float32 if dtype in ("float16", "bfloat16") else dt
    if accumulate is not None:
        acc_dt = tdtype(accumulate)
    ys = [x.to(acc_dt) for x in xs]
    if redop == "PREMUL_SUM":
        f = torch.tensor(PREMUL_FACTOR, dtype=acc_dt)
        ys = [y * f for y in ys]
    acc = ys[0].clone()
    for y in ys[1:]:
        if redop in ("SUM", "AVG", "PREMUL_SUM"):
            acc = acc + y
        elif redop == "PRODUCT":
            acc = acc * y
        elif redop in ("MIN", "MAX"):
            # A NaN wins from wherever it comes; on a tie (+0 vs -0) the lower
            # rank's value stays. (torch.minimum/maximum also propagate NaN but
            # return the second operand on a +0/-0 tie.)
            better = y < acc if redop == "MIN" else y > acc
            acc = torch.where(better | torch.isnan(y), y, acc)
        else:
            raise ValueError(redop)
    if redop == "AVG":
        acc = acc / n
    return acc.to(dt)


def _wrap(acc: np.ndarray, dtype: str) -> np.ndarray:
    """int64 values reduced modulo 2**bits of `dtype`, as two's complement."""
    bits = 8 * torch.tensor([], dtype=tdtype(dtype)).element_size()
    if bits < 64:
        acc = acc & ((1 << bits) - 1)
        if dtype != "uint8":
            acc = np.where(acc >= (1 << (bits - 1)), acc - (1 << bits), acc)
    return acc


# --------------------------------------------------------------------------
# context handed to every case
# --------------------------------------------------------------------------


class Skip(Exception):
    """Raised by a case that does not apply; the message is the reason."""


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def make_input(key, rank: int, shape, dtype: str, kind: str = "any") -> torch.Tensor:
    """Deterministic input of `rank` for `key` (any rank can recompute it)."""
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator().manual_seed(_seed(key, rank))
    dt = tdtype(dtype)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in FLOATS:
        if kind == "product":  # magnitudes near 1: products neither overflow nor vanish
            mag = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
            sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
            return (mag * sign).to(dt)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dt)
    info = torch.iinfo(dt)
    lo, hi = info.min, info.max
    if kind == "avg":  # the sum of up to 8 inputs must not overflow
        lo, hi = lo // 8, hi // 8
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dt)


def _float_specials(dtype: str) -> torch.Tensor:
    """Bit patterns (as integers of the dtype's width) of the values that
    break careless reductions and copies: signed zeros, the smallest and the
    largest subnormal, the smallest normal, the largest finite value, Inf,
    and NaNs that are quiet or signalling, positive or negative, with and
    without a payload."""
    dt = tdtype(dtype)
    fi = torch.finfo(dt)
    tiny = fi.smallest_normal * fi.eps  # the smallest subnormal
    values = [0.0, 1.0, 0.7, 3.25, fi.eps, tiny, fi.smallest_normal - tiny,
              fi.smallest_normal, fi.max, float("inf")]
    pos = bits_of(torch.tensor(values, dtype=torch.float64).to(dt))
    width = 8 * pos.element_size()
    sign = -(1 << (width - 1))  # the sign bit, as a signed integer of that width
    mant = round(-np.log2(fi.eps))  # mantissa bits
    inf = int(pos[-1])
    quiet = inf | (1 << (mant - 1))
    nans = torch.tensor([quiet, quiet | 5, inf | 1, inf | (1 << (mant - 1)) - 1],
                        dtype=pos.dtype)
    return torch.cat([pos, pos | sign, nans, nans | sign])


def special_input(key, rank: int, shape, dtype: str) -> torch.Tensor:
    """Deterministic hostile input of `rank` for `key`: about half of the
    elements from _float_specials (floats) or the integer extremes, the rest
    ordinary signed values."""
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator().manual_seed(_seed(key, rank, "special"))
    dt = tdtype(dtype)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in FLOATS:
        specials = _float_specials(dtype)
        nan = torch.isnan(specials.view(dt))
        pool, nans = specials[~nan], specials[nan]
        ordinary = bits_of((torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dt))
        # One element in 16 a NaN: with 4 ranks most results are still numbers.
        some_nan = nans[torch.randint(0, len(nans), shape, generator=g)]
        ordinary = torch.where(torch.randint(0, 8, shape, generator=g) == 0, some_nan, ordinary)
    else:
        info = torch.iinfo(dt)
        extremes = {info.min, info.min + 1, -1, 0, 1, info.max // 2 + 1, info.max - 1, info.max}
        pool = torch.tensor(sorted(v for v in extremes if info.min <= v <= info.max), dtype=dt)
        ordinary = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dt)
    picked = pool[torch.randint(0, len(pool), shape, generator=g)]
    use_pool = torch.randint(0, 2, shape, generator=g).bool()
    out = torch.where(use_pool, picked, ordinary)
    return out.view(dt) if dtype in FLOATS else out


class Ctx:
    def __init__(self, cfg: dict, rank: int, store, baseline: dict):
        self.cfg = cfg
        self.rank = rank
        self.world = cfg["world"]
        self.backend = cfg["backend"]
        self.strict = self.backend == "tccomm"  # message checks and exact floats
        self.transport = cfg["transport"]
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
                                 f"{_mismatch_report(actual, ref, ~ok)}")

    def check_reduction(self, actual, xs: list[torch.Tensor], dtype: str, redop: str,
                        what: str) -> None:
        """`actual` is the reduction of the inputs `xs` (in rank order): exact
        where exact_for says so, else within reduction_bound."""
        exact = self.exact_for(dtype, redop)
        bound = None if exact else reduction_bound(xs, dtype, redop)
        self.compare(actual, ref_reduce(xs, dtype, redop), what, exact, bound=bound)

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
                        f"{what}: {missing_parts_phrase(_and([n for n, _ in missing]))}"
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


# Comparison modes. "bits": every bit, NaN payloads included (data that is
# only moved must arrive untouched). "exact": every bit, except that any NaN
# equals any NaN (a reduction's NaN payload is unspecified). Otherwise an
# elementwise bound: `bound` (see reduction_bound), or, without one, the
# rounding errors of `world` operations relative to each expected element.
_BITS_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64,
              torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage as integers of the same width (the identity for integers)."""
    t = t.detach().contiguous()
    return t.view(_BITS_VIEW[t.dtype]) if t.dtype in _BITS_VIEW else t


def _both_nan(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    if not a.dtype.is_floating_point:
        return torch.zeros(a.shape, dtype=torch.bool)
    return torch.isnan(a) & torch.isnan(e)


def same_value(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Elementwise: identical bits, or both NaN (+0 and -0 differ)."""
    return (bits_of(a) == bits_of(e)) | _both_nan(a, e)


def tolerance_mismatch(a: torch.Tensor, e: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Elementwise: |a - e| > bound for finite e; for Inf/NaN e, a must be the
    same Inf, or a NaN."""
    a64, e64 = a.double(), e.double()
    close = (a64 - e64).abs() <= bound
    return ~torch.where(torch.isfinite(e64), close, (a64 == e64) | _both_nan(a, e))


def reduction_bound(xs: list[torch.Tensor], dtype: str, redop: str,
                    extra_roundings: int = 0) -> torch.Tensor:
    """How far apart two evaluations of ref_reduce(xs, dtype, redop) may be,
    per element, when they round differently (another order, as gloo's and
    NCCL's reductions; or rounding every step to `dtype` instead of once).

    Each rounding to nearest changes a value by at most u = eps/2 of its
    magnitude (and by at most half the smallest subnormal in the subnormal
    range). A partial sum is never larger than S = sum |x_i|, so k roundings
    move a sum by at most k*u*S; relative errors of products compose, so k
    roundings move a product by at most about k*u*|product|. Two
    evaluations are each that far from the exact value: the bound is
    k*eps*magnitude + k*(smallest subnormal). k counts the roundings of one
    evaluation: W-1 combinations, the final rounding to `dtype`, the premul
    factor and its W products, the division of AVG, and `extra_roundings`
    (a backend that evaluates differently, e.g. AVG as a sum of x_i * (1/W))."""
    W = len(xs)
    fi = torch.finfo(tdtype(dtype))
    mags = [x.double().abs() for x in xs]
    if redop == "PRODUCT":
        magnitude, k = torch.stack(mags).prod(0), W
    else:
        k = W
        if redop == "PREMUL_SUM":
            mags = [m * PREMUL_FACTOR for m in mags]
            k += W + 1
        magnitude = torch.stack(mags).sum(0)
        if redop == "AVG":
            magnitude, k = magnitude / W, k + 1
    k += extra_roundings
    return k * fi.eps * magnitude + k * fi.smallest_normal * fi.eps


def _mismatch_report(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor,
                     show_bits: bool = False) -> str:
    a, e = actual.reshape(-1), expected.reshape(-1)
    ab, eb = bits_of(a), bits_of(e)
    idx = bad.reshape(-1).nonzero().reshape(-1)

    def show(t, b, i):
        v = repr(t[i].item())
        return f"{v} (bits {b[i].item() & ((1 << (8 * b.element_size())) - 1):#x})" \
            if show_bits or t.dtype.is_floating_point else v
    first = ", ".join(f"[{i}] got {show(a, ab, i)} expected {show(e, eb, i)}"
                      for i in idx[:4].tolist())
    return f"{idx.numel()} of {a.numel()} elements differ; first: {first}"


def compare(actual, expected, what: str, exact: bool = True, world: int = 1, *,
            bound: torch.Tensor | None = None, bits: bool = False) -> None:
    """See the comparison modes above: `bits`, else `exact`, else a bound."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected "
                             f"{tuple(expected.shape)}")
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if bits:
        bad = bits_of(actual) != bits_of(expected)
        how = "bit for bit"
    elif exact or not actual.dtype.is_floating_point:
        bad = ~same_value(actual, expected)
        how = "exactly"
    else:
        if bound is None:
            fi = torch.finfo(actual.dtype)
            bound = world * fi.eps * expected.double().abs() + world * fi.smallest_normal * fi.eps
        bad = tolerance_mismatch(actual, expected, bound.reshape(expected.shape))
        how = "within the rounding bound"
    if bool(bad.any()):
        raise AssertionError(f"{what} (compared {how}): "
                             f"{_mismatch_report(actual, expected, bad, bits)}")


def group_re(group=None) -> str:
    """The group as tccomm's messages name it: torch's name for the group,
    quoted, with or without the backend's prefix ('tccomm:0' for the default
    group). Another group's name or a bare word "group" does not count."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return rf"'(?:tccomm:)?{re.escape(pg.group_name)}'"


def rank_label_re(group=None) -> str:
    """This process's rank in `group` as tccomm labels the rank that raises:
    "(rank R)" or "(rank R of N)" after the group's name. A bare "rank R"
    elsewhere is part of the cause (e.g. "rank 1 has 8 elements") and does
    not count."""
    return rf"\(rank {dist.get_rank(group)}(?: of \d+)?\)"


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def missing_parts_phrase(parts: str) -> str:
    """How Ctx.expect_error starts its failure when the error lacks `parts`
    (conftest.py recognises known gaps, Case.msg_gap, by it)."""
    return f"the error does not name {parts} ("


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    suite: str                  # which test file reports it
    fn: Callable
    params: dict
    worlds: tuple | None = None  # None: every world size
    specs: tuple | None = None   # None: every "main" spec
    gloo_skip: str | None = None  # reason to skip when validating against gloo
    order: int = 0               # cases with a higher order run last
    hang_limit: float = 0.0      # seconds without progress before it counts as hung,
                                 # when longer than the harness's default
    msg_gap: str | None = None   # the parts tccomm's expected error is known not to
                                 # name yet: the case is an expected failure (strict)


REGISTRY: dict[str, Case] = {}
TEARDOWN = "teardown"  # the pseudo-case of each spec: everything after its last case


def add(name, suite, fn, worlds=None, specs=None, gloo_skip=None, order=0, hang_limit=0.0,
        msg_gap=None, **params):
    assert name not in REGISTRY and name != TEARDOWN, name
    REGISTRY[name] = Case(name, suite, fn, params, worlds, specs, gloo_skip, order, hang_limit,
                          msg_gap)


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    world: int
    transport: str  # "shm" (default: TCCOMM_TRANSPORT unset) or "tcp" (forced)
    init: str       # "env", "tcp" or "file"
    kind: str = "main"
    pg_timeout: float = 30.0


SPECS = [
    Spec("w2-shm-env", 2, "shm", "env"),
    Spec("w2-tcp-tcpinit", 2, "tcp", "tcp"),
    Spec("w3-shm-file", 3, "shm", "file"),
    Spec("w3-tcp-env", 3, "tcp", "env"),
    Spec("w4-shm-tcpinit", 4, "shm", "tcp"),
    Spec("w4-tcp-file", 4, "tcp", "file"),
    # Groups whose only purpose is a peer that never arrives (unusable afterwards).
    Spec("w3-shm-env-timeout", 3, "shm", "env", kind="timeout", pg_timeout=2.0),
    Spec("w2-tcp-env-timeout", 2, "tcp", "env", kind="timeout", pg_timeout=2.0),
    # torch.compile and the parallelism stack (tests/_cases_parallel.py).
    Spec("w2-shm-env-parallel", 2, "shm", "env", kind="parallel"),
    Spec("w4-tcp-env-parallel", 4, "tcp", "env", kind="parallel"),
]
SPEC_BY_NAME = {s.name: s for s in SPECS}


def cases_for(spec: Spec, suite: str | None = None) -> list[Case]:
    out = []
    for c in REGISTRY.values():
        if suite is not None and c.suite != suite:
            continue
        if c.specs is None:
            if spec.kind != "main":
                continue
        elif spec.name not in c.specs:
            continue
        if c.worlds is not None and spec.world not in c.worlds:
            continue
        out.append(c)
    return sorted(out, key=lambda c: c.order)  # stable: registry order otherwise


def params_for(suite: str) -> list[tuple[str, str]]:
    """(spec, case) for every case of `suite`, each spec's cases followed by
    its TEARDOWN pseudo-case (conftest.py runs one of those per spec)."""
    out = []
    for s in SPECS:
        names = [c.name for c in cases_for(s, suite)]
        out += [(s.name, n) for n in names] + ([(s.name, TEARDOWN)] if names else [])
    return out


# ==========================================================================
# collectives: every op x dtype x reduce op
# ==========================================================================

def _op_re(*names: str) -> str:
    """Any of `names` as a whole name: "reduce" matches neither "allreduce" nor
    "reduce_scatter" nor "_reduce_scatter_base"."""
    return rf"(?<![A-Za-z0-9_])(?:{'|'.join(map(re.escape, names))})(?![A-Za-z0-9_])"


# Each op under the names tccomm's messages use for it: torch.distributed's
# function, the c10d Backend method torch calls, and the C core's op.
OP_RE = {
    "all_reduce": _op_re("all_reduce", "allreduce"),
    "reduce": _op_re("reduce"),
    "broadcast": _op_re("broadcast"),
    "reduce_scatter": _op_re("reduce_scatter"),
    "reduce_scatter_tensor": _op_re("reduce_scatter_tensor", "_reduce_scatter_base",
                                    "reduce_scatter"),
    "all_gather": _op_re("all_gather", "allgather"),
    "all_gather_into_tensor": _op_re("all_gather_into_tensor", "_allgather_base", "allgather"),
    "gather": _op_re("gather"),
    "scatter": _op_re("scatter"),
    "all_to_all_single": _op_re("all_to_all_single", "alltoall_base", "alltoall"),
    "send": _op_re("send"),
    "recv": _op_re("recv"),
}

# A known gap in what an expected error names (Case.msg_gap): such a case is
# a strict expected failure until the message names it. None is known today;
# the harness self-check uses this one.
NO_GROUP_NO_RANK = "the group and the rank"


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
    ctx.check_reduction(t, xs, dtype, redop, f"all_reduce {redop}")
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
        ctx.check_reduction(t, xs, dtype, redop, f"reduce {redop} at root {root}")


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
    ctx.check_reduction(out, mine, dtype, redop, f"reduce_scatter {redop}")


def _reduce_scatter_tensor(out, inp, op, group=None, async_op=False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=op, group=group, async_op=async_op)


def _all_gather_tensor(out, inp, group=None, async_op=False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def c_reduce_scatter_tensor(ctx, dtype, redop, n):
    W, r = ctx.world, ctx.rank
    xs = [ctx.inp(s, W * n, dtype, input_kind(redop)) for s in range(W)]
    out = ctx.garbage(n, dtype)
    op = make_redop(redop)
    if redop_error(dtype, redop):
        return _reduction_error(ctx, "reduce_scatter_tensor", dtype, redop,
                                lambda: _reduce_scatter_tensor(out, xs[r], op))
    _reduce_scatter_tensor(out, xs[r], op)
    mine = [x[r * n:(r + 1) * n] for x in xs]
    ctx.check_reduction(out, mine, dtype, redop, f"reduce_scatter_tensor {redop}")


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
    _all_gather_tensor(out, ctx.inp(r, n, dtype))
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
        _reduce_scatter_tensor(out, full[r], op)
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
        _all_gather_tensor(out, x(r, "ag"))
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


# ==========================================================================
# features: async work, coalesced ops, p2p, objects, barrier, groups, ...
# ==========================================================================


def c_async_work(ctx):
    W, r = ctx.world, ctx.rank
    xs = [ctx.inp(s, 1000, "float32") for s in range(W)]
    t = xs[r].clone()
    work = dist.all_reduce(t, async_op=True)
    assert work is not None, "all_reduce(async_op=True) returned None"
    ret = work.wait()
    assert ret is True, f"Work.wait() returned {ret!r}, expected True"
    assert work.is_completed(), "Work.is_completed() is False after wait()"
    assert work.exception() is None, f"Work.exception() is {work.exception()!r}"
    ctx.check_reduction(t, xs, "float32", "SUM", "async all_reduce")
    fut_val = work.get_future().wait()
    assert isinstance(fut_val, list) and len(fut_val) == 1, \
        f"get_future().wait() returned {type(fut_val).__name__} {fut_val!r:.200}, " \
        "expected the output tensor list"
    ctx.same_bits(fut_val[0], t, "get_future().wait()[0]")
    assert fut_val[0].data_ptr() == t.data_ptr(), \
        "get_future().wait()[0] is not the output tensor (different storage)"

    # wait(timeout) and many outstanding works waited in reverse order
    ts = [ctx.inp(r, 100 + k, "float64", tag=k) for k in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for k in reversed(range(8)):
        assert works[k].wait(timeout=datetime.timedelta(seconds=60)) is True, \
            f"wait(timeout) of work {k} did not return True"
    for k in range(8):
        ctx.check_reduction(ts[k], [ctx.inp(s, 100 + k, "float64", tag=k) for s in range(W)],
                            "float64", "SUM", f"outstanding all_reduce {k}")

    # a future callback sees the result (as DDP comm hooks do)
    t2 = ctx.inp(r, 64, "int64", tag="cb")
    w2 = dist.all_reduce(t2, async_op=True)
    fut2 = w2.get_future().then(lambda f: f.value()[0] * 2)
    exp2 = ref_reduce([ctx.inp(s, 64, "int64", tag="cb") for s in range(W)], "int64", "SUM")
    ctx.compare(fut2.wait(), exp2 * 2, "future.then() result")

    # async broadcast / all_gather / reduce_scatter_tensor
    b = ctx.inp(0, 33, "int32") if r == 0 else ctx.garbage(33, "int32")
    wb = dist.broadcast(b, src=0, async_op=True)
    outs = [ctx.garbage(17, "float32") for _ in range(W)]
    wg = dist.all_gather(outs, ctx.inp(r, 17, "float32"), async_op=True)
    rs_in = ctx.inp(r, W * 9, "int64", tag="rs")
    rs_out = ctx.garbage(9, "int64")
    wr = _reduce_scatter_tensor(rs_out, rs_in, dist.ReduceOp.SUM, async_op=True)
    wr.wait()
    wg.wait()
    wb.wait()
    ctx.compare(b, ctx.inp(0, 33, "int32"), "async broadcast")
    for s in range(W):
        ctx.compare(outs[s], ctx.inp(s, 17, "float32"), f"async all_gather[{s}]")
    ctx.compare(rs_out, ref_reduce([ctx.inp(s, W * 9, "int64", tag="rs")[r * 9:(r + 1) * 9]
                                    for s in range(W)], "int64", "SUM"),
                "async reduce_scatter_tensor")
    for name, w in (("broadcast", wb), ("all_gather", wg), ("reduce_scatter", wr)):
        # (gloo's reduce_scatter_tensor work never reports is_completed())
        if ctx.strict:
            assert w.is_completed(), f"{name}: is_completed() False after wait()"
        assert w.exception() is None, f"{name}: exception() is {w.exception()!r}"


def c_all_reduce_coalesced(ctx):
    W, r = ctx.world, ctx.rank
    shapes = [(5,), (31, 3), (0,), (1023,)]
    ts = [ctx.inp(r, s, "float32", tag=k) for k, s in enumerate(shapes)]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX)
    for k, s in enumerate(shapes):
        ctx.compare(ts[k], ref_reduce([ctx.inp(q, s, "float32", tag=k) for q in range(W)],
                                      "float32", "MAX"), f"all_reduce_coalesced[{k}]")


def c_all_gather_coalesced(ctx):
    W, r = ctx.world, ctx.rank
    shapes = [(4, 2), (1,), (77,)]
    ins = [ctx.inp(r, s, "int32", tag=k) for k, s in enumerate(shapes)]
    outs = [[ctx.garbage(s, "int32") for s in shapes] for _ in range(W)]
    dist.all_gather_coalesced(outs, ins)
    for q in range(W):
        for k, s in enumerate(shapes):
            ctx.compare(outs[q][k], ctx.inp(q, s, "int32", tag=k),
                        f"all_gather_coalesced output[{q}][{k}]")


def c_coalescing_manager(ctx):
    """What FSDP and funcol issue: coalesced all-gather-into-tensor,
    reduce-scatter-tensor and all_reduce through torch's coalescing manager."""
    from torch.distributed.distributed_c10d import _coalescing_manager
    W, r = ctx.world, ctx.rank
    sizes = [3, 100, 1]
    outs = [ctx.garbage(W * n, "float32") for n in sizes]
    with _coalescing_manager(async_ops=True) as cm:
        for k, n in enumerate(sizes):
            _all_gather_tensor(outs[k], ctx.inp(r, n, "float32", tag=k))
    cm.wait()
    for k, n in enumerate(sizes):
        ctx.compare(outs[k], torch.cat([ctx.inp(q, n, "float32", tag=k) for q in range(W)]),
                    f"coalesced all_gather_into_tensor[{k}]")
    rs_out = [ctx.garbage(n, "float64") for n in sizes]
    with _coalescing_manager():
        for k, n in enumerate(sizes):
            _reduce_scatter_tensor(rs_out[k], ctx.inp(r, W * n, "float64", tag=f"rs{k}"),
                                   dist.ReduceOp.SUM)
    for k, n in enumerate(sizes):
        mine = [ctx.inp(q, W * n, "float64", tag=f"rs{k}")[r * n:(r + 1) * n] for q in range(W)]
        ctx.check_reduction(rs_out[k], mine, "float64", "SUM",
                            f"coalesced reduce_scatter_tensor[{k}]")
    ar = [ctx.inp(r, n, "int64", tag=f"ar{k}") for k, n in enumerate(sizes)]
    with _coalescing_manager():
        for t in ar:
            dist.all_reduce(t)
    for k, n in enumerate(sizes):
        ctx.compare(ar[k], ref_reduce([ctx.inp(q, n, "int64", tag=f"ar{k}") for q in range(W)],
                                      "int64", "SUM"), f"coalesced all_reduce[{k}]")


def c_p2p_tags(ctx):
    """isend/irecv with tags: messages are matched by (peer, tag), and by
    order within one tag; receives are posted in a different tag order."""
    W, r = ctx.world, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    a, b = ctx.inp(r, 40, "float32", tag="a"), ctx.inp(r, 41, "int64", tag="b")
    seq = [ctx.inp(r, 10 + k, "int16", tag=f"s{k}") for k in range(3)]
    sends = [dist.isend(a, dst=nxt, tag=1), dist.isend(b, dst=nxt, tag=2)]
    sends += [dist.isend(x, dst=nxt, tag=3) for x in seq]
    rb, ra = ctx.garbage(41, "int64"), ctx.garbage(40, "float32")
    rseq = [ctx.garbage(10 + k, "int16") for k in range(3)]
    recvs = [dist.irecv(rb, src=prv, tag=2), dist.irecv(ra, src=prv, tag=1)]
    recvs += [dist.irecv(x, src=prv, tag=3) for x in rseq]
    for w in recvs + sends:
        w.wait()
    ctx.compare(ra, ctx.inp(prv, 40, "float32", tag="a"), "irecv tag 1")
    ctx.compare(rb, ctx.inp(prv, 41, "int64", tag="b"), "irecv tag 2")
    for k in range(3):
        ctx.compare(rseq[k], ctx.inp(prv, 10 + k, "int16", tag=f"s{k}"),
                    f"irecv tag 3 message {k} (order within a tag)")


def c_p2p_all_pairs(ctx):
    """Every rank sends to every other rank (irecv posted before isend)."""
    W, r = ctx.world, ctx.rank
    bufs = {p: ctx.garbage(50 + p, "float64") for p in range(W) if p != r}
    recvs = [dist.irecv(bufs[p], src=p, tag=7) for p in bufs]
    sends = [dist.isend(ctx.inp(r, 50 + r, "float64", tag=p), dst=p, tag=7)
             for p in range(W) if p != r]
    for w in recvs + sends:
        w.wait()
    for p, buf in bufs.items():
        ctx.compare(buf, ctx.inp(p, 50 + p, "float64", tag=r), f"message from {p}")


def c_batch_isend_irecv(ctx, n):
    W, r = ctx.world, ctx.rank
    nxt, prv = (r + 1) % W, (r - 1) % W
    to_next, to_prev = ctx.inp(r, n, "float32", tag="n"), ctx.inp(r, n, "float32", tag="p")
    from_prev, from_next = ctx.garbage(n, "float32"), ctx.garbage(n, "float32")
    ops = [dist.P2POp(dist.isend, to_next, nxt), dist.P2POp(dist.isend, to_prev, prv),
           dist.P2POp(dist.irecv, from_prev, prv), dist.P2POp(dist.irecv, from_next, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ctx.compare(from_prev, ctx.inp(prv, n, "float32", tag="n"), f"ring: from {prv}")
    ctx.compare(from_next, ctx.inp(nxt, n, "float32", tag="p"), f"ring: from {nxt}")


def c_barrier(ctx):
    """Every rank must have arrived before anyone leaves the barrier. The last
    rank arrives late; arrivals are recorded in the harness store."""
    W, r = ctx.world, ctx.rank
    for rnd in range(3):
        late = (W - 1 + rnd) % W
        if r == late:
            time.sleep(0.3)
        ctx.store.add(ctx.key(f"arrived{rnd}"), 1)
        dist.barrier()
        seen = ctx.store.add(ctx.key(f"arrived{rnd}"), 0)
        assert seen == W, f"round {rnd}: left the barrier after only {seen} of {W} " \
                          f"ranks had arrived (rank {late} was late)"


def c_objects(ctx):
    W, r = ctx.world, ctx.rank

    def obj(q):
        return {"rank": q, "data": list(range(q * 3)), "s": "x" * (q * 1000), "t": (q, None)}

    got = [None] * W
    dist.all_gather_object(got, obj(r))
    assert got == [obj(q) for q in range(W)], f"all_gather_object gave {got!r:.300}"
    src = W - 1
    lst = [obj(src), "hello", 3.5] if r == src else [None, None, None]
    dist.broadcast_object_list(lst, src=src)
    assert lst == [obj(src), "hello", 3.5], f"broadcast_object_list gave {lst!r:.300}"
    gl = [None] * W if r == 0 else None
    dist.gather_object(obj(r), gl, dst=0)
    if r == 0:
        assert gl == [obj(q) for q in range(W)], f"gather_object gave {gl!r:.300}"
    out = [None]
    dist.scatter_object_list(out, [obj(q + 10) for q in range(W)] if r == src else None,
                             src=src)
    assert out[0] == obj(r + 10), f"scatter_object_list gave {out[0]!r:.300}"
    if W >= 2:
        if r == 0:
            dist.send_object_list([obj(77), {"k": 1}], dst=1)
        elif r == 1:
            lst = [None, None]
            dist.recv_object_list(lst, src=0)
            assert lst == [obj(77), {"k": 1}], f"recv_object_list gave {lst!r:.300}"


SUBGROUPS = {  # per world size: the groups every rank creates (in this order)
    2: [[1], [1, 0], [0, 1]],
    3: [[0, 2], [2, 0], [1, 2]],
    4: [[1, 3], [0, 2], [2, 0], [0, 1, 3]],
}


def c_subgroups(ctx):
    """Ops on subgroups (members in any order; ranks keep their global ids),
    a rank outside the group, and groups used interleaved with each other."""
    W, r = ctx.world, ctx.rank
    specs = SUBGROUPS[W]
    groups = [dist.new_group(ranks) for ranks in specs]
    try:
        for gi, (ranks, g) in enumerate(zip(specs, groups)):
            members = sorted(ranks)
            tag = f"g{gi}"
            if r not in members:
                t = ctx.inp(r, 9, "float32", tag=tag)
                before = t.clone()
                ret = dist.all_reduce(t, group=g)
                assert ret is None, f"non-member all_reduce on {ranks} returned {ret!r}"
                ctx.compare(t, before, f"non-member tensor after all_reduce on {ranks}")
                assert dist.get_rank(g) == -1, f"get_rank on non-member group {ranks}"
                continue
            assert dist.get_world_size(g) == len(members)
            assert dist.get_rank(g) == members.index(r), \
                f"group rank of {r} in {ranks} is {dist.get_rank(g)}"
            t = ctx.inp(r, 1023, "float32", tag=tag)
            dist.all_reduce(t, group=g)
            ctx.check_reduction(t, [ctx.inp(q, 1023, "float32", tag=tag) for q in members],
                                "float32", "SUM", f"all_reduce on group {ranks}")
            src = members[-1]
            b = ctx.inp(src, 20, "int64", tag=tag) if r == src else ctx.garbage(20, "int64")
            dist.broadcast(b, src=src, group=g)
            ctx.compare(b, ctx.inp(src, 20, "int64", tag=tag), f"broadcast on {ranks}")
            out = ctx.garbage(len(members) * 7, "int32")
            _all_gather_tensor(out, ctx.inp(r, 7, "int32", tag=tag), group=g)
            ctx.compare(out, torch.cat([ctx.inp(q, 7, "int32", tag=tag) for q in members]),
                        f"all_gather_into_tensor on {ranks}")
            red = ctx.inp(r, 5, "int64", tag=tag + "r")
            dist.reduce(red, dst=members[0], op=dist.ReduceOp.MAX, group=g)
            if r == members[0]:
                ctx.compare(red, ref_reduce([ctx.inp(q, 5, "int64", tag=tag + "r")
                                             for q in members], "int64", "MAX"),
                            f"reduce on {ranks}")
            if len(members) >= 2:  # p2p inside the group, global ranks
                a, z = members[0], members[-1]
                if r == a:
                    dist.send(ctx.inp(a, 6, "float64", tag=tag), dst=z, group=g, tag=4)
                elif r == z:
                    buf = ctx.garbage(6, "float64")
                    dist.recv(buf, src=a, group=g, tag=4)
                    ctx.compare(buf, ctx.inp(a, 6, "float64", tag=tag), f"p2p on {ranks}")
            dist.barrier(group=g)

        # interleaved: async ops on every group this rank is in, plus the world
        pending = []
        for gi, (ranks, g) in enumerate(zip(specs, groups)):
            if r in ranks:
                t = ctx.inp(r, 300, "int64", tag=f"i{gi}")
                pending.append((sorted(ranks), gi, t, dist.all_reduce(t, group=g,
                                                                      async_op=True)))
            world_t = ctx.inp(r, 300, "int64", tag=f"w{gi}")
            pending.append((list(range(W)), f"w{gi}", world_t,
                            dist.all_reduce(world_t, async_op=True)))
        for members, gi, t, w in reversed(pending):
            w.wait()
            tag = f"i{gi}" if isinstance(gi, int) else gi
            ctx.compare(t, ref_reduce([ctx.inp(q, 300, "int64", tag=tag) for q in members],
                                      "int64", "SUM"), f"interleaved all_reduce {gi}")
    finally:
        for g in groups:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
    ctx.check_usable(what="after destroying the subgroups")


def c_subgroup_local_sync(ctx):
    """new_group(use_local_synchronization=True): only the members rendezvous."""
    W, r = ctx.world, ctx.rank
    members = [q for q in range(W) if q % 2 == 1] or [0]
    if r in members:
        g = dist.new_group(members, use_local_synchronization=True)
        t = ctx.inp(r, 11, "float64")
        dist.all_reduce(t, group=g, op=dist.ReduceOp.MIN)
        ctx.compare(t, ref_reduce([ctx.inp(q, 11, "float64") for q in members],
                                  "float64", "MIN"), f"all_reduce on local group {members}")
        dist.destroy_process_group(g)
    ctx.check_usable(what="after a member-only group")


def c_many_groups(ctx):
    """Two extra full-world groups used interleaved with the default group."""
    W, r = ctx.world, ctx.rank
    ga, gb = dist.new_group(list(range(W))), dist.new_group(list(range(W)))
    try:
        ta = [ctx.inp(r, 200, "float32", tag=f"a{k}") for k in range(3)]
        tb = [ctx.inp(r, 200, "float32", tag=f"b{k}") for k in range(3)]
        td = [ctx.inp(r, 200, "float32", tag=f"d{k}") for k in range(3)]
        works = []
        for k in range(3):
            works.append(dist.all_reduce(ta[k], group=ga, async_op=True))
            works.append(dist.all_reduce(td[k], async_op=True))
            works.append(dist.all_reduce(tb[k], group=gb, op=dist.ReduceOp.MAX,
                                         async_op=True))
        for w in works:
            w.wait()
        for k in range(3):
            for name, ts, op in (("a", ta, "SUM"), ("d", td, "SUM"), ("b", tb, "MAX")):
                ctx.check_reduction(ts[k], [ctx.inp(q, 200, "float32", tag=f"{name}{k}")
                                            for q in range(W)], "float32", op,
                                    f"group {name} op {k}")
    finally:
        dist.destroy_process_group(ga)
        dist.destroy_process_group(gb)


def c_sequence_and_name(ctx):
    pg = dist.distributed_c10d._get_default_group()
    assert dist.get_backend() == ctx.backend, f"get_backend() is {dist.get_backend()!r}"
    be = pg._get_backend(torch.device("cpu"))
    name = be.name() if callable(getattr(be, "name", None)) else None
    assert name == ctx.backend, f"backend name is {name!r}, expected {ctx.backend!r}"
    # Asked of the backend itself: torch 2.13's ProcessGroup wrapper refuses
    # sequence numbers for every custom backend before asking it.
    seq0 = be._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(3))
    dist.all_reduce(torch.ones(3))
    seq1 = be._get_sequence_number_for_group()
    assert seq1 > seq0, f"sequence number did not advance: {seq0} -> {seq1}"
    deltas = [None] * ctx.world
    dist.all_gather_object(deltas, seq1 - seq0)
    assert len(set(deltas)) == 1, \
        f"two all_reduces advanced the sequence number differently per rank: {deltas}"


def c_noncontig(ctx, op):
    """Non-contiguous tensors work (tccomm stages them through contiguous
    copies): correct results, and the memory around a strided view is left
    as it was."""
    W, r = ctx.world, ctx.rank
    base = ctx.inp(r, (64, 10), "float32")
    orig = base.clone()
    view = base[:, ::2]  # non-contiguous
    assert not view.is_contiguous()
    if op == "all_reduce":
        def run():
            dist.all_reduce(view)

        def check():
            ctx.check_reduction(view, [ctx.inp(q, (64, 10), "float32")[:, ::2]
                                       for q in range(W)], "float32", "SUM",
                                "all_reduce on a strided view")
            ctx.same_bits(base[:, 1::2], orig[:, 1::2], "memory between the strided elements")
    elif op == "broadcast":
        tview = base.t()

        def run():
            dist.broadcast(tview, src=W - 1)

        def check():
            ctx.same_bits(base, ctx.inp(W - 1, (64, 10), "float32"), "broadcast of a transpose")
    elif op == "all_gather":
        outs_base = [ctx.garbage((64, 10), "float32") for _ in range(W)]
        outs_orig = [o.clone() for o in outs_base]
        outs = [o[:, ::2] for o in outs_base]

        def run():
            dist.all_gather(outs, view)

        def check():
            for q in range(W):
                ctx.same_bits(outs[q], ctx.inp(q, (64, 10), "float32")[:, ::2],
                              f"all_gather strided output[{q}]")
                ctx.same_bits(outs_base[q][:, 1::2], outs_orig[q][:, 1::2],
                              "memory between the strided output elements")
    elif op == "all_gather_into_tensor":
        out = ctx.garbage(W * 64 * 5, "float32")

        def run():
            _all_gather_tensor(out, view)

        def check():
            exp = torch.cat([ctx.inp(q, (64, 10), "float32")[:, ::2].reshape(-1)
                             for q in range(W)])
            ctx.same_bits(out, exp, "all_gather_into_tensor of a strided input")
    elif op == "all_to_all_single":
        inp = ctx.inp(r, (10, 4 * W), "float32").t()  # (4W, 10), non-contiguous
        out = ctx.garbage((4 * W, 10), "float32")

        def run():
            dist.all_to_all_single(out, inp)

        def check():
            exp = torch.cat([ctx.inp(q, (10, 4 * W), "float32").t()[4 * r:4 * r + 4]
                             for q in range(W)])
            ctx.same_bits(out, exp, "all_to_all_single of a transposed input")
    else:
        raise ValueError(op)
    run()
    check()


def c_meta(ctx):
    """Meta tensors never reach a backend: torch's own meta kernels answer
    them. The call must return and leave the group untouched."""
    t = torch.empty(8, 3, device="meta")
    dist.all_reduce(t)
    outs = [torch.empty(8, 3, device="meta") for _ in range(ctx.world)]
    dist.all_gather(outs, t)
    assert t.shape == (8, 3) and t.device.type == "meta"
    ctx.check_usable(what="after ops on meta tensors")


def _shm_mappings() -> list[str]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/" in line or "memfd:" in line:
                out.append(line.split(None, 5)[-1].strip())
    return sorted(set(out))


def _socket_count() -> int:
    return len(_sockets())


def _sockets(exclude_port: int | None = None) -> list[str]:
    """This process's open sockets, as readable descriptions; sockets with
    `exclude_port` at either end are left out."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    desc = {}
    for table in ("tcp", "tcp6", "udp", "udp6", "unix", "netlink", "raw", "raw6", "packet"):
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            parts = row.split()
            if table in ("netlink", "raw", "raw6", "packet"):
                if parts and parts[-1] in inodes:
                    desc[parts[-1]] = f"{table} socket"
                continue
            if table == "unix":
                if len(parts) >= 7 and parts[6] in inodes:
                    desc[parts[6]] = "unix " + (parts[7] if len(parts) > 7 else "(anonymous)")
                continue
            if len(parts) > 9 and parts[9] in inodes:
                lport = int(parts[1].rsplit(":", 1)[1], 16)
                rport = int(parts[2].rsplit(":", 1)[1], 16)
                if exclude_port is not None and exclude_port in (lport, rport):
                    desc[parts[9]] = None
                else:
                    desc[parts[9]] = f"{table} port {lport} -> {rport} (state {parts[3]})"
    out = [desc.get(i, f"socket inode {i} (neither bound nor connected)") for i in sorted(inodes)]
    return sorted(d for d in out if d is not None)


def c_transport_in_use(ctx):
    """Shared memory is used by default on one host; TCCOMM_TRANSPORT=tcp
    must really avoid it (seen from this process's memory mappings)."""
    if not ctx.strict:
        raise Skip("checks tccomm's transport choice; not applicable to "
                   f"{ctx.backend}")
    t = torch.ones(4096)
    dist.all_reduce(t)
    maps = _shm_mappings()
    if ctx.transport == "shm":
        assert maps, ("TCCOMM_TRANSPORT is unset on a single host, but this process "
                      "maps no shared memory (/dev/shm or memfd): the shm transport "
                      "is not in use")
    else:
        assert not maps, f"TCCOMM_TRANSPORT=tcp, but shared memory is mapped: {maps}"


def c_reinit(ctx):
    """destroy_process_group(), then init_process_group again in this process."""
    W, r = ctx.world, ctx.rank
    dist.destroy_process_group()
    assert not dist.is_initialized(), "is_initialized() after destroy_process_group()"
    dist.init_process_group(ctx.backend, init_method=f"tcp://127.0.0.1:{ctx.cfg['reinit_port']}",
                            rank=r, world_size=W, timeout=ctx.timeout)
    assert dist.get_backend() == ctx.backend
    for k in range(2):
        t = ctx.inp(r, 1000, "float32", tag=k)
        dist.all_reduce(t)
        ctx.check_reduction(t, [ctx.inp(q, 1000, "float32", tag=k) for q in range(W)],
                            "float32", "SUM", f"all_reduce {k} after re-init")
    outs = [ctx.garbage(8, "int64") for _ in range(W)]
    dist.all_gather(outs, ctx.inp(r, 8, "int64"))
    for q in range(W):
        ctx.compare(outs[q], ctx.inp(q, 8, "int64"), f"all_gather[{q}] after re-init")


def c_destroy_releases(ctx):
    """destroy_process_group() releases the shared memory and the sockets: a
    fresh group (with a subgroup) is created, used and destroyed, and the
    process ends up with no more sockets than before it, and no shared memory."""
    W, r = ctx.world, ctx.rank
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    maps = _shm_mappings()
    assert not maps, f"shared memory still mapped after destroy_process_group(): {maps}"
    # torch itself keeps the rendezvous TCPStore alive once a subgroup exists
    # (gloo does the same): its sockets are not counted.
    port = ctx.cfg["reinit_port2"]
    before = _sockets(exclude_port=port)
    dist.init_process_group(ctx.backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=r, world_size=W, timeout=ctx.timeout)
    g = dist.new_group(list(range(W)))
    t = torch.ones(100)
    dist.all_reduce(t)
    dist.all_reduce(t, group=g)
    outs = [torch.zeros(100) for _ in range(W)]
    dist.all_gather(outs, t, group=g)
    ctx.compare(t, torch.full((100,), float(W * W)), "all_reduce on the fresh group")
    del outs, t
    dist.destroy_process_group()
    assert not dist.is_initialized()
    gc.collect()
    maps = _shm_mappings()
    assert not maps, f"shared memory still mapped after destroy_process_group(): {maps}"
    # Give closes done asynchronously (e.g. the TCPStore server's event loop) a moment.
    deadline = time.monotonic() + 3.0
    after = _sockets(exclude_port=port)
    while len(after) > len(before) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _sockets(exclude_port=port)
    new = sorted(set(after) - set(before))
    assert len(after) <= len(before), (f"{len(after) - len(before)} more open sockets "
                                       f"after a group was created and destroyed: {new}")


_KEEP_ALIVE: list = []


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
        g = torch.Generator().manual_seed(_seed(key, step, rank))
        x = torch.randn(8, in_dim, generator=g)
        y = torch.randn(8, out_dim, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


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
            _KEEP_ALIVE.append(ddp)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            runs[name] = train_steps(ddp, opt, 5, "ddp", r, 16)
        assert_same_params(ctx, runs["test"], runs["gloo"], None, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group(gloo)


def _register_features():
    S = "feat"
    add("async_work", S, c_async_work)
    add("all_reduce_coalesced", S, c_all_reduce_coalesced)
    add("all_gather_coalesced", S, c_all_gather_coalesced)
    add("coalescing_manager", S, c_coalescing_manager)
    add("p2p_tags", S, c_p2p_tags)
    add("p2p_all_pairs", S, c_p2p_all_pairs)
    add("batch_isend_irecv-n1000", S, c_batch_isend_irecv, n=1000)
    add(f"batch_isend_irecv-n{LARGE_PART}", S, c_batch_isend_irecv, n=LARGE_PART)
    add("barrier", S, c_barrier)
    add("objects", S, c_objects)
    add("subgroups", S, c_subgroups)
    # Runs late: torch's group counter diverges between members and non-members
    # after a member-only group, so later new_group() calls would not match up.
    add("subgroup_local_sync", S, c_subgroup_local_sync, order=80)
    add("meta_tensor_handled_by_torch", S, c_meta)
    add("many_groups_interleaved", S, c_many_groups)
    add("backend_name_and_sequence_number", S, c_sequence_and_name)
    for op in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_to_all_single"):
        gs = {"all_reduce": "gloo reduces the wrong memory of a strided view (half of "
                            "the elements come back unreduced)",
              "all_gather_into_tensor": "gloo refuses a non-contiguous input here "
                                        "(\"invalid tensor size\")",
              "all_to_all_single": "gloo refuses non-contiguous tensors here "
                                   "(\"Tensors must be contiguous\")"}.get(op)
        add(f"noncontiguous-{op}", S, c_noncontig, op=op, gloo_skip=gs)
    add("transport_in_use", S, c_transport_in_use)
    add("reinit_after_destroy", S, c_reinit, order=90)
    add("destroy_releases_resources", S, c_destroy_releases, order=99)
    add("ddp_matches_gloo", "ddp", c_ddp_matches_gloo,
        specs=("w2-shm-env", "w3-tcp-env", "w4-shm-tcpinit"))


_register_features()


# ==========================================================================
# bad input: must raise a clear error on every rank and leave the group usable
# ==========================================================================

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
    r = ctx.rank
    t = torch.ones(16)
    ctx.expect_error(lambda: dist.broadcast(t, src=0 if r == 0 else 1), OP_RE["broadcast"],
                     r"mismatch|disagree|differ|root|src",
                     "broadcast where rank 0 names root 0 and the others root 1")
    ctx.check_usable()


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
    ctx.expect_error(lambda: _all_gather_tensor(out, torch.ones(10)),
                     OP_RE["all_gather_into_tensor"],
                     r"size|numel|shape|element|count|length",
                     "all_gather_into_tensor with an output one element too long")
    ctx.check_usable()


def c_bad_rst_size(ctx):
    W = ctx.world
    out = torch.zeros(10)
    ctx.expect_error(lambda: _reduce_scatter_tensor(out, torch.ones(W * 10 - 1),
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


# ==========================================================================
# a peer that never arrives (own groups, created with timeout=2s)
# ==========================================================================


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


# Registers the functional / compile / parallelism cases (it imports this module).
import _cases_parallel  # noqa: E402,F401
import _cases_reliability  # noqa: E402,F401

import _cases_coverage  # noqa: E402,F401
