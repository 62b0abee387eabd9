"""Functional collectives (torch.ops._c10d_functional, funcol) on tccomm.

Multi-process cases (suite "funcol" in tests/_cases_parallel.py): every op
against references, on tccomm and on a gloo group in the same processes,
counting which ops tccomm's fast path served. Single-process tests below:
the object form of the group argument, and TCCOMM_FUNCOL_FASTPATH=0.
"""

import os
import subprocess
import sys

import pytest

import _registry
from conftest import case_id, check_case

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("spec_case", _registry.params_for("funcol"), ids=case_id)
def test_funcol(groups, spec_case):
    check_case(groups, spec_case)


SCRIPT = r"""
import os, tempfile, torch, torch.distributed as dist
import torchcomm_backend  # registers the backend (its entry point does too, once installed)
ops = torch.ops._c10d_functional
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("tccomm", store=store, rank=0, world_size=1)
gloo = dist.new_group([0], backend="gloo")
calls = torch.ops.tccomm.functional_fast_path_calls
for group in (dist.group.WORLD, gloo):
    for form in (group.group_name, group):  # a name or the ProcessGroup object
        x = torch.arange(6.0)
        before = calls()
        y = ops.wait_tensor(ops.all_reduce(x, "sum", form))
        z = ops.wait_tensor(ops.all_gather_into_tensor(x.view(2, 3), 1, form))
        assert torch.equal(y, x) and torch.equal(z, x.view(2, 3)), (y, z)
        print(dist.get_backend(group), type(form).__name__, calls() - before)
dist.destroy_process_group()
"""


def _run(fastpath: str) -> dict:
    env = dict(os.environ, TCCOMM_FUNCOL_FASTPATH=fastpath)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = {}
    for line in out.stdout.splitlines():
        backend, form, n = line.split()
        counts[(backend, form)] = int(n)
    return counts


def test_fast_path_serves_tccomm_groups_only():
    counts = _run("1")
    assert counts[("tccomm", "str")] == 2, counts
    assert counts[("tccomm", "ProcessGroup")] == 2, counts
    assert counts[("gloo", "str")] == 0 and counts[("gloo", "ProcessGroup")] == 0, counts


def test_fast_path_off_by_environment():
    counts = _run("0")
    assert set(counts.values()) == {0}, counts
    assert len(counts) == 4, counts
