#!/usr/bin/env bash
# Acceptance of tccomm's CUDA path on a Linux machine with 1 or more NVIDIA
# GPUs, in one command: build, GPU tests, benchmarks against nccl, summary.
#
#   scripts/gpu_acceptance.sh [options]
#
#   --venv DIR        use this existing venv as it is (no build; the checkout's
#                     torchcomm_backend/_C*.so must be built for its torch)
#   --build-into DIR  build the checkout into this existing venv, against the
#                     torch it has (pip install --no-build-isolation --no-deps
#                     -e .: nothing is downloaded, for a machine without
#                     network access; the venv needs setuptools>=64 and ninja)
#   --new-venv DIR    where the fresh venv is built
#                     (default bench/results/gpu_acceptance_venv, replaced)
#   --out-dir DIR     logs, JUnit XML, benchmark CSVs, summary.txt
#                     (default bench/results/gpu_acceptance_<time>)
#   --max-bytes SIZE  largest message of the sweep (default 256M)
#   --quick           short benchmark (sizes up to 1 MiB, short timing)
#   --skip-tests      no pytest run
#   --skip-bench      no benchmark run
#   --allow-no-gpu    without a GPU, exit 0 instead of 2
#
#   TORCH_SPEC, PYTHON  passed to scripts/setup_env.sh (the torch to install
#                       must be a CUDA build; setup_env.sh's default is one)
#
# Steps (each prints the command it runs; every output is also in --out-dir):
#  1. GPUs: counted with nvidia-smi (or /proc/driver/nvidia/gpus), honouring
#     CUDA_VISIBLE_DEVICES. None: "no GPU: nothing to accept", exit 2 (0 with
#     --allow-no-gpu), before anything is built.
#  2. A fresh venv built from source with scripts/setup_env.sh (unless
#     --venv), then checked: a CUDA torch, tccomm built with its CUDA path,
#     torch sees the GPUs.
#  3. The GPU tests: pytest tests/test_cuda.py, tests/test_funcol_cuda.py (if
#     present) and every test of tests/ whose name says cuda or gpu
#     (-k "cuda or gpu"; GPU tests skip themselves, with the reason, where
#     they need more GPUs than there are). Where the ranks of a test run is
#     the test's own choice.
#  4. bench/bench_collectives.py --device cuda (tccomm against nccl):
#     a. the host time per eager dist.all_reduce(..., async_op=True) call on
#        a small CUDA tensor, at world size 1 (--host-only; any GPU count);
#     b. the nccl-tests style sweep (8 B .. --max-bytes, powers of two, every
#        op, time, algbw, busbw), one rank per GPU: needs 2 GPUs or more.
#        With one GPU it is skipped: NCCL refuses two ranks of a communicator
#        on one GPU (duplicate GPU), and the socket workaround the benchmark
#        offers for that (--worlds 2 on one GPU) measures sockets, not GPUs;
#     c. bench/bench_funcol.py --device cuda --worlds 1 (information only).
#  5. The summary table: tests passed / failed / skipped, busbw ratio
#     tccomm / nccl at the largest size (target: within 2%), host time per
#     eager call tccomm / nccl (target: at most 0.7x).
#
# Exit code: 0 when the tests passed (benchmark targets are reported, never
# enforced); 1 when a test failed, the build or the environment check failed,
# or bench_collectives.py could not complete (a rank failed or a result was
# wrong); 2 no GPU (without --allow-no-gpu); 64 bad usage.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CALLER_DIR=$PWD
cd "$ROOT" || exit 1

usage() {
  sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}
absolute() {  # a path given on the command line, relative to where the script was started
  case $1 in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$CALLER_DIR/$1" ;;
  esac
}
die_usage() {
  echo "gpu_acceptance.sh: $*" >&2
  echo "(scripts/gpu_acceptance.sh --help for the options)" >&2
  exit 64
}

VENV=
BUILD_INTO=
VENV_OPT=--venv
NEW_VENV=$ROOT/bench/results/gpu_acceptance_venv
OUT=$ROOT/bench/results/gpu_acceptance_$(date +%Y%m%d-%H%M%S)
MAX_BYTES=256M
QUICK=0
SKIP_TESTS=0
SKIP_BENCH=0
ALLOW_NO_GPU=0
while [ $# -gt 0 ]; do
  case $1 in
    --venv) [ $# -ge 2 ] || die_usage "--venv needs a directory"; VENV=$(absolute "$2"); shift ;;
    --build-into) [ $# -ge 2 ] || die_usage "--build-into needs a directory"; VENV=$(absolute "$2"); BUILD_INTO=1; VENV_OPT=--build-into; shift ;;
    --new-venv) [ $# -ge 2 ] || die_usage "--new-venv needs a directory"; NEW_VENV=$(absolute "$2"); shift ;;
    --out-dir) [ $# -ge 2 ] || die_usage "--out-dir needs a directory"; OUT=$(absolute "$2"); shift ;;
    --max-bytes) [ $# -ge 2 ] || die_usage "--max-bytes needs a size"; MAX_BYTES=$2; shift ;;
    --quick) QUICK=1 ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --skip-bench) SKIP_BENCH=1 ;;
    --allow-no-gpu) ALLOW_NO_GPU=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die_usage "unknown argument: $1" ;;
  esac
  shift
done
[[ $MAX_BYTES =~ ^[0-9]+[KkMmGg]?[Bb]?$ ]] || die_usage "--max-bytes $MAX_BYTES: expected e.g. 64M, 1G, 4096"

# ---- 1. GPUs (before anything is built) -----------------------------------------

count_gpus() {  # prints "<count> <how it was counted>"
  local n=0 how
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    how="nvidia-smi -L"
  elif [ -d /proc/driver/nvidia/gpus ]; then
    n=$(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 | wc -l)
    how="/proc/driver/nvidia/gpus (no nvidia-smi)"
  else
    how="no nvidia-smi and no /proc/driver/nvidia/gpus (no NVIDIA driver)"
  fi
  if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
    local v=${CUDA_VISIBLE_DEVICES// /} k
    if [ -z "$v" ] || [ "${v#-}" != "$v" ]; then
      n=0
    else
      k=$(awk -F, '{print NF}' <<<"$v")
      [ "$k" -lt "$n" ] && n=$k
    fi
    how="$how, CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'"
  fi
  echo "$n $how"
}

read -r NGPU GPU_HOW < <(count_gpus)
echo "== GPUs: $NGPU ($GPU_HOW)"
if [ "$NGPU" -eq 0 ]; then
  echo "no GPU: nothing to accept"
  if [ "$ALLOW_NO_GPU" -eq 1 ]; then
    exit 0
  fi
  echo "(exit code 2; --allow-no-gpu makes it 0)"
  exit 2
fi

if [ -n "$VENV" ]; then
  [ -x "$VENV/bin/python" ] || die_usage "$VENV_OPT $VENV: there is no $VENV/bin/python"
elif [ -e "$NEW_VENV" ] && [ ! -f "$NEW_VENV/pyvenv.cfg" ]; then
  die_usage "--new-venv $NEW_VENV exists and is not a venv (no pyvenv.cfg): not deleting it"
fi

mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
echo "== output: $OUT"

run_logged() {  # LOG CMD...: prints the command, runs it (output to the terminal and LOG), returns its status
  local log=$1
  shift
  { printf '+'; printf ' %q' "$@"; printf '\n'; } | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  return "${PIPESTATUS[0]}"
}

if command -v nvidia-smi >/dev/null 2>&1; then
  run_logged "$OUT/env.log" nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  run_logged "$OUT/env.log" nvidia-smi topo -m
fi

# ---- 2. venv ---------------------------------------------------------------------

BUILD_RC=0
BUILT=0
if [ -n "$VENV" ] && [ -n "$BUILD_INTO" ]; then
  VENV=$(cd "$VENV" && pwd)
  echo "== building tccomm into the existing venv $VENV (its torch as it is)"
  BUILT=1
  rm -rf "$ROOT"/torchcomm_backend/_C*.so "$ROOT/torchcomm_backend/_build_torch.py"
  # TORCH_DEVICE_BACKEND_AUTOLOAD=0: `import torch` in the build must not
  # load a tccomm installed there before.
  run_logged "$OUT/build.log" env TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -m pip install -q \
    --disable-pip-version-check --no-build-isolation --no-deps -e "$ROOT"
  BUILD_RC=$?
  if [ "$BUILD_RC" -eq 0 ]; then
    BUILD_DESC="existing venv $VENV, tccomm built into it from source"
  else
    BUILD_DESC="building into $VENV FAILED (exit code $BUILD_RC; $OUT/build.log)"
  fi
elif [ -n "$VENV" ]; then
  VENV=$(cd "$VENV" && pwd)
  BUILD_DESC="existing venv $VENV (not rebuilt)"
  echo "== using $BUILD_DESC"
else
  VENV=$NEW_VENV
  if [ -e "$VENV" ]; then
    echo "== removing the previous $VENV (a fresh venv is built)"
    rm -rf "$VENV"
  fi
  echo "== building a fresh venv: $VENV"
  BUILT=1
  run_logged "$OUT/build.log" "$ROOT/scripts/setup_env.sh" "$VENV"
  BUILD_RC=$?
  if [ "$BUILD_RC" -eq 0 ]; then
    BUILD_DESC="fresh venv $VENV, built from source"
  else
    BUILD_DESC="scripts/setup_env.sh $VENV FAILED (exit code $BUILD_RC; $OUT/build.log)"
  fi
fi
PY=$VENV/bin/python

ENV_PROBLEM=
ENV_DESC=
if [ "$BUILD_RC" -eq 0 ]; then
  echo "== checking the venv: CUDA torch, tccomm's CUDA path, GPUs visible to torch"
  printf '+ %s\n' "$PY - (torch and torchcomm_backend.build_info())"
  ENV_INFO=$("$PY" - "$NGPU" 2>&1 <<'PY'
# Prints GPUS=, DESC=, PROBLEM= lines (anything else, e.g. a warning, is only logged).
import sys

listed = int(sys.argv[1])
try:
    import torch
except Exception as e:  # noqa: BLE001
    print(f"GPUS=0\nDESC=torch does not import\nPROBLEM=torch does not import: {type(e).__name__}: {e}")
    sys.exit(0)
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
problem = ""
build = {}
try:
    import torchcomm_backend
    build = torchcomm_backend.build_info()
except Exception as e:  # noqa: BLE001
    problem = (f"torchcomm_backend does not import ({type(e).__name__}: {e}); a venv given with --venv "
               "needs the checkout built for its torch (scripts/setup_env.sh VENV)")
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else "none"
names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
print(f"GPUS={gpus}")
print(f"DESC={gpus} x {', '.join(names) or 'no GPU'}; torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), NCCL {nccl}")
if not problem:
    if torch.version.cuda is None:
        problem = f"torch {torch.__version__} is a CPU-only build: install a CUDA build (TORCH_SPEC)"
    elif not build.get("cuda"):
        problem = f"tccomm was built without its CUDA path: {build}"
    elif gpus == 0:
        problem = (f"the driver lists {listed} GPU(s) but torch sees none "
                   f"(torch's CUDA {torch.version.cuda} too new for the driver?)")
print(f"PROBLEM={problem}")
PY
)
  ENV_RC=$?
  printf '%s\n' "$ENV_INFO" | tee -a "$OUT/env.log"
  TORCH_GPUS=$(sed -n 's/^GPUS=//p' <<<"$ENV_INFO" | tail -n 1)
  ENV_DESC=$(sed -n 's/^DESC=//p' <<<"$ENV_INFO" | tail -n 1)
  ENV_PROBLEM=$(sed -n 's/^PROBLEM=//p' <<<"$ENV_INFO" | tail -n 1)
  if ! [[ ${TORCH_GPUS:-} =~ ^[0-9]+$ ]]; then
    if [ "$ENV_RC" -gt 128 ]; then
      # e.g. SIGSEGV at the first call into the extension: typically a shim
      # compiled by a C++ compiler whose libstdc++ is not the one the
      # process loads (build with that system's CC/CXX).
      ENV_PROBLEM="the check of the venv was killed by signal $((ENV_RC - 128)) (importing torch and calling torchcomm_backend.build_info()); was the extension built with another C++ compiler than the system's (CC/CXX)?"
    else
      ENV_PROBLEM="the check of the venv failed (exit code $ENV_RC): $(tail -n 1 <<<"$ENV_INFO")"
    fi
    TORCH_GPUS=0
  fi
  if [ -z "$ENV_PROBLEM" ]; then
    NGPU=$TORCH_GPUS
  fi
fi

# ---- 3. GPU tests -----------------------------------------------------------------

TEST_RC=-1          # -1: not run
HOST_RC=-1
SWEEP_RC=-1
FUNCOL_RC=-1
SWEEP_SKIP=
READY=0
[ "$BUILD_RC" -eq 0 ] && [ -z "$ENV_PROBLEM" ] && READY=1

if [ "$READY" -eq 1 ] && [ "$SKIP_TESTS" -eq 0 ]; then
  echo
  echo "== GPU tests ($NGPU GPU(s))"
  if [ "$NGPU" -eq 1 ]; then
    echo "   one GPU: single-rank cases run; a multi-rank case runs only where the test places"
    echo "   its ranks on one GPU itself (each rank posing as its own NCCL host: NCCL refuses two"
    echo "   ranks of one communicator on one GPU otherwise); cases needing a GPU per rank skip"
  fi
  TEST_FILES=(tests/test_cuda.py)
  if [ -f tests/test_funcol_cuda.py ]; then
    TEST_FILES+=(tests/test_funcol_cuda.py)
  else
    echo "   tests/test_funcol_cuda.py: not present, not run"
  fi
  run_logged "$OUT/pytest.log" "$PY" -m pytest -v -rfEs --junitxml="$OUT/pytest.xml" \
    "${TEST_FILES[@]}" tests -k "cuda or gpu"
  TEST_RC=$?
fi

# ---- 4. benchmarks ------------------------------------------------------------------

if [ "$READY" -eq 1 ] && [ "$SKIP_BENCH" -eq 0 ]; then
  QUICK_ARGS=()
  [ "$QUICK" -eq 1 ] && QUICK_ARGS=(--quick)
  echo
  echo "== benchmark: host time per eager all_reduce call, tccomm vs nccl (world size 1)"
  run_logged "$OUT/bench_host.log" "$PY" bench/bench_collectives.py --device cuda --host-only \
    --out-dir "$OUT/bench_host"
  HOST_RC=$?

  echo
  echo "== benchmark: nccl-tests style sweep, tccomm vs nccl, one rank per GPU"
  if [ "$NGPU" -ge 2 ]; then
    run_logged "$OUT/bench_sweep.log" "$PY" bench/bench_collectives.py --device cuda \
      --worlds "$NGPU" --max-bytes "$MAX_BYTES" ${QUICK_ARGS[@]+"${QUICK_ARGS[@]}"} \
      --out-dir "$OUT/bench_sweep"
    SWEEP_RC=$?
  else
    SWEEP_SKIP="skipped: needs 2 GPUs or more (one rank per GPU); NCCL refuses two ranks of one communicator on one GPU, and the benchmark's socket workaround (--worlds 2 on one GPU) measures sockets, not the GPU path"
    echo "   $SWEEP_SKIP" | tee -a "$OUT/bench_sweep.log"
  fi

  echo
  echo "== benchmark (information): host time per functional all_reduce call, tccomm vs nccl"
  run_logged "$OUT/bench_funcol.log" "$PY" bench/bench_funcol.py --device cuda --worlds 1
  FUNCOL_RC=$?
fi

# ---- 5. summary ---------------------------------------------------------------------

# The summary needs only the standard library: the venv's Python unless it
# is missing or the check above saw it die.
SUMMARY_PY=$PY
if [ ! -x "$SUMMARY_PY" ] || [ "${ENV_RC:-0}" -gt 128 ]; then
  SUMMARY_PY=${PYTHON:-python3}
fi
export OUT NGPU GPU_HOW BUILD_DESC ENV_DESC ENV_PROBLEM TEST_RC HOST_RC SWEEP_RC FUNCOL_RC SWEEP_SKIP \
  SKIP_TESTS SKIP_BENCH BUILD_RC
echo
"$SUMMARY_PY" - <<'PY' 2>&1 | tee "$OUT/summary.txt"
import csv
import glob
import os
import re
import xml.etree.ElementTree as ET

E = os.environ
out = E["OUT"]
rc = {k: int(E[k]) for k in ("TEST_RC", "HOST_RC", "SWEEP_RC", "FUNCOL_RC", "BUILD_RC")}
rows = []  # (item, result, target, verdict)


def read_csv(folder):
    files = sorted(glob.glob(os.path.join(out, folder, "bench_*.csv")))
    if not files:
        return []
    with open(files[-1]) as f:
        return list(csv.DictReader(f))


def ran(code, log):
    return "not run" if code == -1 else f"FAILED (exit code {code}; {log})"


rows.append(("GPUs", f"{E['NGPU']} ({E['GPU_HOW']})", "", ""))
rows.append(("build", E["BUILD_DESC"], "", "ok" if rc["BUILD_RC"] == 0 else "FAIL"))
if rc["BUILD_RC"] == 0:
    rows.append(("environment", "; ".join(x for x in (E["ENV_DESC"], E["ENV_PROBLEM"]) if x) or "-", "",
                 "FAIL" if E["ENV_PROBLEM"] else "ok"))

# tests
failed_names, skip_reasons = [], {}
junit = os.path.join(out, "pytest.xml")
if rc["TEST_RC"] == -1:
    why = "--skip-tests" if E["SKIP_TESTS"] == "1" else "the build or environment failed"
    rows.append(("GPU tests", f"not run ({why})", "all pass", "-" if why == "--skip-tests" else "FAIL"))
else:
    n = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                n["failed"] += 1
                failed_names.append(name)
            elif case.find("skipped") is not None:
                sk = case.find("skipped")
                if sk.get("type") == "pytest.xfail":
                    n["xfailed"] += 1
                else:
                    n["skipped"] += 1
                    msg = (sk.get("message") or "").strip()
                    skip_reasons[msg] = skip_reasons.get(msg, 0) + 1
            else:
                n["passed"] += 1
    text = f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"
    if n["xfailed"]:
        text += f", {n['xfailed']} xfailed"
    if rc["TEST_RC"] not in (0, 1):
        text += f" (pytest exit code {rc['TEST_RC']})"
    rows.append(("GPU tests (pytest -k 'cuda or gpu')", text, "all pass",
                 "PASS" if rc["TEST_RC"] == 0 else "FAIL"))

# benchmarks
if E["SKIP_BENCH"] == "1" or rc["HOST_RC"] == -1:
    why = "--skip-bench" if E["SKIP_BENCH"] == "1" else "the build or environment failed"
    rows.append(("benchmarks", f"not run ({why})", "", ""))
else:
    sweep = read_csv("bench_sweep")
    if E["SWEEP_SKIP"]:
        rows.append(("busbw tccomm / nccl, largest size",
                     "skipped: needs 2 GPUs or more (reason below)", "within 2%", "-"))
    elif rc["SWEEP_RC"] != 0 or not sweep:
        rows.append(("busbw tccomm / nccl, largest size",
                     ran(rc["SWEEP_RC"], os.path.join(out, "bench_sweep.log")), "within 2%", "FAIL"))
    else:
        ops = []
        for r in sweep:
            if r["op"] not in ops:
                ops.append(r["op"])
        for op in ops:
            pts = {(r["backend"], int(r["bytes"])): r for r in sweep if r["op"] == op}
            sizes = [b for (be, b) in pts if be == "tccomm" and ("nccl", b) in pts]
            if not sizes:
                continue
            big = max(sizes)
            t, c = pts[("tccomm", big)], pts[("nccl", big)]
            bt, bn = float(t["busbw_GBps"]), float(c["busbw_GBps"])
            ratio = bt / bn if bn > 0 else float("nan")
            ok = abs(ratio - 1) <= 0.02
            note = " (tccomm faster)" if ratio > 1.02 else ""
            size = f"{big >> 20} MiB" if big >= 1 << 20 else f"{big} B"
            rows.append((f"busbw {op}, {size}, {t['world']} ranks",
                         f"tccomm {bt:.2f} / nccl {bn:.2f} GB/s = {ratio:.3f}",
                         "within 2%", ("met" if ok else "NOT met") + note))
    host = {r["backend"]: float(r["time_us"]) for r in read_csv("bench_host")
            if r["op"] == "allreduce_host_time"}
    if rc["HOST_RC"] != 0 or "tccomm" not in host or "nccl" not in host:
        rows.append(("host time per eager all_reduce call",
                     ran(rc["HOST_RC"], os.path.join(out, "bench_host.log")), "<= 0.70x", "FAIL"))
    else:
        ratio = host["tccomm"] / host["nccl"]
        rows.append(("host time per eager all_reduce call",
                     f"tccomm {host['tccomm']:.2f} / nccl {host['nccl']:.2f} us = {ratio:.2f}x",
                     "<= 0.70x", "met" if ratio <= 0.70 else "NOT met"))
    funcol_lines = []
    if rc["FUNCOL_RC"] == 0:
        with open(os.path.join(out, "bench_funcol.log")) as f:
            funcol_lines = [ln.rstrip() for ln in f
                            if re.match(r"^\s*(world\s+call|\d+\s+(op|eager|compiled)\s)", ln)]
        rows.append(("funcol host time (information)", "see below", "", ""))
    else:
        rows.append(("funcol host time (information)",
                     ran(rc["FUNCOL_RC"], os.path.join(out, "bench_funcol.log")), "", "not counted"))

w = [max(len(r[i]) for r in rows + [("item", "result", "target", "verdict")]) for i in range(4)]
line = "+" + "+".join("-" * (x + 2) for x in w) + "+"
print("== tccomm GPU acceptance: summary")
print(line)
for i, r in enumerate([("item", "result", "target", "verdict")] + rows):
    print("| " + " | ".join(c.ljust(x) for c, x in zip(r, w)) + " |")
    if i == 0:
        print(line)
print(line)
print("benchmark targets are reported, not enforced")
if failed_names:
    print("failed tests:")
    for name in failed_names[:20]:
        print(f"  {name}")
    if len(failed_names) > 20:
        print(f"  ... and {len(failed_names) - 20} more ({junit})")
if skip_reasons:
    print("skipped tests, by reason:")
    for msg, k in sorted(skip_reasons.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {k:3d} x {msg[:150]}")
if E["SWEEP_SKIP"]:
    print(f"sweep {E['SWEEP_SKIP']}")
if rc["HOST_RC"] != -1 and E["SKIP_BENCH"] != "1" and funcol_lines:
    print("functional all_reduce, host time per call (us), bench/bench_funcol.py --device cuda --worlds 1:")
    for ln in funcol_lines:
        print("  " + ln)
print(f"logs, JUnit XML, CSVs: {out}")
PY

EXIT=0
if [ "$BUILD_RC" -ne 0 ] || [ -n "$ENV_PROBLEM" ]; then
  EXIT=1
fi
if [ "$TEST_RC" -gt 0 ]; then
  EXIT=1
fi
if [ "$HOST_RC" -gt 0 ] || [ "$SWEEP_RC" -gt 0 ]; then
  EXIT=1
fi
if [ "$BUILT" -eq 1 ]; then
  echo "note: this replaced the checkout's build (torchcomm_backend/_C*.so) with one for"
  echo "      $VENV: a venv with another torch needs scripts/setup_env.sh VENV again"
fi
echo "exit code $EXIT"
exit "$EXIT"
