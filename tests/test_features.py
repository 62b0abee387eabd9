"""Async work handles, coalesced ops, point-to-point with tags,
batch_isend_irecv, barrier, object collectives, subgroups (members only,
reversed order, non-members, interleaved groups), non-contiguous tensors,
the transport actually used, destroy + re-init in the same process, and
resource release (suite "feat" in tests/_cases_features.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("feat"), ids=case_id)
def test_feature(groups, spec_case):
    check_case(groups, spec_case)
