"""DistributedDataParallel: 5 training steps on the backend under test end
with the same parameters as the same run on gloo, in the same processes
(world sizes 2, 3 and 4; case "ddp_matches_gloo" in tests/_cases_ddp.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("ddp"), ids=case_id)
def test_ddp_matches_gloo(groups, spec_case):
    check_case(groups, spec_case)
