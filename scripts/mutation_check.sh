#!/usr/bin/env bash
# Shows that the tests can fail: builds the C core's deliberate bugs
# (csrc/c_core/src/core/mutation.h, compiled only with -DTCC_MUTATIONS) into the
# C tests (make -C csrc/c_core mutant) and into an out-of-tree copy of the
# extension, then for each bug runs a few targeted tests with
# TCCOMM_MUTATION=<bug> and requires every one of them to fail, and runs
# the same tests with no bug selected and requires them all to pass.
# Prints a table: bug -> the tests that caught it.
#
#   scripts/mutation_check.sh [MUTATION...]     default: every one below
#
#   PYTHON            interpreter with torch (default: .venv/bin/python)
#   MUTANT_DIR        where the extension copy is built (default:
#                     build/variants/mutant; the normal build is untouched)
#   C_TEST_LIMIT_S    a C test still running after this has missed its bug
#                     (they notice a dead peer within seconds; default 20),
#                     or after 3x its time with no mutation plus 5 s, if
#                     longer (a slow machine must not pass a mutant, nor fail
#                     a test that was merely slow)
#   C_BASELINE_LIMIT_S  the bound of a C test with no mutation (default 300)
#
# The C tests and the pytest cases run one after the other (each group
# already uses every core). pytest runs with cwd = the package copy, so
# that the pytest process and the ranks it spawns (PYTHONPATH) import the
# mutant build, which is checked before anything runs.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=$(realpath -s "${PYTHON:-.venv/bin/python}")  # -s: a venv's python is a link
MUTANT_DIR=$(realpath -m "${MUTANT_DIR:-build/variants/mutant}")
C_TEST_LIMIT_S=${C_TEST_LIMIT_S:-20}
C_BASELINE_LIMIT_S=${C_BASELINE_LIMIT_S:-300}
CTESTS=csrc/c_core/build/mutant/tests
# A mutant that hangs a case fails it after this, not after the default 75 s.
export TCCOMM_TEST_CASE_TIMEOUT=${TCCOMM_TEST_CASE_TIMEOUT:-30}

# name | C tests (;-separated) | pytest file | pytest -k selection
# Specs: w2-shm-env is 2 ranks over shared memory, w3-tcp-env 3 ranks over
# TCP; sites shared by both transports are checked on one of each.
MUTATIONS=(
  "avg_divisor|test_reduce;test_comm tcp|tests/test_collectives.py|w3-tcp-env: and all_reduce- and -AVG-n1023"
  "allgather_corrupt_byte|test_comm shm|tests/test_collectives.py|w3-tcp-env: and all_gather and n1023"
  "barrier_skip_peer|test_comm shm|tests/test_features.py|w2-shm-env:barrier"
  "broadcast_wrong_root|test_comm tcp|tests/test_collectives.py|w2-shm-env:broadcast-"
  "reduce_scatter_swap|test_comm shm|tests/test_collectives.py|w3-tcp-env:reduce_scatter and -SUM-n1023"
  "p2p_tag_ignored|test_comm tcp|tests/test_features.py|w2-shm-env:p2p_tags"
  "p2p_done_early|test_p2p_direct|tests/test_features.py|w2-shm-env:p2p_send_buffer_reused"
  "dead_peer_unreported|test_faults shm|tests/test_fault_injection.py|shm"
  "mismatch_unchecked|test_comm shm|tests/test_bad_input.py|w2-shm-env: and (mismatched_numel or mismatched_dtype or mismatched_broadcast_root)"
  "unread_frames_unchecked|test_one_sided|tests/test_bad_input.py|w3-tcp-env-onesided:"
)
# Fault trials are slow when nobody notices the death (30 s each): one.
export TCCOMM_FAULT_TRIALS=${TCCOMM_FAULT_TRIALS:-1}

want=("$@")
selected=()
for entry in "${MUTATIONS[@]}"; do
  name=${entry%%|*}
  grep -q "\"$name\"" csrc/c_core/src/core/mutation.h || { echo "mutation_check: '$name' is not in mutation.h"; exit 2; }
  if [ ${#want[@]} -eq 0 ] || [[ " ${want[*]} " == *" $name "* ]]; then selected+=("$entry"); fi
done
[ ${#selected[@]} -gt 0 ] || { echo "mutation_check: no mutation selected from: $*"; exit 2; }

start=$(date +%s)
echo "=== building the C tests with -DTCC_MUTATIONS (csrc/c_core/build/mutant)"
make -C csrc/c_core -j2 --no-print-directory mutant > /dev/null

echo "=== building the extension with TCCOMM_BUILD_VARIANT=mutant ($MUTANT_DIR)"
pkg=$MUTANT_DIR/pkg
mkdir -p "$pkg/torchcomm_backend"
TCCOMM_BUILD_VARIANT=mutant MAX_JOBS=2 "$PYTHON" setup.py -q build_ext \
  --build-lib "$pkg" --build-temp "$MUTANT_DIR/tmp" > "$MUTANT_DIR/build.log" 2>&1 \
  || { tail -40 "$MUTANT_DIR/build.log"; echo "FAIL: mutant extension build"; exit 1; }
cp torchcomm_backend/*.py "$pkg/torchcomm_backend/"
export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}
loaded=$(cd tests && "$PYTHON" -c 'import torchcomm_backend._C as c; print(c.__file__)')
case $loaded in
  "$pkg"/*) echo "=== ranks load $loaded" ;;
  *) echo "FAIL: the ranks would load $loaded, not the mutant build under $pkg"; exit 1 ;;
esac
echo "=== builds took $(( $(date +%s) - start )) s"

logs=$MUTANT_DIR/logs
rm -rf "$logs" && mkdir -p "$logs"

# run_c NAME "TEST ARGS" LIMIT_S: exit status of one C test, bounded.
run_c() {
  local log=$logs/$1-${2// /_}.log
  # Line-buffered: a test killed at the limit still shows how far it got.
  # shellcheck disable=SC2086 # "test_comm shm": binary and argument
  (cd csrc/c_core && timeout "$3" stdbuf -oL -eL ./build/mutant/tests/$2) > "$log" 2>&1
}

# The limit of a C test under a mutation: C_TEST_LIMIT_S, or 3x the test's
# time with no mutation plus 5 s where that is longer.
declare -A c_limit=()
c_limit_from() {  # TEST ELAPSED_MS
  local scaled=$(( (3 * $2 + 999) / 1000 + 5 ))
  c_limit[$1]=$(( scaled > C_TEST_LIMIT_S ? scaled : C_TEST_LIMIT_S ))
}

# run_pytest NAME FILE... -k EXPR: exit status; failing test ids in $logs/NAME.failed
run_pytest() {
  local name=$1; shift
  local log=$logs/$name.pytest.log
  local rc=0
  (cd "$pkg" && "$PYTHON" -m pytest -q -p no:cacheprovider -rfE --rootdir "$ROOT" "$@") > "$log" 2>&1 || rc=$?
  grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) //; s/ - .*//; s/^.*:://' > "$logs/$name.failed" || true
  return $rc
}

# A baseline failure is printed again after the table (the end of the
# output is what a CI summary keeps), with the end of its log.
baseline_report=()
# baseline_failed WHAT LOG: remember a test that failed with no mutation.
baseline_failed() {
  baseline_report+=("FAIL with no mutation: $1 (log: $2)" "$(tail -25 "$2" | sed 's/^/    | /')")
  echo "${baseline_report[-2]}"
  status=1
}

status=0
echo "=== no mutation selected: every selected test must pass"
unset TCCOMM_MUTATION
t0=$(date +%s)
declare -A files_k=()
for entry in "${selected[@]}"; do
  IFS='|' read -r name ctests file expr <<< "$entry"
  IFS=';' read -ra cs <<< "$ctests"
  for c in "${cs[@]}"; do
    [ -z "${c_limit[$c]:-}" ] || continue  # run once, however many mutations select it
    t_ms=$(date +%s%3N)
    run_c none "$c" "$C_BASELINE_LIMIT_S" || baseline_failed "C $c (exit $?)" "$logs/none-${c// /_}.log"
    t_ms=$(( $(date +%s%3N) - t_ms ))
    c_limit_from "$c" "$t_ms"
    echo "    C $c: $(( t_ms / 1000 )).$(( t_ms % 1000 / 100 )) s (with a mutation: at most ${c_limit[$c]} s)"
  done
  files_k[$file]="${files_k[$file]:+${files_k[$file]} or }($expr)"
done
# One run per file: -k applies to every file of a run.
for f in "${!files_k[@]}"; do
  base=none-$(basename "$f" .py)
  if run_pytest "$base" "$ROOT/$f" -k "${files_k[$f]}"; then
    echo "    $f: $(tail -1 "$logs/$base.pytest.log")"
  else
    baseline_failed "pytest $f -k '${files_k[$f]}': $(paste -sd' ' "$logs/$base.failed")" "$logs/$base.pytest.log"
  fi
done
echo "=== baseline took $(( $(date +%s) - t0 )) s"

table=()
for entry in "${selected[@]}"; do
  IFS='|' read -r name ctests file expr <<< "$entry"
  export TCCOMM_MUTATION=$name
  t0=$(date +%s)
  caught=() missed=()
  IFS=';' read -ra cs <<< "$ctests"
  for c in "${cs[@]}"; do
    if run_c "$name" "$c" "${c_limit[$c]}"; then missed+=("C $c"); else caught+=("C $c"); fi
  done
  if run_pytest "$name" "$ROOT/$file" -k "$expr"; then
    missed+=("pytest $file -k '$expr'")
  else
    if [ -s "$logs/$name.failed" ]; then
      # "9 failed, 2 passed in 8.1s": how many of the selection caught it.
      counts=$(tail -1 "$logs/$name.pytest.log" | grep -oE '[0-9]+ (failed|passed|error)' | paste -sd, -)
      caught+=("pytest $(basename "$file") [$counts] e.g. $(head -1 "$logs/$name.failed")")
    else  # pytest itself broke: that proves nothing about the tests
      missed+=("pytest $file -k '$expr' exited without a failing test ($logs/$name.pytest.log)")
    fi
  fi
  unset TCCOMM_MUTATION
  secs=$(( $(date +%s) - t0 ))
  if [ ${#missed[@]} -gt 0 ]; then
    status=1
    table+=("$(printf '%-24s SURVIVED (%s s), not caught by: %s' "$name" "$secs" "$(IFS=,; echo "${missed[*]}")")")
  else
    table+=("$(printf '%-24s caught (%s s) by: %s' "$name" "$secs" "$(IFS=';'; echo "${caught[*]}")")")
  fi
  echo "${table[-1]}"
done

echo "=== mutation -> tests that caught it (every failing test id: $logs/<mutation>.failed)"
printf '%s\n' "${table[@]}"
[ ${#baseline_report[@]} -eq 0 ] || printf '%s\n' "${baseline_report[@]}"
echo "=== mutation check finished in $(( $(date +%s) - start )) s: $([ $status -eq 0 ] && echo ok || echo FAILED) (logs: $logs)"
exit $status
