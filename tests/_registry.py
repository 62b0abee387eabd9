"""The registry of the multi-process cases: the groups (specs: world size x
transport x init method), the cases and which group runs which.

A case is a function ``fn(ctx, **params)`` (ctx: tests/_ctx.py) run on every
rank of a group. It passes by returning, fails by raising AssertionError (any
other exception is reported as an error with its traceback) and skips by
raising Skip. The suites of cases live in the modules of SUITE_MODULES; each
registers its cases with add() when imported, and all_cases() imports them.

The registry is built twice: by pytest (to turn every case into a test id)
and by each worker process (tests/_worker.py) to run the cases. It must come
out the same in both, so everything here and in the suites is deterministic.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

# The suites, imported by all_cases() in this order: the order in which a
# group runs its cases (among cases of the same Case.order).
SUITE_MODULES = (
    "_cases_collectives", "_cases_features", "_cases_ddp", "_cases_bad_input",
    "_cases_timeout", "_cases_parallel", "_cases_reliability",
    "_cases_concurrency", "_cases_ddp_paths", "_cases_scale",  # suite "coverage"
)


class Skip(Exception):
    """Raised by a case that does not apply; the message is the reason."""


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
    transport: str  # "shm" (default: TCCOMM_TRANSPORT unset), "tcp" (forced) or
                    # "hybrid" (TCCOMM_TRANSPORT unset, ranks on simulated hosts)
    init: str       # "env", "tcp" or "file"
    kind: str = "main"
    pg_timeout: float = 30.0
    env: tuple = ()  # (name, value) pairs set in every rank's environment
    hosts: tuple = ()  # the simulated host of each rank (TCCOMM_HOSTID), for "hybrid"


SPECS = [
    Spec("w2-shm-env", 2, "shm", "env"),
    Spec("w2-tcp-tcpinit", 2, "tcp", "tcp"),
    # Data movement through the staging windows, as where the kernel forbids
    # single-copy reads (w2-shm-env and w3-shm-env-direct read their peers
    # directly; groups with more ranks than this machine's 2 CPUs stage by
    # default).
    Spec("w3-shm-file-nocma", 3, "shm", "file", env=(("TCCOMM_CMA", "0"),)),
    Spec("w3-tcp-env", 3, "tcp", "env"),
    Spec("w4-shm-tcpinit", 4, "shm", "tcp"),
    Spec("w4-tcp-file", 4, "tcp", "file"),
    # Groups that span hosts, simulated on this one (TCCOMM_HOSTID): shared
    # memory within a host, TCP between, the hierarchical algorithms. Two
    # hosts of 2 ranks each (reduce-scatter by shards), and an uneven,
    # interleaved pair of hosts, ranks {0, 2} and {1} (reduce to leaders).
    Spec("w4-hybrid-env", 4, "hybrid", "env", hosts=(0, 0, 1, 1)),
    Spec("w3-hybrid-tcpinit", 3, "hybrid", "tcp", hosts=(0, 1, 0)),
    # Groups whose only purpose is a peer that never arrives (unusable afterwards).
    Spec("w3-shm-env-timeout", 3, "shm", "env", kind="timeout", pg_timeout=2.0),
    Spec("w2-tcp-env-timeout", 2, "tcp", "env", kind="timeout", pg_timeout=2.0),
    # torch.compile and the parallelism stack (tests/_cases_parallel.py).
    Spec("w2-shm-env-parallel", 2, "shm", "env", kind="parallel"),
    Spec("w4-tcp-env-parallel", 4, "tcp", "env", kind="parallel"),
    # DDP is in the main suites; here FSDP2, DTensor and 2 x 2 meshes whose
    # inner dimension is within a host.
    Spec("w4-hybrid-env-parallel", 4, "hybrid", "env", kind="parallel", hosts=(0, 0, 1, 1)),
    # The paths beyond the per-op matrix (tests/_cases_coverage.py), in groups
    # of their own so that none adds to the time or the state of the others.
    Spec("w8-shm-env-coverage", 8, "shm", "env", kind="coverage"),
    Spec("w8-tcp-file-coverage", 8, "tcp", "file", kind="coverage"),
    Spec("w4-shm-tcpinit-coverage", 4, "shm", "tcp", kind="coverage"),
    Spec("w3-tcp-env-coverage", 3, "tcp", "env", kind="coverage"),
    # A 2 GiB all_reduce on a loaded 2-core machine may take tens of seconds:
    # the group timeout is not what these cases test.
    Spec("w2-shm-env-huge", 2, "shm", "env", kind="huge", pg_timeout=600.0),
    Spec("w2-tcp-env-huge", 2, "tcp", "env", kind="huge", pg_timeout=600.0),
    # Small rooted ops go over the slot rings by default: the per-op matrix
    # (suite "coll") again with them off, over the staging windows.
    Spec("w3-shm-env-noslots", 3, "shm", "env", kind="noslots",
         env=(("TCCOMM_SHM_SLOT_BYTES", "0"),)),
    # With more ranks than CPUs data movement is staged by default: the
    # per-op matrix again with single-copy reads from 16 KiB.
    Spec("w3-shm-env-direct", 3, "shm", "env", kind="direct",
         env=(("TCCOMM_SHM_DIRECT_BYTES", "16384"),)),
    # A disagreement on a small rooted op fails its group: a group of its own.
    Spec("w3-shm-env-slots", 3, "shm", "env", kind="slots"),
    # The same over TCP, where a small rooted op's senders do not wait.
    Spec("w3-tcp-env-onesided", 3, "tcp", "env", kind="onesided"),
]
SPEC_BY_NAME = {s.name: s for s in SPECS}


def all_cases() -> dict[str, Case]:
    """REGISTRY with the cases of every suite (their modules imported once)."""
    for module in SUITE_MODULES:
        importlib.import_module(module)
    return REGISTRY


def cases_for(spec: Spec, suite: str | None = None) -> list[Case]:
    out = []
    for c in all_cases().values():
        if suite is not None and c.suite != suite:
            continue
        if c.specs is None:
            if spec.kind != "main" and not (spec.kind in ("noslots", "direct") and c.suite == "coll"):
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
