"""PyTorch's parallelism stack on tccomm: DeviceMesh, backend splitting,
FSDP2 (1-D and 2x2 meshes) and DTensor tensor parallelism, each training run
ending with the same parameters as on gloo (suite "parallel" in
tests/_cases_parallel.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("parallel"), ids=case_id)
def test_parallel(groups, spec_case):
    check_case(groups, spec_case)
