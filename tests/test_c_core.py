"""The C core's own unit tests (csrc/c_core/tests, no torch involved), run
through `make -C csrc/c_core test` so that the one pytest command covers them.
(.ci/run also runs them under AddressSanitizer + UBSan: `make ... asan`.)"""

import os
import re
import shutil
import subprocess

import pytest

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "c_core")
TIMEOUT = int(os.environ.get("TCCOMM_TEST_C_TIMEOUT", "900"))


def test_c_core_unit_tests():
    if not os.path.exists(os.path.join(CORE, "Makefile")):
        pytest.fail(f"{CORE}/Makefile is missing", pytrace=False)
    if shutil.which("make") is None:
        pytest.skip("`make` is not installed, so the C unit tests cannot be built")
    try:
        proc = subprocess.run(["make", "-C", CORE, "test"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        pytest.fail(f"`make -C csrc/c_core test` did not finish within {TIMEOUT} s:\n"
                    + "\n".join(out.splitlines()[-40:]), pytrace=False)
    lines = proc.stdout.splitlines()
    summary = [ln for ln in lines if re.search(r"\d+ passed, \d+ failed", ln)]
    tests = [ln[3:] for ln in lines if ln.startswith("== ")]
    text = (summary[-1] if summary else "(no summary line)") + \
        (f" -- {', '.join(os.path.basename(t) for t in tests)}" if tests else "")
    conftest.SUMMARIES.append(f"make -C csrc/c_core test: {text}")
    if proc.returncode != 0:
        pytest.fail(f"`make -C csrc/c_core test` failed (exit {proc.returncode}):\n"
                    + "\n".join(lines[-60:]), pytrace=False)
    assert summary, "the C test run printed no 'N passed, M failed' summary"
    m = re.search(r"(\d+) passed, (\d+) failed", summary[-1])
    assert int(m.group(1)) > 0 and int(m.group(2)) == 0, summary[-1]
