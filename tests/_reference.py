"""Inputs, references and comparisons of the multi-process cases (no registry).

Every expected value is computed from deterministic per-rank inputs: the
input of rank ``r`` in case ``c`` is a pure function of ``(c, tag, r)``, so
each rank can recompute every other rank's input and derive the reference
with plain torch (integer references go through numpy int64 to get
well-defined wrap-around). Results are compared bit for bit wherever the
semantics make them exact (any NaN equals any NaN in a reduction; moved data
must keep its NaN payloads), otherwise within an elementwise rounding bound
(see compare()). Also used by the GPU scenarios (tests/_cuda_worker.py).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

# ---- dtypes, reduce ops and reference reductions ----------------------------

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
# Past a slot of the slot rings (64 KiB) but within what a ring holds
# (about 2 MiB): a rooted op's part over several slots, ending mid-slot.
SPAN_NUMEL = 100_003
# An all_reduce of MID_BYTES (and a few elements) is past what one exchange
# over streams carries with its descriptors, and every rank's chunk still
# fits a frame: over TCP its reduce-scatter travels with the descriptors.
MID_BYTES = 96 << 10


def mid_numel(dtype: str) -> int:
    return MID_BYTES // torch.empty((), dtype=tdtype(dtype)).element_size() + 3


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


def _fold(ys: list, combine, blocks, copy) -> object:
    """Combines ys in the order `blocks` gives: each block's members in
    their order, then the blocks' partial results in block order (None: one
    block, 0..n-1). The result is a new array (`copy` makes one)."""
    if blocks is None:
        blocks = [range(len(ys))]
    partials = []
    for block in blocks:
        acc = copy(ys[block[0]])
        for q in block[1:]:
            acc = combine(acc, ys[q])
        partials.append(acc)
    acc = partials[0]
    for p in partials[1:]:
        acc = combine(acc, p)
    return acc


def _combine_bool(redop: str):
    if redop in ("SUM", "MAX", "BOR"):
        return lambda a, b: a | b
    if redop in ("PRODUCT", "MIN", "BAND"):
        return lambda a, b: a & b
    if redop == "BXOR":
        return lambda a, b: a ^ b
    raise ValueError(redop)


def _combine_int(redop: str):  # numpy int64 arrays wrap modulo 2**64
    ops = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum,
           "MAX": np.maximum, "BAND": np.bitwise_and, "BOR": np.bitwise_or,
           "BXOR": np.bitwise_xor}
    if redop not in ops:
        raise ValueError(redop)
    return ops[redop]


def _combine_float(redop: str):
    if redop in ("SUM", "AVG", "PREMUL_SUM"):
        return lambda a, b: a + b
    if redop == "PRODUCT":
        return lambda a, b: a * b
    if redop in ("MIN", "MAX"):
        # A NaN wins from wherever it comes; on a tie (+0 vs -0) the first
        # operand (the lower ranks' value) stays. (torch.minimum/maximum also
        # propagate NaN but return the second operand on a +0/-0 tie.)
        def pick(a, b):
            better = b < a if redop == "MIN" else b > a
            return torch.where(better | torch.isnan(b), b, a)
        return pick
    raise ValueError(redop)


def ref_reduce(xs: list[torch.Tensor], dtype: str, redop: str,
               accumulate: str | None = None, blocks: list[list[int]] | None = None) -> torch.Tensor:
    """Reduce xs in rank order 0..n-1 the way tccomm specifies it (floats:
    PREMUL_SUM's factor applied to each input, sums in rank order, AVG's
    division in the accumulation type, one rounding to `dtype` at the end).
    `accumulate` overrides the accumulation type of float16/bfloat16 (to
    model a backend that rounds every step). `blocks` (positions in xs)
    reduces block by block instead, then the blocks' results in block order:
    the order of a hierarchical reduction (each host's ranks, then hosts)."""
    n = len(xs)
    dt = tdtype(dtype)
    if dtype == "bool":
        return _fold(xs, _combine_bool(redop), blocks, torch.clone)
    if dtype in INTS:
        acc = _fold([x.to(torch.int64).numpy() for x in xs], _combine_int(redop), blocks, np.copy)
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
    acc = _fold(ys, _combine_float(redop), blocks, torch.clone)
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


def seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def make_input(key, rank: int, shape, dtype: str, kind: str = "any") -> torch.Tensor:
    """Deterministic input of `rank` for `key` (any rank can recompute it)."""
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator().manual_seed(seed(key, rank))
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
    g = torch.Generator().manual_seed(seed(key, rank, "special"))
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


def mismatch_report(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor,
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
                             f"{mismatch_report(actual, expected, bad, bits)}")
