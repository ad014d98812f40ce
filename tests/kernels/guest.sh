#!/bin/sh
# Runs inside a virtme-ng guest (see matrix.py): this repository is an overlay whose writes stay in
# the guest; RESULTS is the one directory shared read-write with the host. Leaves there:
# check.json (`aiprobe check --json`), junit.xml and pytest.log (the selection), rc (pytest's status).
RESULTS=$1
shift
cd "$(dirname "$0")/../.." || exit 1
ip link set lo up
.venv/bin/aiprobe check --json > "$RESULTS/check.json" 2> "$RESULTS/check.err"
.venv/bin/pytest -p no:cacheprovider -ra --durations=25 --junitxml="$RESULTS/junit.xml" "$@" > "$RESULTS/pytest.log" 2>&1
echo $? > "$RESULTS/rc"
