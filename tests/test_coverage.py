"""Paths users hit beyond the per-op matrix (suite "coverage", cases in
tests/_cases_scale.py, _cases_concurrency.py and _cases_ddp_paths.py, specs
in tests/_cases_coverage.py): every collective kind at 8 ranks on shared
memory and TCP; 40 groups alive at once, then released; groups used from
several threads; DataLoader workers forked after init; DDP's no_sync,
find_unused_parameters, static_graph and Join paths against gloo; tensors
over 2**31 bytes and 2**31 elements (TCCOMM_TEST_HUGE=0 skips those,
TCCOMM_TEST_HUGE=all runs all of them over TCP too)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("coverage"), ids=case_id)
def test_coverage(groups, spec_case):
    check_case(groups, spec_case)
