#!/usr/bin/env bash
# Run a pytest selection next to a CPU-bound neighbour: a busy loop pinned to one core.
#
#   benchmarks/noisy_neighbour.sh                                   # the whole suite
#   benchmarks/noisy_neighbour.sh tests/placement/test_placement.py -m "not slow"
#
# Arguments go to pytest as they are (default: the whole suite, -q). PYTHON picks the interpreter
# (default: python), NEIGHBOUR_CORE the core the busy loop is pinned to (default: the last core this
# shell may use). The neighbour is killed when pytest ends, fails or is interrupted; the exit code is
# pytest's. Tests must pass here as they do on a quiet machine: none may decide pass/fail from
# wall-clock time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
cores=$(taskset -cp $$ | sed 's/.*: //')            # e.g. 0-1 or 0,2-3
last=$(tr ',' '\n' <<<"$cores" | tail -1 | sed 's/.*-//')
core=${NEIGHBOUR_CORE:-$last}

taskset -c "$core" bash -c 'while :; do :; done' &
neighbour=$!
trap 'kill "$neighbour" 2>/dev/null || true; wait "$neighbour" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM
echo "noisy neighbour: pid $neighbour, a busy loop pinned to core $core (this shell may use cores $cores)"

if [ "$#" -eq 0 ]; then
    set -- -q
fi
status=0
"$PYTHON" -m pytest "$@" || status=$?
echo "noisy neighbour: pytest exited with $status"
exit "$status"
