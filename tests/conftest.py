"""pytest glue for the multi-process tests (see tests/_harness.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness  # noqa: E402

# Summaries other tests want printed at the end (e.g. the C unit tests).
SUMMARIES: list[str] = []


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(session, config, items):
    """Remember which cases of which spec were selected, so that each spawned
    group runs exactly those (e.g. `pytest -k all_reduce` runs only them)."""
    for item in items:
        cs = getattr(item, "callspec", None)
        if cs is not None and "spec_case" in cs.params:
            spec, case = cs.params["spec_case"]
            _harness.SELECTED.setdefault(spec, set()).add(case)


@pytest.fixture(scope="session")
def groups():
    runner = _harness.Runner()
    pytest_runner_holder.append(runner)
    yield runner
    runner.close()


pytest_runner_holder: list = []


def check_case(groups, spec_case):
    spec, case = spec_case
    res = groups.result(spec, case)
    if res.status == "skip":
        pytest.skip(res.msg)
    if res.status != "pass":
        pytest.fail(res.msg, pytrace=False)


def case_id(spec_case):
    return f"{spec_case[0]}:{spec_case[1]}"


def pytest_report_header(config):
    return (f"tccomm tests: backend under test = {_harness.BACKEND!r} "
            f"(TCCOMM_TEST_BACKEND), per-case hang limit {_harness.CASE_TIMEOUT:.0f} s")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    for runner in pytest_runner_holder:
        if runner.timings:
            tr.section("tccomm process groups")
            for spec, (secs, ncases, attempts) in runner.timings.items():
                extra = f", restarted {attempts - 1}x" if attempts > 1 else ""
                tr.write_line(f"{spec:22s} {ncases:4d} cases in {secs:6.1f} s{extra}")
            if runner.keep:
                tr.write_line(f"logs of the spawned ranks kept in {runner.workdir}")
    for s in SUMMARIES:
        tr.section("C core unit tests")
        tr.write_line(s)
