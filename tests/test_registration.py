"""Registration and single-process use, each in a fresh interpreter:
the torch.backends entry point registers "tccomm" inside `import torch`
(cheaply: the native extension is not loaded until a group is created),
`import torchcomm_backend` registers it explicitly, and a world of one
works through the entry point alone, exiting cleanly."""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

import _harness

TIMEOUT = 120


def run_py(code: str, env_extra=None, timeout=TIMEOUT):
    env = dict(os.environ)
    env.pop("TCCOMM_TRANSPORT", None)
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(env_extra or {})
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=env,
                              cwd=tempfile.gettempdir())  # the installed package, not ./
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the subprocess did not finish within {timeout} s (hang?):\n{e.stdout}",
                    pytrace=False)
    return proc


def check(proc):
    if proc.returncode != 0:
        pytest.fail(f"subprocess failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}",
                    pytrace=False)
    return proc.stdout


@pytest.fixture(autouse=True)
def _only_for_tccomm():
    if _harness.BACKEND != "tccomm":
        pytest.skip(f"tests tccomm's registration; the suite is validating "
                    f"{_harness.BACKEND!r}")


def test_entry_point_registers_on_import_torch():
    out = check(run_py("""
        import sys, torch, torch.distributed as dist
        assert "tccomm" in dist.Backend.backend_list, dist.Backend.backend_list
        assert dist.is_backend_available("tccomm")
        assert "torchcomm_backend._C" not in sys.modules, \\
            "import torch loaded the native extension (registration must stay cheap)"
        print("OK")
    """))
    assert "OK" in out


def test_explicit_import_registers():
    out = check(run_py("""
        import torch, torch.distributed as dist
        import torchcomm_backend
        assert "tccomm" in dist.Backend.backend_list, dist.Backend.backend_list
        print("OK", torchcomm_backend.__version__)
    """, env_extra={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}))
    assert "OK" in out


def test_import_package_before_torch():
    """`import torchcomm_backend` as a script's very first import (the entry
    point then runs while the package itself is still being imported)."""
    out = check(run_py("""
        import torchcomm_backend
        import torch.distributed as dist
        assert "tccomm" in dist.Backend.backend_list, dist.Backend.backend_list
        print("OK")
    """))
    assert "OK" in out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_world_of_one(tmp_path, transport):
    """init_process_group("tccomm") without importing torchcomm_backend, a
    world of one, every op is the identity; then a normal interpreter exit."""
    env = {"TCCOMM_TRANSPORT": "tcp"} if transport == "tcp" else {}
    out = check(run_py(f"""
        import torch, torch.distributed as dist
        dist.init_process_group("tccomm", init_method="file://{tmp_path}/store",
                                rank=0, world_size=1)
        assert dist.get_backend() == "tccomm"
        x = torch.arange(10, dtype=torch.float32)
        t = x.clone(); dist.all_reduce(t); assert torch.equal(t, x), t
        t = x.clone(); dist.all_reduce(t, op=dist.ReduceOp.AVG); assert torch.equal(t, x), t
        dist.broadcast(t, src=0); assert torch.equal(t, x)
        outs = [torch.zeros(10)]; dist.all_gather(outs, x); assert torch.equal(outs[0], x)
        o = torch.zeros(10); dist.all_gather_into_tensor(o, x); assert torch.equal(o, x)
        o = torch.zeros(10); dist.reduce_scatter_tensor(o, x); assert torch.equal(o, x)
        o = torch.zeros(10); dist.all_to_all_single(o, x); assert torch.equal(o, x)
        objs = [None]; dist.all_gather_object(objs, {{"a": 1}}); assert objs == [{{"a": 1}}]
        dist.barrier()
        dist.destroy_process_group()
        print("OK")
    """, env_extra=env))
    assert "OK" in out


def _creation_error(tmp_path, env_extra) -> str:
    """What creating a one-rank group prints under env_extra: "RAISED <type>
    <message>", or "NO ERROR"."""
    proc = run_py(f"""
        import torch, torch.distributed as dist
        try:
            dist.init_process_group("tccomm", init_method="file://{tmp_path}/store",
                                    rank=0, world_size=1)
        except Exception as e:
            print("RAISED", type(e).__name__, e)
        else:
            print("NO ERROR")
    """, env_extra=env_extra)
    check(proc)
    return proc.stdout


def test_bad_transport_value_is_a_clear_error(tmp_path):
    """TCCOMM_TRANSPORT with an unknown value fails group creation with an
    error that names the variable (no crash, no silent fallback)."""
    out = _creation_error(tmp_path, {"TCCOMM_TRANSPORT": "carrier-pigeon"})
    assert "RAISED" in out and "TCCOMM_TRANSPORT" in out, out


def test_bad_hier_overlap_value_is_a_clear_error(tmp_path):
    """TCCOMM_HIER_OVERLAP with an unknown value fails group creation with an
    error that names the variable and the values it takes."""
    out = _creation_error(tmp_path, {"TCCOMM_HIER_OVERLAP": "sometimes"})
    assert "RAISED" in out, out
    assert "TCCOMM_HIER_OVERLAP='sometimes' is not one of auto, 0, 1" in out, out


@pytest.mark.parametrize("name, value, allowed", [
    ("TCCOMM_CMA", "off", "0, 1"),
    ("TCCOMM_CPU_MOVE", "no", "0, 1"),
    ("TCCOMM_STREAM_ONE_SIDED", "false", "0, 1"),
    ("TCCOMM_REDUCE_ISA", "avx512", "generic"),
    ("TCCOMM_ASYNC_ERROR_HANDLING", "yes", "0, 1, 2, 3"),
])
def test_bad_switch_value_is_a_clear_error(tmp_path, name, value, allowed):
    """An on/off switch of the environment with a value none of its readers
    knows fails group creation naming the variable and its values, instead
    of meaning the default."""
    out = _creation_error(tmp_path, {name: value})
    assert "RAISED" in out, out
    assert f"{name}='{value}' is not one of {allowed}" in out, out
