"""Off the happy path: DDP communication hooks (PowerSGD and torch's other
hooks) against gloo, future continuations that wait on later ops of the same
group, Work.wait(timeout) with a late peer, receiving from any source
(suite "reliability" in tests/_cases_reliability.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("reliability"), ids=case_id)
def test_reliability(groups, spec_case):
    check_case(groups, spec_case)
