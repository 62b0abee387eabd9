"""Parent side of the multi-process tests.

A *spec* (tests/_cases.py: world size x transport x init method) is run once
per pytest session: its ranks are spawned as separate processes
(tests/_worker.py), run every selected case of that spec in order, and write
per-case results that pytest then reports as one test per case.

Hard limits (so a hang fails fast instead of blocking CI):
  * a rank that shows no progress for TCCOMM_TEST_CASE_TIMEOUT seconds
    (default 75) is considered hung: every rank gets SIGUSR1 (faulthandler
    dumps its Python stacks into its log), then the group is killed, the
    current case fails with that evidence, and the group is restarted at the
    next case;
  * a rank that dies (signal or exit code) fails the current case the same way;
  * each spec has a wall-clock budget (TCCOMM_TEST_SPEC_BUDGET, default 600 s)
    after which its remaining cases fail as "not run".
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import _cases

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")

BACKEND = os.environ.get("TCCOMM_TEST_BACKEND", "tccomm")
CASE_TIMEOUT = float(os.environ.get("TCCOMM_TEST_CASE_TIMEOUT", "75"))
INIT_TIMEOUT = float(os.environ.get("TCCOMM_TEST_INIT_TIMEOUT", "150"))
SPEC_BUDGET = float(os.environ.get("TCCOMM_TEST_SPEC_BUDGET", "600"))
MAX_ATTEMPTS = int(os.environ.get("TCCOMM_TEST_MAX_RESTARTS", "25")) + 1

# (spec name) -> case names selected by pytest in this session (see conftest.py)
SELECTED: dict[str, set[str]] = {}


@dataclasses.dataclass
class Result:
    status: str  # pass, fail, skip
    msg: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            data = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(data[-lines:])


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _hang_limit(case: str) -> float:
    """A case's own hang limit (0 when it has none)."""
    c = _cases.REGISTRY.get(case)
    return c.hang_limit if c is not None else 0.0


class Runner:
    """Runs each spec at most once per session and caches the per-case results."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, Result]] = {}
        self.timings: dict[str, tuple[float, int, int]] = {}  # spec -> (s, cases, attempts)
        self.workdir = tempfile.mkdtemp(prefix="tccomm-tests-")
        self.keep = False
        self._store = None

    def store(self):
        if self._store is None:
            import datetime

            import torch.distributed as dist
            self._store = dist.TCPStore("127.0.0.1", 0, None, True,
                                        timeout=datetime.timedelta(seconds=CASE_TIMEOUT * 2),
                                        wait_for_workers=False)
        return self._store

    def close(self) -> None:
        self._store = None
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def result(self, spec_name: str, case_name: str) -> Result:
        if spec_name not in self.results:
            spec = _cases.SPEC_BY_NAME[spec_name]
            wanted = SELECTED.get(spec_name)
            names = [c.name for c in _cases.cases_for(spec)
                     if wanted is None or c.name in wanted]
            if case_name not in names:
                names.append(case_name)
            t0 = time.monotonic()
            self.results[spec_name], attempts = self._run_spec(spec, names)
            self.timings[spec_name] = (time.monotonic() - t0, len(names), attempts)
            if any(r.status == "fail" for r in self.results[spec_name].values()):
                self.keep = True
        return self.results[spec_name].get(
            case_name, Result("fail", "harness: no result recorded for this case"))

    # ------------------------------------------------------------------
    def _run_spec(self, spec: _cases.Spec, names: list[str]):
        results: dict[str, Result] = {}
        remaining = list(names)
        t_start = time.monotonic()
        attempt = 0
        while remaining:
            if attempt >= MAX_ATTEMPTS or time.monotonic() - t_start > SPEC_BUDGET:
                why = (f"{attempt} group restarts" if attempt >= MAX_ATTEMPTS
                       else f"the spec's time budget of {SPEC_BUDGET:.0f} s")
                for n in remaining:
                    results[n] = Result("fail", f"not run: {why} used up by earlier "
                                                f"failures in {spec.name}")
                break
            attempt += 1
            remaining = self._attempt(spec, remaining, attempt, results)
        return results, attempt

    def _attempt(self, spec, names, attempt, results) -> list[str]:
        """Runs `names` in one spawned group; returns the cases still to run."""
        d = os.path.join(self.workdir, spec.name, f"attempt{attempt}")
        os.makedirs(d, exist_ok=True)
        master_port, init_port = free_port(), free_port()
        reinit_port, reinit_port2 = free_port(), free_port()
        init_method = {"env": "env://",
                       "tcp": f"tcp://127.0.0.1:{init_port}",
                       "file": "file://" + os.path.join(d, "filestore")}[spec.init]
        cfg = {
            "backend": BACKEND, "world": spec.world, "transport": spec.transport,
            "init": spec.init, "init_method": init_method, "pg_timeout": spec.pg_timeout,
            "case_timeout": CASE_TIMEOUT, "results_dir": d, "cases": names,
            "store_port": self.store().port,
            "store_prefix": f"{spec.name}/attempt{attempt}",
            "reinit_port": reinit_port, "reinit_port2": reinit_port2,
        }
        cfg_path = os.path.join(d, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        procs, logs = [], []
        for rank in range(spec.world):
            env = dict(os.environ)
            env.update(RANK=str(rank), WORLD_SIZE=str(spec.world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(spec.world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(master_port), OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::FutureWarning")
            if spec.transport == "tcp":
                env["TCCOMM_TRANSPORT"] = "tcp"
            else:
                env.pop("TCCOMM_TRANSPORT", None)
            log = os.path.join(d, f"rank{rank}.log")
            logs.append(log)
            with open(log, "w") as lf:
                procs.append(subprocess.Popen(
                    [sys.executable, WORKER, cfg_path, str(rank)], env=env, cwd=HERE,
                    stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        events = self._monitor(spec, procs, d)
        codes = [p.returncode for p in procs]

        def tails(ranks):
            return "\n".join(f"--- rank {q} ({_describe_exit(codes[q])}), log {logs[q]}:\n"
                             f"{_tail(logs[q])}" for q in ranks)

        # init
        init_res = [self._find(events[q], "result", "<init>") for q in range(spec.world)]
        if any(ev is None or ev["status"] != "pass" for ev in init_res):
            bad = [q for q in range(spec.world) if init_res[q] is None
                   or init_res[q]["status"] != "pass"]
            msgs = "\n".join(f"rank {q}: {init_res[q]['msg']}" for q in bad
                             if init_res[q] is not None)
            text = (f"{spec.name}: the group could not be created (ranks {bad}).\n{msgs}\n"
                    f"{tails(bad)}")
            for n in names:
                results[n] = Result("fail", text)
            return []

        for i, name in enumerate(names):
            evs = [self._find(events[q], "result", name) for q in range(spec.world)]
            if all(ev is not None for ev in evs):
                results[name] = self._merge(spec, name, evs)
                healths = [self._find(events[q], "health", name) for q in range(spec.world)]
                if any(h is not None and not h["ok"] for h in healths):
                    # The group was broken by this case: restart after it.
                    if results[name].status != "fail":
                        results[name] = Result("fail", "the group was unusable after this "
                                                       "case")
                    hm = "; ".join(f"rank {q}: {h['msg']}" for q, h in enumerate(healths)
                                   if h is not None and not h["ok"])
                    results[name].msg += f"\n[harness] group restarted after this case: {hm}"
                    return names[i + 1:]
                continue
            # This case never finished on some ranks: hang or crash.
            started = [self._find(events[q], "start", name) for q in range(spec.world)]
            if i > 0 and all(ev is None for ev in started):
                # It never started: the group broke in the sync after the previous case.
                prev = names[i - 1]
                how = self._why.get(spec.name, "")
                results[prev] = Result("fail", (results[prev].msg + "\n" if results[prev].msg
                                                else "") + "the group hung or died right after "
                                       f"this case (in the harness's post-case sync/health "
                                       f"check): {how}\n{tails(range(spec.world))}")
                return names[i:]
            missing = [q for q in range(spec.world) if evs[q] is None]
            done = {q: ev["status"] for q, ev in enumerate(evs) if ev is not None}
            how = self._why.get(spec.name, "")
            text = (f"case did not finish on ranks {missing} ({how}); "
                    f"finished elsewhere with {done}.\n{tails(range(spec.world))}")
            partial = [f"rank {q}: [{ev['status']}] {ev['msg']}" for q, ev in enumerate(evs)
                       if ev is not None and ev["status"] in ("fail", "error")]
            if partial:
                text = "\n".join(partial) + "\n" + text
            results[name] = Result("fail", text)
            return names[i + 1:]
        return []

    _why: dict[str, str] = {}

    @staticmethod
    def _find(evs, kind, name):
        for ev in evs:
            if ev.get("event") == kind and ev.get("case") == name:
                return ev
        return None

    @staticmethod
    def _merge(spec, name, evs) -> Result:
        bad = [(q, ev) for q, ev in enumerate(evs) if ev["status"] in ("fail", "error")]
        if bad:
            return Result("fail", "\n".join(f"rank {q} [{ev['status']}]: {ev['msg']}"
                                            for q, ev in bad))
        st = {ev["status"] for ev in evs}
        if st == {"skip"}:
            return Result("skip", evs[0]["msg"])
        if "skip" in st:
            return Result("fail", "skipped on some ranks only: " +
                          ", ".join(f"rank {q}: {ev['status']}" for q, ev in enumerate(evs)))
        digests = [ev.get("digest") for ev in evs]
        if any(d is not None for d in digests) and len(set(digests)) != 1:
            return Result("fail", "results are not bit-identical on every rank "
                                  f"(sha1 per rank: {digests})")
        return Result("pass")

    def _monitor(self, spec, procs, d) -> list[list[dict]]:
        """Waits for the group; kills it on a hang or a crash. Returns the events."""
        n = spec.world
        events: list[list[dict]] = [[] for _ in range(n)]
        offsets = [0] * n
        last_progress = [time.monotonic()] * n
        phase = ["<init>"] * n
        crashed_at = None
        self._why[spec.name] = ""

        def read_new():
            for q in range(n):
                path = os.path.join(d, f"rank{q}.jsonl")
                try:
                    with open(path) as f:
                        f.seek(offsets[q])
                        chunk = f.read()
                except OSError:
                    continue
                # only complete lines
                end = chunk.rfind("\n")
                if end < 0:
                    continue
                offsets[q] += len(chunk[:end + 1].encode())
                for line in chunk[:end + 1].splitlines():
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    events[q].append(ev)
                    last_progress[q] = time.monotonic()
                    if ev.get("event") == "start":
                        phase[q] = ev["case"]

        def kill_all(reason: str):
            self._why[spec.name] = reason
            alive = [p for p in procs if p.poll() is None]
            for p in alive:  # Python stacks into the logs
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except OSError:
                    pass
            if alive:
                time.sleep(1.0)
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except OSError:
                        pass
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass

        while True:
            read_new()
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            dead = [q for q, c in enumerate(codes) if c not in (None, 0, 3)]
            if dead:
                if crashed_at is None:
                    crashed_at = now
                elif now - crashed_at > 5.0:
                    kill_all(f"rank {dead[0]} died ({_describe_exit(codes[dead[0]])}) "
                             f"during {phase[dead[0]]!r}; the others were killed")
                    break
            limit = (INIT_TIMEOUT if any(p == "<init>" for p in phase)
                     else max([CASE_TIMEOUT] + [_hang_limit(p) for p in phase]))
            stuck = [q for q in range(n) if codes[q] is None and now - last_progress[q] > limit]
            if stuck:
                kill_all(f"no progress for {limit:.0f} s on ranks {stuck} in cases "
                         f"{[phase[q] for q in stuck]}: hung, killed (stacks in the logs)")
                break
            time.sleep(0.05)
        read_new()
        return events
