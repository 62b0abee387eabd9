"""Shared memory that fails at setup and is agreed on, each scenario in a
world of its own (2 ranks started with subprocess, env:// rendezvous):

- in a mount namespace whose /dev/shm is a 1 MiB tmpfs, both ranks raise at
  init_process_group within seconds (not after the group timeout), naming
  the bytes needed and free and TCCOMM_TRANSPORT=tcp; with
  TCCOMM_TRANSPORT=tcp the same namespace runs a checked all_reduce;
- ranks started with different TCCOMM_SHM_SMALL_BYTES and
  TCCOMM_SHM_WINDOW_BYTES all_reduce sizes around those thresholds exactly
  like a reference computed with plain torch (rank 0's values win);
- two ranks of one host whose /dev/shm differ (one in a mount namespace of
  its own) agree on TCP instead of waiting for a segment that never appears;
- huge group timeouts (timedelta.max, timedelta(days=10**6)) mean "no
  timeout" for init_process_group and new_group instead of overflowing.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import _group
import _harness

TIMEOUT = 180

RANK_SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist

    rank, scenario = int(os.environ["RANK"]), sys.argv[1]

    def report(**kw):
        print("RESULT " + json.dumps(dict(rank=rank, **kw)), flush=True)

    def inputs(n, dtype, r):
        return (torch.arange(n, dtype=torch.int64) % 97 - 48 + 7 * r).to(dtype)

    def init(timeout, **kw):
        t0 = time.monotonic()
        try:
            dist.init_process_group("tccomm", timeout=timeout, **kw)
        except Exception as e:
            report(raised=type(e).__name__, msg=str(e), secs=time.monotonic() - t0)
            sys.exit(0)

    if scenario == "small_shm":
        # A file store: rank 0 fails at once and exits, and with it a TCPStore
        # it hosts, which rank 1 may still be reading its blobs from.
        store = dist.FileStore(os.environ["STORE_PATH"], 2)
        init(datetime.timedelta(seconds=60), store=store, rank=rank, world_size=2)
        x = torch.arange(1000, dtype=torch.float32) + rank
        dist.all_reduce(x)
        report(ok=torch.equal(x, 2 * torch.arange(1000, dtype=torch.float32) + 1))
    elif scenario == "thresholds":
        init(datetime.timedelta(seconds=30))
        bad = []
        for dtype in (torch.float32, torch.int64):
            es = torch.empty((), dtype=dtype).element_size()
            for nbytes in (es, 4096, 65536 - es, 65536, 65536 + es, 131072 + es, 1048576 - es,
                           1048576, 1048576 + es, 3 * 1048576 + es):
                n = nbytes // es
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                    x = inputs(n, dtype, rank)
                    dist.all_reduce(x, op=op)
                    both = torch.stack([inputs(n, dtype, r) for r in range(2)])
                    ref = both.sum(0) if op == dist.ReduceOp.SUM else both.amax(0)
                    if not torch.equal(x, ref.to(dtype)):
                        bad.append(f"{dtype} {n} elements {op}")
        report(ok=not bad, bad=bad)
    elif scenario == "separate_shm":
        init(datetime.timedelta(seconds=60))
        x = torch.arange(1000, dtype=torch.float32) + rank
        dist.all_reduce(x)
        maps = [l for l in open("/proc/self/maps") if "/dev/shm/" in l]
        report(ok=torch.equal(x, 2 * torch.arange(1000, dtype=torch.float32) + 1), shm_maps=len(maps))
    elif scenario in ("timedelta_max", "days"):
        huge = datetime.timedelta.max if scenario == "timedelta_max" else datetime.timedelta(days=10**6)
        # torch's own TCPStore cannot take such a timeout: a file store can.
        store = dist.FileStore(os.environ["STORE_PATH"], 2)
        init(huge, store=store, rank=rank, world_size=2)
        x = torch.ones(10) * (rank + 1)
        dist.all_reduce(x)
        g = dist.new_group([0, 1], timeout=huge)
        y = torch.ones(10) * (rank + 1)
        dist.all_reduce(y, group=g)
        dist.barrier(group=g)
        report(ok=torch.equal(x, torch.full((10,), 3.0)) and torch.equal(y, torch.full((10,), 3.0)))
    dist.destroy_process_group()
""")

# Starts both ranks (inside whatever mount namespace it runs in) and prints
# their RESULT lines, or their output when a rank printed none.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    script, scenario, envs = sys.argv[1], sys.argv[2], sys.argv[3:]
    procs = []
    for rank, extra in enumerate(envs):
        env = dict(os.environ, RANK=str(rank))
        env.update(kv.split("=", 1) for kv in extra.split(",") if kv)
        # OWN_SHM=1: this rank alone gets a /dev/shm of its own (a mount namespace).
        own = ["unshare", "--mount", "sh", "-c",
               'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"'] if env.get("OWN_SHM") else []
        procs.append(subprocess.Popen([*own, sys.executable, script, scenario], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=150)
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        print(lines[-1] if lines else f"NORESULT rank {rank} exit {p.returncode}: {out[-3000:]!r}", flush=True)
""")


@pytest.fixture(autouse=True)
def _only_for_tccomm():
    if _harness.BACKEND != "tccomm":
        pytest.skip(f"tests tccomm's shared memory; the suite is validating {_harness.BACKEND!r}")


def _write_scripts(tmp_path):
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    (tmp_path / "launch.py").write_text(LAUNCHER)
    return str(tmp_path / "rank.py"), str(tmp_path / "launch.py")


def _world(tmp_path, scenario, rank_envs, prefix=(), env_extra=None):
    """Runs both ranks of `scenario`; rank_envs: "K=V,K=V" per rank.
    Returns each rank's result (a dict)."""
    rank_py, launch_py = _write_scripts(tmp_path)
    env = dict(os.environ)
    for k in ("TCCOMM_TRANSPORT", "TCCOMM_SHM_SMALL_BYTES", "TCCOMM_SHM_WINDOW_BYTES"):
        env.pop(k, None)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_group.free_port()), WORLD_SIZE="2",
               STORE_PATH=str(tmp_path / "store"), PYTHONFAULTHANDLER="1")
    env.update(env_extra or {})
    cmd = [*prefix, sys.executable, launch_py, rank_py, scenario, *rank_envs]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=TIMEOUT, env=env, cwd=str(tmp_path))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario}: the ranks did not finish within {TIMEOUT} s (hang?):\n{e.stdout}",
                    pytrace=False)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    if len(results) != 2:
        pytest.fail(f"{scenario}: not every rank reported (exit {proc.returncode}):\n{proc.stdout[-6000:]}",
                    pytrace=False)
    return sorted(results, key=lambda r: r["rank"])


def _small_shm_prefix():
    """The command prefix that runs the launcher in a private mount namespace
    with a 1 MiB /dev/shm, or a pytest skip saying why it cannot."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    mount = "mount -t tmpfs -o size=1m tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", mount], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here (needs root or CAP_SYS_ADMIN): "
                    f"{probe.stdout.strip()}")
    return ["unshare", "--mount", "sh", "-c", mount + ' && exec "$0" "$@"']


def test_small_dev_shm_fails_at_init_on_every_rank(tmp_path):
    results = _world(tmp_path, "small_shm", ["", ""], prefix=_small_shm_prefix())
    for res in results:
        assert "raised" in res, f"rank {res['rank']} created a group on a 1 MiB /dev/shm: {res}"
        msg = res["msg"]
        assert "cannot reserve" in msg and "bytes free" in msg, msg
        assert "TCCOMM_TRANSPORT=tcp" in msg and "/dev/shm" in msg, msg
        assert f"(rank {res['rank']})" in msg, msg
        # Group timeout 60 s: failing at setup means within seconds.
        assert res["secs"] < 15, f"rank {res['rank']} raised after {res['secs']:.1f} s: {msg}"
    assert "rank 0 could not create the shared-memory segment" in results[1]["msg"], results[1]["msg"]


def test_ranks_without_a_shared_dev_shm_use_tcp(tmp_path):
    """Same host, but rank 1 has a /dev/shm of its own (as in separate
    containers): the group must not try shared memory (rank 0's segment
    would never appear to rank 1) and works over TCP."""
    _small_shm_prefix()  # skips where mount namespaces cannot be made
    results = _world(tmp_path, "separate_shm", ["", "OWN_SHM=1"])
    for res in results:
        assert res.get("ok") is True, res
        assert res["shm_maps"] == 0, f"rank {res['rank']} maps shared memory: {res}"


def test_small_dev_shm_with_tcp_works(tmp_path):
    results = _world(tmp_path, "small_shm", ["", ""], prefix=_small_shm_prefix(),
                     env_extra={"TCCOMM_TRANSPORT": "tcp"})
    for res in results:
        assert res.get("ok") is True, res


@pytest.mark.parametrize("envs", [
    ["TCCOMM_SHM_SMALL_BYTES=0,TCCOMM_SHM_WINDOW_BYTES=65536",
     "TCCOMM_SHM_SMALL_BYTES=65536,TCCOMM_SHM_WINDOW_BYTES=1048576"],
    ["TCCOMM_SHM_SMALL_BYTES=65536,TCCOMM_SHM_WINDOW_BYTES=1048576",
     "TCCOMM_SHM_SMALL_BYTES=0,TCCOMM_SHM_WINDOW_BYTES=65536"],
], ids=["rank0-small", "rank0-large"])
def test_ranks_with_different_shm_tunables_agree(tmp_path, envs):
    results = _world(tmp_path, "thresholds", envs, env_extra={"TCCOMM_TRANSPORT": "shm"})
    for res in results:
        assert "raised" not in res, res
        assert res["ok"] is True, f"rank {res['rank']}: results differ from torch's for {res['bad']}"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("scenario", ["timedelta_max", "days"])
def test_huge_timeouts_mean_no_timeout(tmp_path, scenario, transport):
    results = _world(tmp_path, scenario, ["", ""], env_extra={"TCCOMM_TRANSPORT": transport})
    for res in results:
        assert "raised" not in res, f"rank {res['rank']}: {res}"
        assert res["ok"] is True, res
