"""Paths users hit beyond the per-op matrix: 8 ranks, dozens of groups,
threads, fork after init, DDP's optional paths and tensors over 2**31
bytes and elements (suite "coverage", reported by tests/test_coverage.py).

The groups these cases run in are their own specs (kind "coverage" and
"huge"), so none of them adds to the time or the state of the main specs:

  w8-shm-env-coverage, w8-tcp-file-coverage   every collective kind at 8 ranks
  w4-shm-tcpinit-coverage, w3-tcp-env-coverage many groups, threads, fork, DDP
  w2-shm-env-huge, w2-tcp-env-huge             tensors over 2**31 bytes / elements

The cases themselves live in _cases_scale.py, _cases_concurrency.py and
_cases_ddp_paths.py; importing this module (done at the end of _cases.py)
registers the specs and the cases.
"""

from __future__ import annotations

from _cases import SPEC_BY_NAME, SPECS, Spec

SUITE = "coverage"

W8_SPECS = ("w8-shm-env-coverage", "w8-tcp-file-coverage")
GROUP_SPECS = ("w4-shm-tcpinit-coverage", "w3-tcp-env-coverage")
HUGE_SPECS = ("w2-shm-env-huge", "w2-tcp-env-huge")

_NEW_SPECS = [
    Spec("w8-shm-env-coverage", 8, "shm", "env", kind="coverage"),
    Spec("w8-tcp-file-coverage", 8, "tcp", "file", kind="coverage"),
    Spec("w4-shm-tcpinit-coverage", 4, "shm", "tcp", kind="coverage"),
    Spec("w3-tcp-env-coverage", 3, "tcp", "env", kind="coverage"),
    # A 2 GiB all_reduce on a loaded 2-core machine may take tens of seconds:
    # the group timeout is not what these cases test.
    Spec("w2-shm-env-huge", 2, "shm", "env", kind="huge", pg_timeout=600.0),
    Spec("w2-tcp-env-huge", 2, "tcp", "env", kind="huge", pg_timeout=600.0),
]
for _spec in _NEW_SPECS:
    if _spec.name not in SPEC_BY_NAME:  # idempotent if imported again
        SPECS.append(_spec)
        SPEC_BY_NAME[_spec.name] = _spec

import _cases_concurrency  # noqa: E402,F401
import _cases_ddp_paths  # noqa: E402,F401
import _cases_scale  # noqa: E402,F401
