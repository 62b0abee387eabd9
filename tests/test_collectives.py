"""Every collective x dtype x reduce op (and sizes 0, 1, odd, large) in real
process groups of 2, 3 and 4 ranks over shared memory and forced TCP, each
result checked against a reference computed with plain torch.

The cases themselves live in tests/_cases_collectives.py (suite "coll"); one spawned
group per spec runs all of them (tests/_harness.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("coll"), ids=case_id)
def test_collective(groups, spec_case):
    check_case(groups, spec_case)
