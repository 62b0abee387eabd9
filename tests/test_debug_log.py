"""TCCOMM_DEBUG / TCCOMM_DEBUG_FILE in a real 2-rank torch group: each rank
writes its own file (%h and %p expanded) with what the level promises, and
with TCCOMM_DEBUG unset nothing is written anywhere."""

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

import _group
import _harness

TIMEOUT = 180

# A few dist ops a rank runs; prints OK when they gave the right results.
RANK_SCRIPT = textwrap.dedent("""
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    import torchcomm_backend  # noqa: F401  (registers "tccomm")

    rank = int(os.environ["RANK"])
    dist.init_process_group("tccomm", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    t = torch.arange(8, dtype=torch.float32) + rank
    dist.all_reduce(t)
    assert t.tolist() == [2 * i + 1 for i in range(8)], t
    b = torch.full((5,), float(rank), dtype=torch.float64)
    dist.broadcast(b, src=1)
    assert b.tolist() == [1.0] * 5, b
    outs = [torch.zeros(3, dtype=torch.int32) for _ in range(2)]
    dist.all_gather(outs, torch.full((3,), rank, dtype=torch.int32))
    assert [o.tolist() for o in outs] == [[0] * 3, [1] * 3], outs
    p = torch.zeros(4)
    if rank == 0:
        dist.send(p + 7, 1, tag=3)
    else:
        dist.recv(p, 0, tag=3)
        assert p.tolist() == [7.0] * 4, p
    dist.destroy_process_group()
    print(f"rank {rank} OK", flush=True)
""")


def run_group(env_extra):
    """Runs RANK_SCRIPT on 2 ranks; returns [(pid, output)] per rank."""
    port = _group.free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        for k in ("TCCOMM_DEBUG", "TCCOMM_DEBUG_FILE", "TCCOMM_TRANSPORT"):
            env.pop(k, None)
        env.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        env.update(env_extra)
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {rank} did not finish within {TIMEOUT} s", pytrace=False)
        assert p.returncode == 0 and f"rank {rank} OK" in out, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
        results.append((p.pid, out))
    return results


LINE = re.compile(r"^(?P<host>[^:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<rank>\d+|-)\] TCCOMM "
                  r"(?P<level>VERSION|WARN|INFO|TRACE) (?P<msg>.*)$")


def read_log(path, pid):
    """The file's lines as (rank, level, message); every line well formed,
    of this host and process, and of one rank."""
    assert os.path.exists(path), f"{path} was not written; the directory has {os.listdir(os.path.dirname(path))}"
    with open(path) as f:
        text = f.read()
    assert text.endswith("\n"), text
    lines = []
    for line in text.splitlines():
        m = LINE.match(line)
        assert m, f"malformed line in {path}: {line!r}"
        assert m["host"] == socket.gethostname() and int(m["pid"]) == pid, line
        lines.append((m["rank"], m["level"], m["msg"]))
    assert len({r for r, _, _ in lines if r != "-"}) == 1, f"more than one rank in {path}:\n{text}"
    return lines, text


def has(lines, level, pattern):
    return [msg for _, lv, msg in lines if lv == level and re.search(pattern, msg)]


@pytest.fixture(autouse=True)
def tccomm_only():
    if _harness.BACKEND != "tccomm":
        pytest.skip(f"TCCOMM_DEBUG is tccomm's own (backend under test: {_harness.BACKEND})")


def test_info_names_transport_thresholds_and_lifecycle(tmp_path):
    ranks = run_group({"TCCOMM_DEBUG": "INFO", "TCCOMM_DEBUG_FILE": str(tmp_path / "tccomm.%h.%p.log")})
    host = socket.gethostname()
    for rank, (pid, _) in enumerate(ranks):
        lines, text = read_log(str(tmp_path / f"tccomm.{host}.{pid}.log"), pid)
        assert {r for r, _, _ in lines} == {"-", str(rank)}, text
        assert has(lines, "INFO", r"^tccomm version \d+\.\d+ \("), text
        assert has(lines, "INFO", rf"^communicator '[^']+': all 2 ranks on host {re.escape(host)} share /dev/shm: shm$"), text
        assert has(lines, "INFO", r"^communicator '[^']+' shared memory: 2 ranks on this host, \d+ CPU\(s\) between them: "
                   r"(waiters spin while the awaited rank runs elsewhere|waiters yield at once)"), text
        assert has(lines, "INFO", r"algorithms over shm staging spans: reductions up to \d+ bytes one-shot .* "
                                  r"\d+-byte windows.*; broadcast, scatter, gather and reduce whose part fits 65504 "
                                  r"bytes over 32-slot rings.*, and parts up to 2095104 bytes over several slots"), text
        created = has(lines, "INFO", rf"^communicator '[^']+' created: rank {rank} of 2, transport shm, timeout \d+ ms$")
        assert created, text
        assert has(lines, "INFO", rf"^communicator '[^']+' destroyed: rank {rank} of 2, \d+ collectives issued$"), text
        assert not [lv for _, lv, _ in lines if lv != "INFO"], text


def test_trace_logs_every_op_with_its_algorithm(tmp_path):
    ranks = run_group({"TCCOMM_DEBUG": "trace", "TCCOMM_TRANSPORT": "tcp",
                       "TCCOMM_DEBUG_FILE": str(tmp_path / "trace.%h.%p.log")})
    host = socket.gethostname()
    for rank, (pid, _) in enumerate(ranks):
        lines, text = read_log(str(tmp_path / f"trace.{host}.{pid}.log"), pid)
        assert has(lines, "INFO", r"^communicator '[^']+': transport tcp forced by TCCOMM_TRANSPORT=tcp; "), text
        assert has(lines, "INFO", r"algorithms over tcp streams: .* pipelined in \d+-byte segments$"), text
        assert has(lines, "TRACE", r"^allreduce #\d+ on '[^']+': float32 count 8 \(32 bytes\), host memory, "
                                   r"executor host, algorithm streams one exchange \(data with the descriptors\)$"), text
        assert has(lines, "TRACE", r"^broadcast #\d+ on '[^']+': float64 count 5 \(40 bytes\), root 1, host memory, "
                                   r"executor host, algorithm streams one-sided \(data with the descriptors; its "
                                   r"senders do not wait\)$"), text
        assert has(lines, "TRACE", r"^allgather #\d+ on '[^']+': int32 count 3 \(12 bytes\), host memory, "
                                   r"executor host, algorithm streams one exchange \(data with the descriptors\)$"), text
        p2p = (r"^send on '[^']+': 16 bytes, to peer 1 tag 3, " if rank == 0
               else r"^recv on '[^']+': 16 bytes, from peer 0 tag 3, ")
        assert has(lines, "TRACE", p2p + r"host memory, executor host, algorithm tcp p2p$"), text
        # sequence numbers follow issue order
        seqs = [int(m.group(1)) for _, lv, msg in lines if lv == "TRACE" for m in [re.search(r" #(\d+) on ", msg)] if m]
        assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)) >= 3, text


def test_unset_logs_nothing(tmp_path):
    ranks = run_group({"TCCOMM_DEBUG_FILE": str(tmp_path / "off.%h.%p.log")})
    assert os.listdir(tmp_path) == []
    for _, out in ranks:
        assert "TCCOMM " not in out, out
