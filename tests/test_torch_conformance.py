"""torch's own c10d conformance suite on tccomm, CPU tensors.

torch ships the suite it runs for gloo (torch/testing/_internal/distributed/
distributed_test.py); tests/_conformance_run.py runs it on a backend with
exactly gloo's selection of tests. Each test of the suite is reported here as
its own test, `test_torch_suite[<world size>-<test>]`.

TCCOMM_CONFORMANCE selects how much runs:
  ci (default)  tccomm at 3 ranks, every test of the suite (about 2 minutes).
                A test torch skips for gloo is skipped with torch's reason.
  full          tccomm and gloo, at 2 and 3 ranks (about 8 minutes). gloo is
                the reference: a test gloo passes must pass on tccomm, a test
                gloo skips must be skipped on tccomm too, a test gloo fails is
                not required (skipped, saying so).
  off           nothing.
Tests listed in tests/_conformance_skips.py are skipped with their reason (in
full mode they still run, and one that passes fails: its entry is stale).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from _conformance_skips import SKIPS

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "_conformance_run.py")

MODE = os.environ.get("TCCOMM_CONFORMANCE", "ci")
if MODE not in ("ci", "full", "off"):
    raise ValueError(f"TCCOMM_CONFORMANCE={MODE!r}: expected ci, full or off")
WORLD_SIZES = {"ci": (3,), "full": (2, 3), "off": ()}[MODE]
BACKENDS = {"ci": ("tccomm",), "full": ("gloo", "tccomm"), "off": ()}[MODE]
# One run of the suite (one backend, one world size); a hung test is ended by
# the runner itself after DISTRIBUTED_TESTS_DEFAULT_TIMEOUT (150 s).
RUN_TIMEOUT = float(os.environ.get("TCCOMM_CONFORMANCE_RUN_TIMEOUT", "1200"))


def suite_path() -> str | None:
    spec = importlib.util.find_spec("torch")  # finds torch without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0],
                        "testing", "_internal", "distributed", "distributed_test.py")
    return path if os.path.exists(path) else None


@functools.lru_cache(maxsize=None)
def suite_tests() -> tuple[str, ...]:
    """The suite's test names, read from its source (importing it takes
    seconds and needs the backend chosen first)."""
    path = suite_path()
    if path is None:
        return ()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "_DistTestBase":
            return tuple(sorted(
                fn.name for fn in node.body
                if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")))
    return ()


def missing_requirement() -> str | None:
    if suite_path() is None:
        return "this torch ships no torch/testing/_internal/distributed/distributed_test.py"
    if importlib.util.find_spec("expecttest") is None:
        return "torch's test utilities need the package expecttest (pip install expecttest)"
    return None


ITEMS = [(ws, name) for ws in WORLD_SIZES for name in suite_tests()]


def test_skip_list_names_are_tests_of_the_suite():
    if suite_path() is None:
        pytest.skip(missing_requirement())
    stale = sorted(set(SKIPS) - set(suite_tests()))
    assert not stale, (f"tests/_conformance_skips.py lists tests that torch's suite no longer has "
                       f"(remove them): {', '.join(stale)}")


class SuiteRuns:
    """Runs the suite once per (backend, world size), for the tests this
    pytest session selected, and keeps the results."""

    def __init__(self, tmpdir, selected):
        self.tmpdir = tmpdir
        self.selected = selected  # world size -> test names
        self.results = {}  # (backend, world size) -> {test: result dict}

    def result(self, backend, ws, name):
        if (backend, ws) not in self.results:
            self.results[(backend, ws)] = self._run(backend, ws)
        return self.results[(backend, ws)].get(name)

    def _run(self, backend, ws):
        names = sorted(self.selected[ws])
        if backend == "tccomm" and MODE != "full":
            names = [n for n in names if n not in SKIPS]
        out = os.path.join(self.tmpdir, f"{backend}-{ws}.jsonl")
        log = os.path.join(self.tmpdir, f"{backend}-{ws}.log")
        cmd = [sys.executable, RUNNER, "--backend", backend, "--world-size", str(ws),
               "--results", out, "--only", ",".join(names)]
        with open(log, "w") as logf:
            try:
                proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                      timeout=RUN_TIMEOUT, cwd=HERE)
                ended = f"exit code {proc.returncode}"
            except subprocess.TimeoutExpired:
                ended = f"killed after {RUN_TIMEOUT:.0f} s"
        results = {}
        if os.path.exists(out):
            with open(out) as f:
                for line in f:
                    r = json.loads(line)
                    results[r["test"]] = r
        for name in names:
            results.setdefault(name, {
                "test": name, "status": "fail",
                "detail": f"not run: the {backend} runner at {ws} ranks ended ({ended}) "
                          f"before this test reported; its log: {log}"})
        return results


@pytest.fixture(scope="session")
def suite_runs(request, tmp_path_factory):
    selected = {}
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and "ws_test" in cs.params:
            ws, name = cs.params["ws_test"]
            selected.setdefault(ws, set()).add(name)
    return SuiteRuns(str(tmp_path_factory.mktemp("torch-conformance")), selected)


def _first_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


@pytest.mark.parametrize("ws_test", ITEMS, ids=[f"{ws}-{name}" for ws, name in ITEMS])
def test_torch_suite(suite_runs, ws_test):
    ws, name = ws_test
    why_not = missing_requirement()
    if why_not:
        pytest.skip(why_not)
    if name in SKIPS and MODE != "full":
        pytest.skip(SKIPS[name])
    got = suite_runs.result("tccomm", ws, name)
    if MODE == "full":
        verdict_against_gloo(suite_runs.result("gloo", ws, name), got, name, ws)
    elif got["status"] == "skip":
        pytest.skip(f"torch's suite skips it: {got['detail']}")
    elif got["status"] != "pass":
        pytest.fail(f"{name} at {ws} ranks on tccomm:\n{got['detail']}", pytrace=False)


def verdict_against_gloo(ref, got, name, ws):
    """gloo's result is what tccomm must match (module docstring)."""
    if name in SKIPS:
        if got["status"] == "pass":
            pytest.fail(f"{name} passes on tccomm at {ws} ranks: remove it from "
                        f"tests/_conformance_skips.py", pytrace=False)
        pytest.skip(SKIPS[name])
    if ref["status"] == "fail":
        pytest.skip(f"gloo fails it too at {ws} ranks (not required of tccomm): "
                    f"{_first_line(ref['detail'])}")
    if ref["status"] == "skip":
        if got["status"] != "skip":
            pytest.fail(f"{name} at {ws} ranks: torch's suite skips it for gloo "
                        f"({ref['detail']}) but ran it on tccomm ({got['status']}): "
                        f"the selection differs\n{got['detail']}", pytrace=False)
        pytest.skip(f"torch's suite skips it for gloo: {ref['detail']}")
    if got["status"] != "pass":
        pytest.fail(f"{name} at {ws} ranks: gloo passes, tccomm {got['status']}s:\n"
                    f"{got['detail']}", pytrace=False)
