#!/usr/bin/env bash
# Run a command while CPU burners keep every core busy: BURNERS per core (default 2) busy
# loops at normal priority, the load a developer's machine or a shared CI runner has. No
# test may depend on the machine's speed; `make test-loaded` runs the suite this way.
#
#   bash scripts/with-burners.sh make test
#   BURNERS=4 bash scripts/with-burners.sh .venv/bin/python -m pytest -q tests/test_http.py
#
# Only the burners this script started are stopped (by their pids), on any exit.
set -euo pipefail

if [ "$#" -eq 0 ]; then
    echo "usage: with-burners.sh COMMAND [ARG...]" >&2
    exit 2
fi
per_core=${BURNERS:-2}
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)
n=$((per_core * cores))

pids=()
stop() {
    if [ "${#pids[@]}" -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq "$n"); do
    # A shell busy loop: no interpreter start-up, no memory, one core's worth of work each.
    sh -c 'while :; do :; done' &
    pids+=("$!")
done
echo "with-burners: $n CPU burners ($per_core per core, $cores cores) beside: $*" >&2

rc=0
"$@" || rc=$?
echo "with-burners: load average at the end: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')" >&2
exit "$rc"
