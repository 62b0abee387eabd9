"""Paths users hit beyond the per-op matrix: 8 ranks, dozens of groups,
threads, fork after init, DDP's optional paths and tensors over 2**31
bytes and elements (suite "coverage", reported by tests/test_coverage.py).

The groups these cases run in are their own specs (kind "coverage" and
"huge"), so none of them adds to the time or the state of the main specs:

  w8-shm-env-coverage, w8-tcp-file-coverage   every collective kind at 8 ranks
  w4-shm-tcpinit-coverage, w3-tcp-env-coverage many groups, threads, fork, DDP
  w2-shm-env-huge, w2-tcp-env-huge             tensors over 2**31 bytes / elements

The cases themselves live in _cases_scale.py, _cases_concurrency.py and
_cases_ddp_paths.py; this module only names the suite and its groups.
"""

SUITE = "coverage"

# Their specs are in tests/_registry.py (kinds "coverage" and "huge").
W8_SPECS = ("w8-shm-env-coverage", "w8-tcp-file-coverage")
GROUP_SPECS = ("w4-shm-tcpinit-coverage", "w3-tcp-env-coverage")
HUGE_SPECS = ("w2-shm-env-huge", "w2-tcp-env-huge")
