"""Bad input must raise a clear error (naming the op and the cause) on every
rank, never hang or crash, and leave the group usable; a peer that never
arrives must raise after the group's timeout naming the op, the group and the
missing rank, with the process staying alive (suites "err" and "timeout" in
tests/_cases_bad_input.py and tests/_cases_timeout.py)."""

import pytest

import _registry
from conftest import case_id, check_case


@pytest.mark.parametrize("spec_case", _registry.params_for("err"), ids=case_id)
def test_bad_input(groups, spec_case):
    check_case(groups, spec_case)


@pytest.mark.parametrize("spec_case", _registry.params_for("timeout"), ids=case_id)
def test_peer_never_arrives(groups, spec_case):
    check_case(groups, spec_case)
