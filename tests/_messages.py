"""What an expected error of tccomm must name, as regular expressions: the
op (under any of its names), the group, the rank and the cause
(Ctx.expect_error in tests/_ctx.py checks them)."""

from __future__ import annotations

import re

import torch.distributed as dist

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


def op_re(*names: str) -> str:
    """Any of `names` as a whole name: "reduce" matches neither "allreduce" nor
    "reduce_scatter" nor "_reduce_scatter_base"."""
    return rf"(?<![A-Za-z0-9_])(?:{'|'.join(map(re.escape, names))})(?![A-Za-z0-9_])"


# Each op under the names tccomm's messages use for it: torch.distributed's
# function, the c10d Backend method torch calls, and the C core's op.
OP_RE = {
    "all_reduce": op_re("all_reduce", "allreduce"),
    "reduce": op_re("reduce"),
    "broadcast": op_re("broadcast"),
    "reduce_scatter": op_re("reduce_scatter"),
    "reduce_scatter_tensor": op_re("reduce_scatter_tensor", "_reduce_scatter_base",
                                    "reduce_scatter"),
    "all_gather": op_re("all_gather", "allgather"),
    "all_gather_into_tensor": op_re("all_gather_into_tensor", "_allgather_base", "allgather"),
    "gather": op_re("gather"),
    "scatter": op_re("scatter"),
    "all_to_all_single": op_re("all_to_all_single", "alltoall_base", "alltoall"),
    "send": op_re("send"),
    "recv": op_re("recv"),
    "barrier": op_re("barrier"),
}

# A known gap in what an expected error names (Case.msg_gap): such a case is
# a strict expected failure until the message names it. None is known today;
# the harness self-check uses this one.
NO_GROUP_NO_RANK = "the group and the rank"


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


def join_and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def missing_parts_phrase(parts: str) -> str:
    """How Ctx.expect_error starts its failure when the error lacks `parts`
    (conftest.py recognises known gaps, Case.msg_gap, by it)."""
    return f"the error does not name {parts} ("
