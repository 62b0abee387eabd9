"""scripts/gpu_acceptance.sh, the one command that accepts the CUDA path on a
machine with GPUs, checked where it can be without one: its answer without a
GPU, and how it reports a venv that is not ready (torch sees no GPU, or the
check's process crashes), with a stand-in nvidia-smi that lists one GPU."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_acceptance.sh")
VENV = os.path.dirname(os.path.dirname(sys.executable))

pytestmark = pytest.mark.skipif(os.path.isdir("/proc/driver/nvidia/gpus"),
                                reason="this machine has an NVIDIA driver: the no-GPU answers cannot be checked")


def run(tmp_path, *args, fake_gpus=0):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if fake_gpus:
        smi = bin_dir / "nvidia-smi"
        lines = "\n".join(f"GPU {i}: Stand-in GPU (UUID: GPU-{i})" for i in range(fake_gpus))
        smi.write_text(f'#!/bin/sh\nif [ "$1" = -L ]; then printf "%s\\n" "{lines}"; else echo stand-in; fi\n')
        smi.chmod(0o755)
    # Only the stand-in (or no) nvidia-smi is found: PATH without any real one.
    path = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = path
    proc = subprocess.run(["bash", SCRIPT, "--out-dir", str(tmp_path / "out"), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return proc.returncode, proc.stdout


def test_no_gpu_is_said_at_once(tmp_path):
    if os.path.exists("/usr/bin/nvidia-smi") or os.path.exists("/bin/nvidia-smi"):
        pytest.skip("nvidia-smi is installed here: the no-GPU answer cannot be checked")
    code, out = run(tmp_path)
    assert code == 2 and "no GPU: nothing to accept" in out, out
    code, out = run(tmp_path, "--allow-no-gpu")
    assert code == 0 and "no GPU: nothing to accept" in out, out


def test_torch_seeing_no_gpu_fails_the_environment(tmp_path):
    code, out = run(tmp_path, "--venv", VENV, "--skip-tests", "--skip-bench", fake_gpus=1)
    assert code == 1, out
    env_row = next(ln for ln in out.splitlines() if ln.startswith("| environment"))
    assert "FAIL" in env_row and "torch sees none" in env_row, out


def test_a_crashing_check_is_named(tmp_path):
    """The check imports torch and calls into the extension; a process that
    dies there (a segfault, e.g. a shim built by a C++ compiler whose
    libstdc++ is not the one loaded) is reported with its signal, not as an
    empty failure."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\ncat > /dev/null\nkill -SEGV $$\n")
    py.chmod(0o755)
    code, out = run(tmp_path, "--venv", str(venv), "--skip-tests", "--skip-bench", fake_gpus=1)
    assert code == 1, out
    env_row = next(ln for ln in out.splitlines() if ln.startswith("| environment"))
    assert "FAIL" in env_row and "killed by signal 11" in env_row, out


def test_build_into_needs_a_venv(tmp_path):
    """--build-into builds the checkout into a venv that exists (for a
    machine without network access); a directory without a Python is a
    usage error, found before anything is built."""
    code, out = run(tmp_path, "--build-into", str(tmp_path / "nowhere"), fake_gpus=1)
    assert code == 64 and "--build-into" in out and "there is no" in out, out
