"""Packaging: the wheel, and the extension's refusal to load under another torch.

* test_wheel_installs_and_runs_example: builds the wheel the way the README
  says (pip wheel --no-build-isolation --no-deps) from a copy of the source
  tree, installs it into a fresh venv next to this environment's torch, and
  runs examples/allreduce.py there on 2 ranks, every rank importing the
  wheel's copy of torchcomm_backend. A few minutes (a whole build) on 2 cores;
  TCCOMM_TEST_WHEEL=0 skips it.
* the shim-unit test: setup.py refuses a csrc/*.cpp that csrc/shim.cpp leaves out.
* the torch-mismatch tests: the extension's import guard, checked by faking
  the running torch's version in a subprocess (no other torch is installed).
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import _group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The site-packages this environment's torch lives in.
TORCH_SITE = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
BUILD_TIMEOUT = 1500
RUN_TIMEOUT = 300

HAVE = (str(torch.__version__), torch.version.cuda, bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def _run(cmd, timeout, **kwargs):
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s:\n{e.stdout}", pytrace=False)
    return proc


def _check(cmd, timeout, **kwargs):
    proc = _run(cmd, timeout, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-8000:]}", pytrace=False)
    return proc.stdout


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "TCCOMM_TRANSPORT")
           and not k.startswith("PYTEST")}
    env.update(extra)
    return env


# Not copied into the build's source tree: what a fresh clone does not have
# (build outputs, environments, caches, the generated _build_torch.py).
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", "*.so", "*.o", "*.a", "_build_torch.py", "results",
                                     "shared")


def _torch_view(dest):
    """A directory that shows this environment's site-packages (torch and
    everything it imports) without any trace of tccomm's development
    install: one symlink per entry, leaving out torchcomm_backend*, the
    editable install's __editable__* finder and every .pth file.

    A fresh venv gets it through a .pth line, which only appends the
    directory to sys.path (.pth files inside it are not run), after the
    venv's own site-packages. So the venv imports torch from here without
    downloading or copying gigabytes, but torchcomm_backend, its metadata and
    its entry points come only from the wheel installed into the venv."""
    os.makedirs(dest)
    for name in os.listdir(TORCH_SITE):
        low = name.lower()
        if low.startswith(("torchcomm_backend", "__editable__")) or low.endswith(".pth"):
            continue
        os.symlink(os.path.join(TORCH_SITE, name), os.path.join(dest, name))
    return dest


# Every rank runs the example through this: it checks first that this rank
# imports torchcomm_backend (and, at init, its extension) from the fresh venv.
_RANK_WRAPPER = """\
import os, runpy, sys
import torch, torchcomm_backend
venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(torchcomm_backend.__file__)
assert where.startswith(venv + os.sep), f"torchcomm_backend from {where}, not from {venv}"
sys.argv = sys.argv[2:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    ext = sys.modules.get("torchcomm_backend._C")
    assert ext is not None, "the extension was never loaded"
    assert os.path.realpath(ext.__file__).startswith(venv + os.sep), ext.__file__
    print(f"rank {os.environ['RANK']} imported {where} and {os.path.realpath(ext.__file__)}", flush=True)
"""


@pytest.mark.skipif(os.environ.get("TCCOMM_TEST_WHEEL", "1") == "0",
                    reason="TCCOMM_TEST_WHEEL=0: the wheel build (a few minutes) was not asked for")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tccomm builds on Linux only")
@pytest.mark.skipif(shutil.which("make") is None, reason="no make: the C core cannot be built")
def test_wheel_installs_and_runs_example(tmp_path):
    # 1. The wheel, from a copy of the source tree: the build shares no
    #    output with the checkout's own build (csrc/c_core/build, build/).
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE, symlinks=True)
    wheels = tmp_path / "wheels"
    _check([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-build-isolation",
            "--no-deps", "--no-index", "-q", "-w", str(wheels), str(src)], BUILD_TIMEOUT, cwd=tmp_path,
           env=_clean_env())
    (wheel,) = [str(p) for p in wheels.glob("torchcomm_backend-*.whl")]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("torchcomm_backend/_build_torch.py").decode()
    assert any(re.fullmatch(r"torchcomm_backend/_C\..*\.so", n) for n in names), names
    assert f"VERSION = {str(torch.__version__)!r}" in record, record
    assert f"CUDA = {torch.version.cuda!r}" in record, record

    # 2. A fresh venv that sees this environment's torch (see _torch_view)
    #    and the wheel, installed from the file (nothing is downloaded).
    venv = tmp_path / "venv"
    _check([sys.executable, "-m", "venv", str(venv)], RUN_TIMEOUT, env=_clean_env())
    py = str(venv / "bin" / "python")
    site = _check([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  RUN_TIMEOUT, env=_clean_env()).strip()
    with open(os.path.join(site, "torch_site.pth"), "w") as f:
        f.write(_torch_view(str(tmp_path / "torch_site")) + "\n")
    _check([py, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-deps", "--no-index",
            wheel], RUN_TIMEOUT, env=_clean_env())

    # 3. The example on 2 ranks, under torchrun, run from a directory that
    #    holds no torchcomm_backend (the launcher imports from its cwd too).
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    wrapper = run_dir / "rank.py"
    wrapper.write_text(_RANK_WRAPPER)
    out = _check([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(_group.free_port()), str(wrapper), str(venv),
                  str(src / "examples" / "allreduce.py")], RUN_TIMEOUT, cwd=run_dir, env=_clean_env())
    found = re.findall(r"rank (\d)/2 backend=tccomm: 8 collectives, (OK|FAILED)", out)
    assert sorted(found) == [("0", "OK"), ("1", "OK")], out
    assert len(re.findall(r"rank \d imported ", out)) == 2, out


# ---- the shim as one unit (csrc/shim.cpp) ----

def test_shim_file_left_out_of_the_unit_is_refused(tmp_path):
    """The shim compiles as one unit, csrc/shim.cpp: a csrc/*.cpp it does not
    include would build without it. setup.py refuses, naming the file (and
    accepts the tree as it is)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE, symlinks=True)
    ok = _run([sys.executable, "setup.py", "--name"], RUN_TIMEOUT, cwd=src, env=_clean_env())
    assert ok.returncode == 0 and "torchcomm_backend" in ok.stdout, ok.stdout[-3000:]
    for extra in ("csrc/extra_ops.cpp", "csrc/cuda/extra_cuda.cpp"):
        (src / extra).write_text("// not in shim.cpp\n")
        proc = _run([sys.executable, "setup.py", "--name"], RUN_TIMEOUT, cwd=src, env=_clean_env())
        assert proc.returncode != 0, proc.stdout[-3000:]
        assert f"{extra} not included by csrc/shim.cpp" in proc.stdout, proc.stdout[-3000:]
        (src / extra).unlink()


# ---- the torch-mismatch guard (torchcomm_backend/_extension.py) ----

def _load_with(patch):
    """Loads the extension in a fresh interpreter after `patch` changed what
    torch says it is; the outcome as "OK" or "ImportError: <message>"."""
    code = f"""
import sys
import torch
{patch}
import torchcomm_backend
try:
    torchcomm_backend.load_extension()
except ImportError as e:
    print("ImportError:", e)
    assert "torchcomm_backend._C" not in sys.modules, "_C was imported anyway"
else:
    print("OK")
"""
    proc = _run([sys.executable, "-c", code], RUN_TIMEOUT, cwd=ROOT, env=_clean_env())
    assert proc.returncode == 0, proc.stdout
    return proc.stdout.strip().splitlines()[-1]


def _built_for():
    from torchcomm_backend import _build_torch as b

    return b.VERSION, b.CUDA, b.CXX11_ABI


def test_matching_torch_loads():
    assert _built_for() == HAVE, "the checkout's build is for another torch: rebuild it"
    assert _load_with("") == "OK"


def _assert_refused(out, have_text):
    version, cuda, _ = _built_for()
    assert out.startswith("ImportError: torchcomm_backend._C was built for torch "
                          f"{version} ({f'CUDA {cuda}' if cuda else 'CPU only'}"), out
    assert f"but this environment has {have_text}" in out, out
    assert "pip install --no-build-isolation -e ." in out, out
    assert "pip wheel --no-build-isolation --no-deps" in out, out


def test_other_torch_version_is_refused():
    out = _load_with("torch.__version__ = '2.0.0'")
    _assert_refused(out, "torch 2.0.0 (")


def test_other_cuda_version_is_refused():
    out = _load_with("torch.version.cuda = None" if torch.version.cuda else "torch.version.cuda = '12.1'")
    _assert_refused(out, f"torch {torch.__version__} ({'CPU only' if torch.version.cuda else 'CUDA 12.1'}")


def test_other_cxx_abi_is_refused():
    out = _load_with(f"torch._C._GLIBCXX_USE_CXX11_ABI = {not HAVE[2]}")
    _assert_refused(out, f"torch {torch.__version__} (")
    assert ("pre-C++11 ABI)" if HAVE[2] else "C++11 ABI)") in out.split("this environment has")[1], out


def test_missing_build_record_is_refused():
    out = _load_with("sys.modules['torchcomm_backend._build_torch'] = None")
    assert out.startswith("ImportError: torchcomm_backend._C cannot be checked against this torch"), out
    assert "pip install --no-build-isolation -e ." in out, out


def test_refusal_reaches_init_process_group(tmp_path):
    """What a user sees: init_process_group("tccomm") fails with the message."""
    code = f"""
import torch, torch.distributed as dist
torch.__version__ = '2.0.0'
try:
    dist.init_process_group("tccomm", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
except Exception as e:
    print(type(e).__name__, e)
else:
    print("no error")
"""
    proc = _run([sys.executable, "-c", code], RUN_TIMEOUT, cwd=ROOT, env=_clean_env())
    assert "this environment has torch 2.0.0" in proc.stdout, proc.stdout
