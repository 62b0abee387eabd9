"""Fault injection (tests/_fault_trials.py): for shared memory and TCP, 50
seeded trials each in which groups of 2-4 ranks run a mixed workload and a
random rank is SIGKILLed, os._exit()s or destroys its group at a random
point. Every survivor must raise within 2 s (group timeout 60 s) naming the
rank that went, no rank may hang, nothing of tccomm may stay in /dev/shm.

More trials: `python tests/_fault_trials.py --transport shm --trials 500 --seed N`.
TCCOMM_FAULT_TRIALS changes the number run here."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TRIALS = int(os.environ.get("TCCOMM_FAULT_TRIALS", "50"))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_random_rank_dies(transport):
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", os.path.join(HERE, "_fault_trials.py"),
         "--transport", transport, "--trials", str(TRIALS), "--seed", "20261124"],
        capture_output=True, text=True, timeout=60 + 40 * TRIALS)
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    summary = [l for l in lines if l.get("summary")]
    assert summary, f"no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    failed = [l for l in lines if l.get("errors")]
    assert summary[0]["trials"] == TRIALS
    assert not failed, "\n".join(json.dumps(l)[:1500] for l in failed[:5])
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"{transport}: {TRIALS} trials, worst time to error {summary[0]['worst_latency_s']} s")
