#!/usr/bin/env bash
# Run a command N times in a row while busy loops keep every core busy; report how many passed.
#
#   bash scripts/under-load.sh N COMMAND [ARGS...]
#   bash scripts/under-load.sh 10 python -m pytest -q -p no:cacheprovider tests/real/test_rollout_weights.py
#
# What a test must survive in CI: CI runs on whatever machine submits, often with something else
# on its cores. A test that needs an event (an abort mid-generation, an update inside a request)
# must make it happen, not hope a sleep was long enough; this is how to check that it does.
# LOAD_PROCS (default: the number of cores) sets how many busy loops run. The loops die with the
# script, also when it is interrupted. Exit status: 0 only if every run passed.
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ ]]; then
    echo "usage: $0 N COMMAND [ARGS...]" >&2
    exit 2
fi
runs="$1"
shift

load_pids=()
run_pid=""
stop_all() {
    if [[ -n "$run_pid" ]]; then
        kill "$run_pid" 2>/dev/null || true
    fi
    if [[ ${#load_pids[@]} -gt 0 ]]; then
        kill "${load_pids[@]}" 2>/dev/null || true
        wait "${load_pids[@]}" 2>/dev/null || true
    fi
}
trap stop_all EXIT
# Interrupted: stop the run in progress and the remaining runs, not only the load.
trap 'exit 130' INT TERM

for _ in $(seq "${LOAD_PROCS:-$(nproc)}"); do
    # a pure-Python busy loop: one core each, no memory, no I/O
    python3 -c 'while True: pass' &
    load_pids+=("$!")
done

passed=0
for i in $(seq "$runs"); do
    start=$(date +%s)
    # in the background, so that a signal is handled at once rather than after the run
    "$@" &
    run_pid=$!
    if wait "$run_pid"; then
        passed=$((passed + 1))
        verdict=passed
    else
        verdict=FAILED
    fi
    run_pid=""
    printf '[under-load] run %d/%d %s in %d s (load average %s)\n' "$i" "$runs" "$verdict" \
        "$(($(date +%s) - start))" "$(cut -d' ' -f1 /proc/loadavg)" >&2
done
printf '[under-load] %d of %d runs passed with %d busy loops\n' "$passed" "$runs" "${#load_pids[@]}" >&2
[[ "$passed" -eq "$runs" ]]
