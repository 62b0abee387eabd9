"""pytest glue for the multi-process tests (see tests/_harness.py and tests/_group.py).

A test that reports a case of a spawned group takes a parameter `spec_case`
= (group, case). Each group also has a "teardown" pseudo-case (everything
after its last case); whatever -k or -m selected, exactly one teardown item
runs for every group that runs, and none for a group that does not.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _registry  # noqa: E402
from _messages import missing_parts_phrase  # noqa: E402
import _group  # noqa: E402
import _harness  # noqa: E402

# Summaries other tests want printed at the end (e.g. the C unit tests).
SUMMARIES: list[str] = []


def _spec_case(item):
    cs = getattr(item, "callspec", None)
    return cs.params["spec_case"] if cs is not None and "spec_case" in cs.params else None


def _is_teardown(item) -> bool:
    sc = _spec_case(item)
    return sc is not None and sc[1] == _harness.TEARDOWN


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(session, config, items):
    # Teardown items are kept out of -k / -m deselection: the teardown of a
    # group is part of every case run in it, so it is checked whenever the
    # group runs.
    teardowns = [it for it in items if _is_teardown(it)]
    items[:] = [it for it in items if not _is_teardown(it)]
    yield
    _remember_selected(items)
    _keep_one_teardown_per_group(config, items, teardowns)
    _mark_message_gaps(items)


def _remember_selected(items):
    """Remember which cases of which spec were selected, so that each spawned
    group runs exactly those (e.g. `pytest -k all_reduce` runs only them)."""
    for item in items:
        sc = _spec_case(item)
        if sc is not None:
            _harness.SELECTED.setdefault(sc[0], set()).add(sc[1])


# Groups whose teardown an item of this session reports.
REPORTED_TEARDOWNS: set = set()


def _keep_one_teardown_per_group(config, items, teardowns):
    """Puts back one teardown item per group that runs, right after the
    group's last selected case in the same module if it has one there.
    The others (the same group seen from another test file, or a group with
    no selected case) are reported as deselected."""
    last = {}  # group -> index of its last selected case item
    for i, item in enumerate(items):
        sc = _spec_case(item)
        if sc is not None:
            last[sc[0]] = i
    chosen = {}
    for td in teardowns:
        group = _spec_case(td)[0]
        if group not in last:
            continue
        if group not in chosen or td.module is items[last[group]].module:
            chosen[group] = td
    for group in sorted(chosen, key=lambda g: last[g], reverse=True):  # later indices first
        items.insert(last[group] + 1, chosen[group])
    REPORTED_TEARDOWNS.update(chosen)
    dropped = [td for td in teardowns if td not in chosen.values()]
    if dropped:
        config.hook.pytest_deselected(items=dropped)


class MessageGap(AssertionError):
    """A case failed exactly because tccomm's error lacks a known part (see
    Case.msg_gap in tests/_registry.py)."""


def _mark_message_gaps(items):
    """Known gaps in tccomm's error messages are expected failures, strictly:
    the case passing (the message fixed) fails the run until the gap is
    removed from the case's add(), and a failure for any other reason stays a
    failure (only MessageGap counts as the expected one)."""
    if _harness.BACKEND != "tccomm":  # the message checks apply to tccomm only
        return
    for item in items:
        sc = _spec_case(item)
        gap = _message_gap(*sc) if sc is not None else None
        if gap:
            item.add_marker(pytest.mark.xfail(reason=f"tccomm's error does not name {gap}",
                                              raises=MessageGap, strict=True))


@pytest.fixture(scope="session")
def groups():
    runner = _harness.Runner()
    pytest_runner_holder.append(runner)
    yield runner
    runner.close()


pytest_runner_holder: list = []


def check_case(groups, spec_case):
    """Reports the verdict on a case (or a teardown) of a spawned group;
    `groups` runs the groups and caches their results (.result(group, case))."""
    group, case = spec_case
    res = groups.result(group, case)
    if res.status == "skip":
        pytest.skip(res.msg)
    gap = _message_gap(group, case)
    if gap and _is_message_gap(res, gap):
        raise MessageGap(res.msg)
    if res.status == "pass" and group not in REPORTED_TEARDOWNS:
        # No item of this run reports the group's teardown (a run of explicit
        # node ids collects none): its cases carry that verdict instead.
        res = groups.result(group, _harness.TEARDOWN)
    if res.status != "pass":
        groups.keep = True
        pytest.fail(res.msg, pytrace=False)


def _message_gap(group, case):
    """The parts that the error expected by this case is known to lack."""
    cases = _registry.all_cases()
    if group not in _registry.SPEC_BY_NAME or case not in cases:
        return None
    return cases[case].msg_gap


def _is_message_gap(res, gap: str) -> bool:
    """Whether every rank failed on an error that lacks exactly `gap`."""
    phrase = missing_parts_phrase(gap)
    return bool(res.verdicts) and all(s == "fail" and phrase in m for s, m in res.verdicts)


def case_id(spec_case):
    return f"{spec_case[0]}:{spec_case[1]}"


def pytest_report_header(config):
    return (f"tccomm tests: backend under test = {_harness.BACKEND!r} "
            f"(TCCOMM_TEST_BACKEND), per-case hang limit {_group.CASE_TIMEOUT:.0f} s, "
            f"teardown limit {_group.teardown_timeout():.0f} s")


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
