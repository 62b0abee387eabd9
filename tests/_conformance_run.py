"""Runs torch's own c10d conformance suite (torch/testing/_internal/
distributed/distributed_test.py, the suite torch runs for gloo) on one
backend and world size, and writes one JSON line per test.

    python tests/_conformance_run.py --backend tccomm --world-size 3 \\
        --results out.jsonl [--only test_a,test_b]

The tests are chosen exactly as for gloo: torch decides at import time, from
the environment variable BACKEND, which tests apply (decorators such as
"Only gloo backend supports timeouts") and the module is always imported with
BACKEND=gloo. For another backend, the group is then created with that
backend (see widen_to()), so it runs gloo's selection, no more, no less.

Each test forks its ranks from this process. torch's own driver spawns them,
which re-imports torch and the suite in every rank of every test (about 5 s
each on 2 cores, against well under a second per test when forked). This
process imports torch but runs no torch computation before forking.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import unittest

REFERENCE_BACKEND = "gloo"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="tccomm")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--results", required=True, help="JSON lines, one per test, written as they finish")
    ap.add_argument("--only", default="", help="comma-separated test names (default: every test)")
    return ap.parse_args(argv)


def import_suite(world_size: int):
    """Imports torch's suite with gloo's test selection."""
    os.environ["BACKEND"] = REFERENCE_BACKEND
    os.environ["WORLD_SIZE"] = str(world_size)
    # file:// as torch's own gloo runs use it (test_barrier_timeout_global
    # needs it); each test also gets its own init file (TestDistBackend).
    init_dir = tempfile.mkdtemp(prefix="tccomm-conformance-")
    atexit.register(shutil.rmtree, init_dir, True)  # the ranks leave through os._exit
    os.environ["INIT_METHOD"] = "file://" + os.path.join(init_dir, "init")
    # A hung test fails after this instead of torch's 300 s; the groups'
    # own timeout is 60 s.
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "150")
    sys.argv = sys.argv[:1]  # torch's test utilities parse the command line
    from torch.testing._internal import common_utils

    common_utils.parse_cmd_line_args()
    import torch.testing._internal.distributed.distributed_test as suite

    return suite


def gloo_branch_methods(suite) -> list[str]:
    """Methods of the suite whose body (not a decorator) compares BACKEND
    with "gloo", e.g. `if BACKEND == "mpi" or BACKEND == "gloo": <CPU path>`."""
    tree = ast.parse(inspect.getsource(suite))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for stmt in node.body:
            for sub in ast.walk(stmt):
                if (isinstance(sub, ast.Compare) and isinstance(sub.left, ast.Name) and sub.left.id == "BACKEND"
                        and any(_names_reference(c) for c in sub.comparators)):
                    found.append(node.name)
                    break
            else:
                continue
            break
    return sorted(set(found))


def _names_reference(node) -> bool:
    """`node` is "gloo", or a literal tuple, list or set holding it."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_reference(e) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value == REFERENCE_BACKEND


def widen_to(suite, backend: str) -> None:
    """Makes the suite run `backend` where it would run gloo.

    * The group is created with `backend` (module BACKEND, which _run and a
      few tests pass to init_process_group / new_group, and env BACKEND).
    * The allow-lists of what gloo supports (profiling of collectives and of
      send/recv, DistTestCases.backend_feature) name `backend` too.
    * Methods that branch on BACKEND == "gloo" inside their body see "gloo"
      while they run (they choose the CPU path there; none creates a group).
    """
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import DistTestCases

    suite.BACKEND = backend
    os.environ["BACKEND"] = backend
    for name in ("PROFILING_SUPPORTED_BACKENDS", "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
        allowed = getattr(suite, name)
        if dist.Backend.GLOO in allowed and backend not in allowed:
            allowed.append(backend)
    for backends in DistTestCases.backend_feature.values():
        if REFERENCE_BACKEND in backends:
            backends.add(backend)
    base = suite.DistributedTest._DistTestBase
    for name in gloo_branch_methods(suite):
        if hasattr(base, name):
            setattr(base, name, _seeing_reference_backend(suite, getattr(base, name)))


def _seeing_reference_backend(suite, fn):
    def wrapper(*args, **kwargs):
        actual = suite.BACKEND
        suite.BACKEND = REFERENCE_BACKEND
        try:
            return fn(*args, **kwargs)
        finally:
            suite.BACKEND = actual

    wrapper.__name__ = fn.__name__
    wrapper.__wrapped__ = fn
    return wrapper


def make_test_class(suite):
    import torch.multiprocessing as mp

    class TorchConformance(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(mp.get_context("fork").Process)

        def tearDown(self):
            super().tearDown()
            # torch's MultiProcessTestCase leaves each test's init file behind.
            if os.path.exists(self.file_name):
                os.remove(self.file_name)

    return TorchConformance


def test_names(cls) -> list[str]:
    return sorted(n for n in dir(cls) if n.startswith("test_") and callable(getattr(cls, n)))


class JsonLinesResult(unittest.TextTestResult):
    """Appends {"test", "status": pass|fail|skip, "detail", "seconds"} per test."""

    def __init__(self, stream, descriptions, verbosity, *, out=None):
        super().__init__(stream, descriptions, verbosity)
        self.out = out
        self.started = 0.0
        self.outcome = None

    def startTest(self, test):
        self.started = time.monotonic()
        self.outcome = ("pass", "")
        super().startTest(test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcome = ("fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self.outcome = ("fail", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcome = ("skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcome = ("skip", "expected failure in torch's suite")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcome = ("fail", "unexpected success of a test torch marks as an expected failure")

    def stopTest(self, test):
        super().stopTest(test)
        status, detail = self.outcome
        line = {"test": test._testMethodName, "status": status, "detail": detail,
                "seconds": round(time.monotonic() - self.started, 2)}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    suite = import_suite(args.world_size)
    if args.backend != REFERENCE_BACKEND:
        if args.backend == "tccomm":
            import torchcomm_backend  # noqa: F401  (registers the backend before the ranks fork)
        widen_to(suite, args.backend)
    cls = make_test_class(suite)
    names = test_names(cls)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            print(f"not in torch's suite: {', '.join(unknown)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in set(wanted)]
    tests = unittest.TestSuite(cls(n) for n in names)
    with open(args.results, "w") as out:
        runner = unittest.TextTestRunner(
            stream=sys.stdout, verbosity=2,
            resultclass=lambda *a, **k: JsonLinesResult(*a, **k, out=out))
        try:
            runner.run(tests)
        except Exception:  # noqa: BLE001 - reported to the driver, which fails the run
            traceback.print_exc()
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
