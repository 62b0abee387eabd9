"""torch.compile(fullgraph=True) of functional collectives and of a small
tensor-parallel MLP on tccomm: no graph break, compiled == eager, and the
compiled code calls into tccomm (suite "compile" in tests/_cases_parallel.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("compile"), ids=case_id)
def test_compile(groups, spec_case):
    check_case(groups, spec_case)
