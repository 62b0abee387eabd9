#!/usr/bin/env bash
# The C++ shim and the C core under AddressSanitizer + UBSan, in real
# process groups: builds the extension with TCCOMM_BUILD_VARIANT=asan out
# of tree (the normal build is untouched), runs a representative part of
# the pytest suite with gcc's ASan runtime preloaded into every process, and
# fails on any test failure and on any sanitizer report, printing them.
#
#   scripts/asan_pytest.sh [PYTEST ARGS...]   default: the subset below
#
#   PYTHON     interpreter with torch (default: .venv/bin/python)
#   ASAN_DIR   where the build, the logs and the reports go
#              (default: build/variants/asan)
#
# Why these settings:
#  - LD_PRELOAD: python is not built with ASan, so the runtime must be the
#    first library of each process (the ranks inherit it). libstdc++ comes
#    right after it: python does not link it, and ASan can only intercept
#    __cxa_throw (torch throws and catches C++ exceptions all the time) in
#    a library that is there when ASan starts.
#  - detect_leaks=0: at exit CPython and torch leave their interned
#    objects, registries and thread pools allocated on purpose; leak reports
#    would be about them, not about tccomm. The C core's own leaks are
#    checked by `make -C csrc/c_core asan` (detect_leaks=1).
#  - halt_on_error, and -fno-sanitize-recover=all in setup.py: a report
#    ends the process, so the case it happened in (or the group's teardown
#    test, which requires exit code 0) fails and shows the rank's log.
#    Reports are also looked for in the pytest log and, for ASan, in
#    log_path files (which also catch a report from the pytest process).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=$(realpath -s "${PYTHON:-.venv/bin/python}")  # -s: a venv's python is a link
ASAN_DIR=$(realpath -m "${ASAN_DIR:-build/variants/asan}")
pkg=$ASAN_DIR/pkg
reports=$ASAN_DIR/reports

if [ $# -eq 0 ]; then
  # Every op on two dtypes and one half type over shared memory (2 ranks) and
  # TCP (3 ranks), sizes 0 to ~2 Mi elements; the features, bad input and
  # reliability cases of the same specs, and a peer that never arrives; the
  # flight recorder (failure, signal and on-demand dumps).
  set -- "$ROOT/tests/test_collectives.py" "$ROOT/tests/test_features.py" \
    "$ROOT/tests/test_bad_input.py" "$ROOT/tests/test_reliability.py" \
    "$ROOT/tests/test_flight_recorder.py" "$ROOT/tests/test_torchcomm_api.py" \
    -k "((w2-shm-env: or w3-tcp-env: or w2-tcp-env-timeout:) and not (-MIN- or -MAX- or -BAND- or -BOR- or -BXOR- or -PRODUCT- or -PREMUL_SUM- or float64 or float16 or int8 or int16 or int32 or uint8 or bool)) or test_flight_recorder or (torchcomm-w2: and direct_path) or test_direct_entry_points"
fi

start=$(date +%s)
echo "=== building the extension with TCCOMM_BUILD_VARIANT=asan ($ASAN_DIR)"
mkdir -p "$pkg/torchcomm_backend"
TCCOMM_BUILD_VARIANT=asan MAX_JOBS=2 "$PYTHON" setup.py -q build_ext \
  --build-lib "$pkg" --build-temp "$ASAN_DIR/tmp" > "$ASAN_DIR/build.log" 2>&1 \
  || { tail -40 "$ASAN_DIR/build.log"; echo "FAIL: ASan extension build"; exit 1; }
cp torchcomm_backend/*.py "$pkg/torchcomm_backend/"
echo "=== build took $(( $(date +%s) - start )) s"

# The runtime of the compiler that built the extension (setup.py uses cc / c++).
libasan=$(realpath "$(${CC:-cc} -print-file-name=libasan.so)")
libstdcxx=$(realpath "$(${CXX:-c++} -print-file-name=libstdc++.so)")
[ -f "$libasan" ] && [ -f "$libstdcxx" ] || { echo "FAIL: no libasan.so / libstdc++.so from ${CC:-cc}"; exit 1; }
export LD_PRELOAD=$libasan:$libstdcxx${LD_PRELOAD:+:$LD_PRELOAD}
rm -rf "$reports" && mkdir -p "$reports"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}
# Sanitized ranks are slower: more room before a case counts as hung.
export TCCOMM_TEST_CASE_TIMEOUT=${TCCOMM_TEST_CASE_TIMEOUT:-150}

loaded=$(cd tests && "$PYTHON" -c 'import torchcomm_backend._C as c; print(c.__file__)')
case $loaded in
  "$pkg"/*) echo "=== ranks load $loaded with $libasan preloaded" ;;
  *) echo "FAIL: the ranks would load $loaded, not the ASan build under $pkg"; exit 1 ;;
esac
nm -D "$loaded" | grep __asan_init > /dev/null || { echo "FAIL: $loaded is not instrumented"; exit 1; }

t0=$(date +%s)
status=0
# cwd = the package copy: the pytest process imports it too.
(cd "$pkg" && "$PYTHON" -m pytest -q -p no:cacheprovider -rfE --rootdir "$ROOT" "$@") \
  > "$ASAN_DIR/pytest.log" 2>&1 || status=$?
tail -25 "$ASAN_DIR/pytest.log"
echo "=== pytest under ASan finished in $(( $(date +%s) - t0 )) s with exit code $status"
[ "$status" -eq 0 ] || echo "FAIL: pytest under ASan (log: $ASAN_DIR/pytest.log)"

shopt -s nullglob
found=("$reports"/*)
in_log=$(grep -cE 'runtime error:|ERROR: AddressSanitizer|AddressSanitizer: CHECK' "$ASAN_DIR/pytest.log" || true)
if [ ${#found[@]} -gt 0 ] || [ "$in_log" -gt 0 ]; then
  echo "FAIL: sanitizer reports: ${#found[@]} file(s) in $reports, $in_log in the pytest log"
  for f in "${found[@]:0:5}"; do echo "--- $f"; head -60 "$f"; done
  # Each distinct report with its count, then the first one with its stack.
  grep -ohE '[^ ]+: runtime error: .*|ERROR: AddressSanitizer: [^ ]+ .*' "$ASAN_DIR/pytest.log" | sort | uniq -c
  grep -m1 -A8 -E 'runtime error:|ERROR: AddressSanitizer' "$ASAN_DIR/pytest.log" || true
  status=1
else
  echo "=== no sanitizer report"
fi
echo "=== ASan pytest run finished in $(( $(date +%s) - start )) s"
exit "$status"
