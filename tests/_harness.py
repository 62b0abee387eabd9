"""Parent side of the multi-process tests.

A *spec* (tests/_registry.py: world size x transport x init method) is run once
per pytest session: its ranks are spawned as separate processes
(tests/_worker.py), run every selected case of that spec in order, and report
events (tests/_rank.py) from which pytest reports one test per case, plus one
"teardown" test per spec for everything after the last case.

How a case is decided:
  * pass: every rank reported pass (with the same result digest, if any);
  * skip: every rank skipped;
  * fail: anything else: a rank failed or raised, the ranks' verdicts differ
    (e.g. one passed and another skipped), or a rank hung or died during it.
How the teardown is decided: pass only if every rank reported "done" after
its last case, then (destroy_process_group, a normal interpreter exit) exited
with code 0 by itself within the teardown limit.

Spawning, hang and crash detection and the verdicts are tests/_group.py's
(its limits apply); on top of them, per spec:
  * a hang or a death fails the current case with the evidence, and the
    group is restarted at the next case (at most TCCOMM_TEST_MAX_RESTARTS
    times, default 25); a rank that finds the group unusable after a case
    exits with code 3 to ask for that restart;
  * a case may have a hang limit longer than TCCOMM_TEST_CASE_TIMEOUT
    (Case.hang_limit);
  * when a spec's last run ended without a teardown (a restart or a kill
    after its last case), a run with no cases checks the teardown;
  * each spec has a wall-clock budget (TCCOMM_TEST_SPEC_BUDGET, default 600 s)
    after which its remaining cases fail as "not run".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import _group
import _registry
from _group import Result

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")

BACKEND = os.environ.get("TCCOMM_TEST_BACKEND", "tccomm")
SPEC_BUDGET = float(os.environ.get("TCCOMM_TEST_SPEC_BUDGET", "600"))
MAX_ATTEMPTS = int(os.environ.get("TCCOMM_TEST_MAX_RESTARTS", "25")) + 1

TEARDOWN = _registry.TEARDOWN  # the pseudo-case of each group: everything after its last case

# (spec name) -> case names selected by pytest in this session (see conftest.py)
SELECTED: dict[str, set[str]] = {}


def _hang_limit(case: str) -> float:
    """A case's own hang limit (0 when it has none)."""
    c = _registry.all_cases().get(case)
    return c.hang_limit if c is not None else 0.0


# ----------------------------------------------------------------------
# the specs of tests/_registry.py
# ----------------------------------------------------------------------


class Runner:
    """Runs each spec at most once per session and caches the per-case results.

    selected: spec -> the case names to run (default: SELECTED, what pytest
    selected; a spec missing there runs all its cases)."""

    def __init__(self, selected: dict[str, set[str]] | None = None) -> None:
        self.selected = SELECTED if selected is None else selected
        self.results: dict[str, dict[str, Result]] = {}
        self.timings: dict[str, tuple[float, int, int]] = {}  # spec -> (s, cases, attempts)
        self.workdir = tempfile.mkdtemp(prefix="tccomm-tests-")
        self.keep = False  # set when a test fails: its logs stay for a look
        self._store = None

    def store(self):
        if self._store is None:
            import datetime

            import torch.distributed as dist
            self._store = dist.TCPStore("127.0.0.1", 0, None, True,
                                        timeout=datetime.timedelta(seconds=_group.CASE_TIMEOUT * 2),
                                        wait_for_workers=False)
        return self._store

    def close(self) -> None:
        self._store = None
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def result(self, spec_name: str, case_name: str) -> Result:
        if spec_name not in self.results:
            spec = _registry.SPEC_BY_NAME[spec_name]
            wanted = self.selected.get(spec_name)
            names = [c.name for c in _registry.cases_for(spec)
                     if wanted is None or c.name in wanted]
            if case_name not in names and case_name != TEARDOWN:
                names.append(case_name)
            t0 = time.monotonic()
            self.results[spec_name], attempts = self._run_spec(spec, names)
            self.timings[spec_name] = (time.monotonic() - t0, len(names), attempts)
        return self.results[spec_name].get(
            case_name, Result("fail", "harness: no result recorded for this case"))

    # ------------------------------------------------------------------
    def _run_spec(self, spec: _registry.Spec, names: list[str]):
        results: dict[str, Result] = {}
        remaining = list(names)
        t_start = time.monotonic()
        attempt = 0
        # Until every case ran and one run got through a teardown (a run that
        # ended in a restart or a kill did not: then one with no cases does).
        while remaining or TEARDOWN not in results:
            if attempt >= MAX_ATTEMPTS or time.monotonic() - t_start > SPEC_BUDGET:
                why = (f"{attempt} group restarts" if attempt >= MAX_ATTEMPTS
                       else f"the spec's time budget of {SPEC_BUDGET:.0f} s")
                for n in remaining + [TEARDOWN]:
                    results[n] = Result("fail", f"not run: {why} used up by earlier "
                                                f"failures in {spec.name}")
                break
            attempt += 1
            remaining = self._attempt(spec, remaining, attempt, results)
        return results, attempt

    def _spawn(self, spec, names, attempt) -> _group.Run:
        """Starts the ranks of `spec` on `names` and watches them to the end."""
        d = os.path.join(self.workdir, spec.name, f"attempt{attempt}")
        os.makedirs(d, exist_ok=True)
        master_port, init_port = _group.free_port(), _group.free_port()
        reinit_port, reinit_port2 = _group.free_port(), _group.free_port()
        init_method = {"env": "env://",
                       "tcp": f"tcp://127.0.0.1:{init_port}",
                       "file": "file://" + os.path.join(d, "filestore")}[spec.init]
        cfg = {
            "backend": BACKEND, "world": spec.world, "transport": spec.transport,
            "init": spec.init, "init_method": init_method, "pg_timeout": spec.pg_timeout,
            "case_timeout": _group.CASE_TIMEOUT, "results_dir": d, "cases": names,
            "store_port": self.store().port,
            "store_prefix": f"{spec.name}/attempt{attempt}",
            "reinit_port": reinit_port, "reinit_port2": reinit_port2,
            "hosts": list(spec.hosts),
        }
        cfg_path = os.path.join(d, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)

        def env(rank):
            e = dict(os.environ)
            e.update(RANK=str(rank), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(rank),
                     LOCAL_WORLD_SIZE=str(spec.world), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(master_port), OMP_NUM_THREADS="1",
                     PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::FutureWarning")
            if spec.transport == "tcp":
                e["TCCOMM_TRANSPORT"] = "tcp"
            else:
                e.pop("TCCOMM_TRANSPORT", None)
            e.update(spec.env)
            if spec.hosts:
                e["TCCOMM_HOSTID"] = f"simhost{spec.hosts[rank]}"
            return e

        group = _group.spawn(d, spec.world, lambda rank: [WORKER, cfg_path, str(rank)], env)
        return _group.watch(group, case_limit=lambda case: max(_group.CASE_TIMEOUT, _hang_limit(case)))

    def _attempt(self, spec, names, attempt, results) -> list[str]:
        """Runs `names` in one spawned group; returns the cases still to run."""
        run = self._spawn(spec, names, attempt)
        failed_init = _group.init_failure(run, spec.name)
        if failed_init:
            for n in names + [TEARDOWN]:
                results[n] = Result("fail", failed_init)
            return []
        for i, name in enumerate(names):
            evs = _group.reported(run, name)
            if evs:
                results[name] = _group.merge(evs)
                if self._broke_group(run, name, results[name]):
                    return names[i + 1:]
                continue
            started = [run.find(q, "start", name) for q in range(spec.world)]
            if i > 0 and all(ev is None for ev in started):
                # It never started: the group broke in the sync after the previous case.
                prev = results[names[i - 1]]
                prev.status = "fail"
                prev.msg = ((prev.msg + "\n" if prev.msg else "") + "the group hung or died "
                            "right after this case (in the harness's post-case sync/health "
                            f"check): {run.killed}\n{run.tails(range(spec.world))}")
                return names[i:]
            results[name] = _group.unfinished(run, name)
            return names[i + 1:]
        results[TEARDOWN] = _group.teardown_result(run, spec.name)
        return []

    @staticmethod
    def _broke_group(run: _group.Run, name: str, res: Result) -> bool:
        """Whether the ranks found the group unusable after `name` (they then
        exit for a restart); `res` then fails saying so."""
        healths = [run.find(q, "health", name) for q in range(run.world)]
        broken = [(q, h["msg"]) for q, h in enumerate(healths) if h is not None and not h["ok"]]
        if not broken:
            return False
        if res.status != "fail":
            res.status, res.msg = "fail", "the group was unusable after this case"
        res.msg += ("\n[harness] group restarted after this case: "
                    + "; ".join(f"rank {q}: {m}" for q, m in broken))
        return True
