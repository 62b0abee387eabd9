"""The harness's own checks can fail.

Its runners (tests/_harness.py for the specs, tests/test_torchcomm_api.py
for the TorchComm-API groups) run a 2-rank group with one case whose rank 1
misbehaves on purpose (TCCOMM_TEST_FAULT, tests/_rank.py), and must report
the failure with its reason and the rank; a group without a fault must pass.
The group watch they and the CUDA scenarios share (tests/_group.py) kills a
rank that hangs in a case, with its stack in the log, and the others when a
rank dies; the CUDA runner fails a scenario that fails on its ranks (no GPU
needed). The error-message checks of tests/_ctx.py reject a message that
lacks any part, and only a known gap in a message counts as its expected
failure. The test helpers and the package import each other without a cycle."""

import ast
import os
import pathlib
import re
import shutil
import signal

import pytest
import torch.distributed as dist

import _ctx
import _group
import _harness
import _messages
import _registry
import _rank
import test_cuda as cuda_api
import test_torchcomm_api as tc_api
from conftest import MessageGap, check_case

SPEC, CASE = "w2-shm-env", "barrier"
TC_CASE = "rank_and_size"
TEARDOWN = _harness.TEARDOWN

# fault -> (the pseudo-case or case that must fail, what its message must say)
EXPECTED = {
    "skip-on-rank1": ("case", ["the ranks' verdicts differ", "rank 0 [pass]", "rank 1 [skip]"]),
    "no-done": (TEARDOWN, ["rank 1 never reported 'done'", "exit code 0"]),
    "segv-after-done": (TEARDOWN, ["rank 1 killed by SIGSEGV in teardown step \"after 'done'\""]),
    "exit3-after-done": (TEARDOWN, ["rank 1 exit code 3 in teardown step \"after 'done'\""]),
    "segv-at-exit": (TEARDOWN, ["rank 1 killed by SIGSEGV in teardown step 'interpreter exit'",
                                "Segmentation fault"]),
    "hang-at-exit": (TEARDOWN, ["teardown hung: ranks [1]", "'interpreter exit'",
                                "rank 1 killed by SIGKILL", "in _shutdown"]),  # its stack
}
TEARDOWN_LIMIT = "3"  # s: hang-at-exit takes about this long


def _spec_results(monkeypatch, fault):
    monkeypatch.setenv(_rank.FAULT_ENV, fault)
    monkeypatch.setenv("TCCOMM_TEST_TEARDOWN_TIMEOUT", TEARDOWN_LIMIT)
    runner = _harness.Runner(selected={SPEC: {CASE}})
    try:
        return {"case": runner.result(SPEC, CASE), TEARDOWN: runner.result(SPEC, TEARDOWN)}
    finally:
        runner.close()


def _tc_results(monkeypatch, fault):
    monkeypatch.setenv(_rank.FAULT_ENV, fault)
    monkeypatch.setenv("TCCOMM_TEST_TEARDOWN_TIMEOUT", TEARDOWN_LIMIT)
    groups = tc_api.Groups(cases=[TC_CASE])
    try:
        group = tc_api.group_key(2)
        return {"case": groups.result(group, TC_CASE), TEARDOWN: groups.result(group, TEARDOWN)}
    finally:
        shutil.rmtree(groups.dir, ignore_errors=True)


def _check(results, fault):
    if not fault:
        for what, res in results.items():
            assert res.status == "pass", f"{what} without a fault: {res.status}: {res.msg}"
        return
    what, needles = EXPECTED[fault]
    res = results[what]
    assert res.status == "fail", f"{fault}: {what} was reported as {res.status!r}: {res.msg}"
    missing = [n for n in needles if n not in res.msg]
    assert not missing, f"{fault}: the failure of {what} does not say {missing}:\n{res.msg}"
    other = "case" if what == TEARDOWN else TEARDOWN
    assert results[other].status == "pass", \
        f"{fault} should fail only the {what}, but {other}: {results[other].msg}"


def test_every_fault_is_checked():
    assert sorted(EXPECTED) == sorted(_rank.FAULTS)


@pytest.mark.parametrize("fault", [""] + list(EXPECTED))
def test_spec_runner_reports(monkeypatch, fault):
    _check(_spec_results(monkeypatch, fault), fault)


# The TorchComm runner shares the deciding code; these show that its worker
# and runner are wired to it (a verdict merge, a crash and a hang after the
# last case, and no false alarm).
@pytest.mark.parametrize("fault", ["", "skip-on-rank1", "segv-at-exit", "hang-at-exit", "no-done"])
def test_torchcomm_runner_reports(monkeypatch, fault):
    _check(_tc_results(monkeypatch, fault), fault)


# The group watch itself (tests/_group.py), as every suite uses it: a rank
# that hangs or dies inside a case. The CUDA scenarios rely on exactly this
# (one long case per rank, no teardown check); the specs and the TorchComm
# groups hit it whenever a case hangs or crashes.
RANK_SCRIPT = """
import os, signal, sys, time
import _rank
_rank.enable_stack_dumps()
events = _rank.Events(sys.argv[1], int(sys.argv[2]))
events.emit(event="start", case="c", t=time.time())

def stuck_in_case():
    time.sleep(600)

what = os.environ["RANK_DOES"]
if what == "hang":
    stuck_in_case()
elif what == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
elif what == "wait":
    time.sleep(600)
events.emit(event="result", case="c", status="pass", msg="")
"""


def _watched_group(tmp_path, does, case_limit=2.0):
    """A group whose rank R does does[R] in case "c"; its Run."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = lambda rank: {**os.environ, "PYTHONPATH": _group.HERE, "RANK_DOES": does[rank]}  # noqa: E731
    group = _group.spawn(str(tmp_path), len(does), lambda rank: [str(script), str(tmp_path), str(rank)], env)
    return _group.watch(group, case_limit=lambda case: case_limit)


def test_group_watch_kills_a_hung_case_with_its_stack(tmp_path):
    run = _watched_group(tmp_path, ["pass", "hang"])
    assert "no progress for 2 s on ranks [1] in ['c']" in run.killed, run.killed
    res = _group.unfinished(run, "c")
    assert res.status == "fail"
    for needle in ("case did not finish on ranks [1]", "finished elsewhere with {0: 'pass'}",
                   "rank 1 (killed by SIGKILL)", "in stuck_in_case"):  # its stack, from SIGUSR1
        assert needle in res.msg, f"{needle!r} not in:\n{res.msg}"


def test_group_watch_kills_the_others_when_a_rank_dies(tmp_path):
    run = _watched_group(tmp_path, ["wait", "segv"], case_limit=60.0)
    assert "rank 1 died (killed by SIGSEGV) during 'c'; the others were killed" in run.killed, run.killed
    assert run.codes[0] == -signal.SIGKILL, run.codes
    assert _group.reported(run, "c") is None


def test_group_watch_passes_a_group_that_finishes(tmp_path):
    run = _watched_group(tmp_path, ["pass", "pass", "pass"])
    assert not run.killed and run.codes == [0, 0, 0], (run.killed, run.codes)
    assert _group.merge(_group.reported(run, "c")).status == "pass"


def test_cuda_runner_reports_a_failing_scenario():
    """The CUDA scenarios' runner (tests/test_cuda.py) fails a scenario that
    fails on its ranks, with each rank's error; no GPU needed."""
    with pytest.raises(pytest.fail.Exception) as e:
        cuda_api.run_scenario("no_such_scenario", 2)
    for needle in ("no_such_scenario at world 2", "rank 0 [fail]: KeyError", "rank 1 [fail]: KeyError",
                   "ranks [0, 1] did not exit with code 0"):
        assert needle in str(e.value), f"{needle!r} not in:\n{e.value}"


# ---- error messages (tests/_ctx.py, tests/_messages.py), in this process ----------------------------


@pytest.fixture
def strict_ctx():
    """A tccomm-strict Ctx whose default group is a gloo world of one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield _ctx.Ctx({"world": 1, "backend": "tccomm", "transport": "shm",
                          "pg_timeout": 5}, 0, None, {})
    finally:
        dist.destroy_process_group()


GOOD = "tccomm allreduce on '{g}' (rank 0): size mismatch: rank 0 has 7 elements"


@pytest.mark.parametrize("msg, missing", [
    (GOOD, None),
    ("tccomm allreduce on '{g}' (rank 0 of 1): size mismatch", None),
    ("tccomm: allreduce: size mismatch: rank 0 has 7 elements", "the group and the rank"),
    ("tccomm allreduce on 'tccomm:other' (rank 0): size mismatch", "the group"),
    ("tccomm allreduce in the group (rank 0): size mismatch", "the group"),
    ("tccomm allreduce on '{g}': size mismatch: rank 0 has 7 elements", "the rank"),
    ("tccomm allreduce on '{g}' (rank 1): size mismatch", "the rank"),
    ("tccomm allgather on '{g}' (rank 0): size mismatch", "the op"),
    ("tccomm allreduce on '{g}' (rank 0): it broke", "the cause"),
])
def test_expect_error_wants_every_part(strict_ctx, msg, missing):
    msg = msg.format(g="tccomm:" + dist.group.WORLD.group_name)

    def fn():
        raise RuntimeError(msg)

    call = lambda: strict_ctx.expect_error(fn, _messages.OP_RE["all_reduce"], r"mismatch", "x")  # noqa: E731
    if missing is None:
        call()
        return
    with pytest.raises(AssertionError) as e:
        call()
    assert _messages.missing_parts_phrase(missing) in str(e.value), str(e.value)


@pytest.mark.parametrize("op, text", [
    ("reduce", "tccomm reduce on"), ("all_reduce", "tccomm: allreduce:"),
    ("reduce_scatter_tensor", "tccomm: _reduce_scatter_base:"), ("gather", "tccomm: gather:"),
    ("all_to_all_single", "tccomm alltoall on"), ("send", "tccomm: send:")])
def test_op_pattern_matches_its_op(op, text):
    assert re.search(_messages.OP_RE[op], text, re.I), (op, text)


@pytest.mark.parametrize("op, text", [
    ("reduce", "tccomm allreduce on"), ("reduce", "tccomm: reduce_scatter:"),
    ("reduce", "tccomm: _reduce_scatter_base:"), ("gather", "tccomm: allgather:"),
    ("gather", "tccomm: _allgather_base:"), ("scatter", "tccomm: reduce_scatter:"),
    ("all_gather", "tccomm: all_gather_into_tensor:"), ("send", "tccomm: sendrecv:")])
def test_op_pattern_rejects_other_ops(op, text):
    assert not re.search(_messages.OP_RE[op], text, re.I), (op, text)


class _Cached:
    """Stands in for a runner that already has `res` for every case."""
    keep = False

    def __init__(self, res):
        self.res = res

    def result(self, group, case):
        return self.res


def _failed_everywhere(msg):
    return _group.Result("fail", msg, [("fail", msg), ("fail", msg)])


GAP_CASE = ("w2-shm-env", "bad-broadcast_rank_out_of_range_W")


@pytest.fixture
def gap_case(monkeypatch):
    """GAP_CASE marked as a known message gap (no case needs one today)."""
    monkeypatch.setattr(_registry.all_cases()[GAP_CASE[1]], "msg_gap", _messages.NO_GROUP_NO_RANK)


def test_message_gap_is_the_expected_failure(gap_case):
    phrase = _messages.missing_parts_phrase(_messages.NO_GROUP_NO_RANK)
    with pytest.raises(MessageGap):
        check_case(_Cached(_failed_everywhere(f"broadcast: {phrase}...): 'msg'")), GAP_CASE)


@pytest.mark.parametrize("why", [
    "half fixed",       # the group is named now, the rank is not
    "other failure",    # the case broke some other way
    "one rank only",    # the other rank passed
])
def test_other_failures_of_a_gap_case_stay_failures(why, gap_case):
    phrase = _messages.missing_parts_phrase(_messages.NO_GROUP_NO_RANK)
    res = {"half fixed": _failed_everywhere(f"x: {_messages.missing_parts_phrase('the rank')}"),
           "other failure": _failed_everywhere("the group is not usable after the error"),
           "one rank only": _group.Result("fail", phrase, [("fail", phrase), ("pass", "")]),
           }[why]
    with pytest.raises(pytest.fail.Exception):
        check_case(_Cached(res), GAP_CASE)


# ---- the layout: no import cycles among the helpers and the package ----------------

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module_files() -> dict[str, pathlib.Path]:
    """Module name -> file, for tests/_*.py and torchcomm_backend/*.py."""
    files = {p.stem: p for p in (ROOT / "tests").glob("_*.py")}
    for p in (ROOT / "torchcomm_backend").glob("*.py"):
        files["torchcomm_backend" if p.stem == "__init__" else f"torchcomm_backend.{p.stem}"] = p
    return files


def _imported(name: str, path: pathlib.Path, known) -> set[str]:
    """The modules of `known` that `name` imports anywhere (at the top, or
    inside a function: a deferred import still makes a cycle). A package's
    own __init__ is not counted as imported by `from package.mod import x`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs or [base])
    return (found & set(known)) - {name}


def import_cycle(files: dict[str, pathlib.Path]) -> list[str] | None:
    """One import cycle among `files` (its modules in order, the first again
    at the end), or None."""
    graph = {n: sorted(_imported(n, p, files)) for n, p in files.items()}
    state: dict[str, str] = {}  # "open" while on the path, then "done"
    path: list[str] = []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for m in graph[n]:
            if state.get(m) == "open":
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = "done"
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_import_cycle_finder_finds_one(tmp_path):
    (tmp_path / "_a.py").write_text("import _b\n")
    (tmp_path / "_b.py").write_text("def f():\n    from _c import x\n")
    (tmp_path / "_c.py").write_text("import os\nimport _a\n")
    files = {p.stem: p for p in tmp_path.glob("_*.py")}
    assert import_cycle(files) == ["_a", "_b", "_c", "_a"]
    (tmp_path / "_c.py").write_text("import os\n")
    assert import_cycle(files) is None


def test_no_import_cycles():
    cycle = import_cycle(_module_files())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
