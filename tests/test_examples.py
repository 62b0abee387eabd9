"""The examples, launched the way the README launches them (torchrun, real
processes, normal interpreter exit): they check their own results and must
exit 0 with one line per rank."""

import os
import re
import subprocess
import sys

import pytest

import _group
import _harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300


def torchrun(script, nproc, *args, env_extra=None):
    env = dict(os.environ)
    env.pop("TCCOMM_TRANSPORT", None)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_group.free_port()),
           os.path.join(ROOT, "examples", script), "--backend", _harness.BACKEND, *args]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} did not finish within {TIMEOUT} s:\n{e.stdout}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[2:])} exited {proc.returncode}:\n{proc.stdout[-6000:]}",
                    pytrace=False)
    return proc.stdout


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_allreduce_example(transport):
    out = torchrun("allreduce.py", 4,
                   env_extra={"TCCOMM_TRANSPORT": "tcp"} if transport == "tcp" else None)
    found = re.findall(r"rank (\d)/4 backend=\S+: 8 collectives, (OK|FAILED)", out)
    assert sorted(found) == [(str(r), "OK") for r in range(4)], out


def test_ddp_example():
    out = torchrun("ddp_train.py", 2, "--steps", "30")
    assert out.count("identical to rank 0's") == 2, out


@pytest.mark.parametrize("script,what", [("torchcomm_allreduce.py", "torchcomm api"),
                                         ("torchcomm_window.py", "torchcomm window")])
def test_torchcomm_examples(script, what):
    if _harness.BACKEND != "tccomm":
        pytest.skip(f"the TorchComm-style API is tccomm's own (backend under test: {_harness.BACKEND})")
    out = torchrun(script, 2)
    found = re.findall(rf"rank (\d)/2 {what}: (OK|FAILED.*)", out)
    assert sorted(found) == [("0", "OK"), ("1", "OK")], out
