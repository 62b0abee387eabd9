"""Options of the TorchComm-style API: reduce ops, timeouts, the abort policy
and hints. Pure Python, no communication."""

import datetime
import os
import warnings

import torch.distributed as dist

DEFAULT_TIMEOUT_SECONDS = 600.0
HINT_PREFIX = "torchcomm::tccomm::"

# Hints tccomm understands, with the values each accepts.
# transport: how the ranks of a new communicator talk ("auto": shared memory
# when every rank is on one host, else TCP; TCCOMM_TRANSPORT still applies).
COMM_HINTS = {HINT_PREFIX + "transport": ("auto", "shm", "tcp")}
# None yet: every per-op setting is an argument (timeout) or automatic.
OP_HINTS: dict = {}


class ReduceOp:
    """Reduction of all_reduce, reduce, reduce_scatter(_single).

    ReduceOp.SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG, and
    ReduceOp.PREMUL_SUM(factor): every input multiplied by factor, then summed.
    """

    __slots__ = ("name", "factor")

    def __init__(self, name, factor=None):
        self.name = name
        self.factor = factor

    def __repr__(self):
        if self.name == "PREMUL_SUM":
            return f"ReduceOp.PREMUL_SUM({self.factor})"
        return f"ReduceOp.{self.name}"

    def __eq__(self, other):
        return isinstance(other, ReduceOp) and (other.name, other.factor) == (self.name, self.factor)

    def __hash__(self):
        return hash((self.name, self.factor))

    @staticmethod
    def PREMUL_SUM(factor):  # noqa: N802  (the reference's name)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"tccomm: ReduceOp.PREMUL_SUM takes a number as its factor, got {factor!r}")
        return ReduceOp("PREMUL_SUM", float(factor))


for _name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"):
    setattr(ReduceOp, _name, ReduceOp(_name))


def to_c10d_op(op, what):
    """The torch.distributed reduce op for a ReduceOp (c10d ones pass through)."""
    if isinstance(op, dist.ReduceOp):
        return op
    if op is ReduceOp.PREMUL_SUM:
        raise TypeError(f"tccomm: {what}: ReduceOp.PREMUL_SUM needs its factor: "
                        "pass ReduceOp.PREMUL_SUM(factor)")
    if not isinstance(op, ReduceOp):
        raise TypeError(f"tccomm: {what}: expected a ReduceOp, got {op!r}")
    if op.name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(op.factor)
    return getattr(dist.ReduceOp, op.name)


def as_timedelta(timeout, what):
    """timeout (timedelta or seconds) as a positive timedelta; None stays None."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        td = datetime.timedelta(seconds=timeout)
    else:
        raise TypeError(f"tccomm: {what}: timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if td.total_seconds() <= 0:
        raise ValueError(f"tccomm: {what}: timeout must be positive, got {td}")
    return td


def default_timeout():
    raw = os.environ.get("TORCHCOMM_TIMEOUT_SECONDS")
    if raw is None or raw == "":
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_SECONDS)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"tccomm: TORCHCOMM_TIMEOUT_SECONDS must be a positive number of seconds, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def default_abort():
    raw = os.environ.get("TORCHCOMM_ABORT_ON_ERROR")
    if raw is None or raw == "":
        return True
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"tccomm: TORCHCOMM_ABORT_ON_ERROR must be true or false, got {raw!r}")


def check_hints(hints, known, what):
    """Validates hints; returns {key: value} of the known ones.

    A key in tccomm's namespace that tccomm does not know, or a known key with
    a bad value, raises ValueError (a typo must not go unnoticed). Keys of
    other backends or without a namespace are ignored with a warning, so code
    written for another backend runs unchanged.
    """
    if hints is None:
        return {}
    if not isinstance(hints, dict):
        raise TypeError(f"tccomm: {what}: hints must be a dict of str to str, got {type(hints).__name__}")
    taken = {}
    for key, value in hints.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"tccomm: {what}: hints must map str to str, got {key!r}: {value!r}")
        if key in known:
            if value not in known[key]:
                raise ValueError(f"tccomm: {what}: hint {key!r} must be one of {list(known[key])}, got {value!r}")
            taken[key] = value
        elif key.startswith(HINT_PREFIX):
            raise ValueError(f"tccomm: {what}: unknown tccomm hint {key!r}; "
                             f"known here: {sorted(known) or 'none'}")
        else:
            warnings.warn(f"tccomm: {what}: hint {key!r} is not a tccomm hint and is ignored",
                          UserWarning, stacklevel=4)
    return taken
