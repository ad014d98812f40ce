#!/bin/sh
# Runs inside a virtme-ng guest (see matrix.py), and on the host: this repository is an overlay
# whose writes stay in the guest; RESULTS is the one directory shared read-write with the host.
# Usage: guest.sh RESULTS CHECK_SECONDS TEST_SECONDS ROUNDS [PYTEST ARGS]. Runs `aiprobe check`, then
# (once RESULTS/hold is gone: matrix.py's Host) the tests. Leaves in RESULTS:
# check.json and check.err (`aiprobe check --json`), junit-<round>.xml and pytest-<round>.log (the
# selection, run ROUNDS times in a row to find flakes), failures-<round>.log (each failure as it
# happened, also of a round that was stopped), rc (the last failing round's status), steps.log (each
# step's status and time), heartbeat (rewritten every 10 s while it runs), progress (the step
# running, then the test that last started or finished: tests/conftest.py writes it), and hung.log
# when a step made no progress for its bound: CHECK_SECONDS for `aiprobe check` as a whole,
# TEST_SECONDS (and a minute) for a round's collection and for each of its tests, so a slow machine
# that keeps finishing tests is never stopped. hung.log holds every task's kernel stack; then SIGABRT goes to
# the step's Python processes, whose faulthandler writes their threads' stacks to the step's log.
# So a hang is a failure that says where, never a stalled CI.
RESULTS=$1 CHECK_SECONDS=$2 TEST_SECONDS=$3 ROUNDS=$4
shift 4
cd "$(dirname "$0")/../.." || exit 1
export PYTHONFAULTHANDLER=1 AIPROBE_PROGRESS="$RESULTS/progress"

descendants() {
    for child in $(pgrep -P "$1"); do
        echo "$child"
        descendants "$child"
    done
}

dump_and_abort() {  # dump_and_abort PID STEP SECONDS
    {
        echo "== $2: no progress for $3 s (the last: $(cat "$AIPROBE_PROGRESS" 2>/dev/null)); its processes:"
        for pid in $1 $(descendants "$1"); do
            echo "-- pid $pid: $(tr '\0' ' ' < /proc/"$pid"/cmdline 2>/dev/null)"
            for task in /proc/"$pid"/task/*; do
                echo "   task ${task##*/} $(cat "$task"/comm 2>/dev/null) wchan=$(cat "$task"/wchan 2>/dev/null)"
                sed 's/^/     /' "$task"/stack 2>/dev/null
            done
        done
    } >> "$RESULTS/hung.log" 2>&1
    for pid in $(descendants "$1") $1; do
        case "$(cat /proc/"$pid"/comm 2>/dev/null)" in python* | aiprobe | pytest) kill -ABRT "$pid" 2>/dev/null ;; esac
    done
    for _ in 1 2 3 4 5 6 7 8 9 10; do  # time to write the stacks, then whatever is left goes
        kill -0 "$1" 2>/dev/null || return
        sleep 1
    done
    kill -KILL "$1" $(descendants "$1") 2>/dev/null
}

bounded() {  # bounded SECONDS STEP COMMAND...: the command's status (SIGABRT's when it made no progress for SECONDS)
    seconds=$1 step=$2 started=$(date +%s)
    shift 2
    echo "$step started" > "$AIPROBE_PROGRESS"
    "$@" &
    pid=$!
    watch_progress "$pid" "$step" "$seconds" &
    watchdog=$!
    wait "$pid"
    status=$?
    kill "$watchdog" 2>/dev/null
    echo "$step: exit $status after $(($(date +%s) - started)) s" >> "$RESULTS/steps.log"
    return "$status"
}

watch_progress() {  # watch_progress PID STEP SECONDS: dump_and_abort once the progress file stays the same for SECONDS
    trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
    # Its content, not its age: the file's times come from the host's clock (9p), this loop's from the guest's.
    last=$(cat "$AIPROBE_PROGRESS" 2>/dev/null) since=$(date +%s)
    while kill -0 "$1" 2>/dev/null; do
        sleep 5 &
        sleeper=$!
        wait "$sleeper"
        now=$(cat "$AIPROBE_PROGRESS" 2>/dev/null)
        if [ "$now" != "$last" ]; then
            last=$now since=$(date +%s)
        elif [ $(($(date +%s) - since)) -ge "$3" ]; then
            dump_and_abort "$1" "$2" "$3"
            return
        fi
    done
}

ip link set lo up
# Alive: matrix.py takes a heartbeat that stopped for minutes as a frozen guest (FROZEN_SECONDS).
(while :; do date +%s > "$RESULTS/heartbeat"; sleep 10; done) &
heartbeat=$!
trap 'kill "$heartbeat"' EXIT
# test_check reads this check's report and, in the kernel log, what its loads logged after this line.
export AIPROBE_CHECK_REPORT="$RESULTS/check.json"
echo "aiprobe: check --json > $AIPROBE_CHECK_REPORT" > /dev/kmsg
bounded "$CHECK_SECONDS" "aiprobe check" .venv/bin/aiprobe check --json > "$AIPROBE_CHECK_REPORT" 2> "$RESULTS/check.err"
# The host's own selection compiles the fixtures the tests reuse: matrix.py holds the tests until it ends.
echo "waiting for the host's selection" > "$AIPROBE_PROGRESS"
while [ -e "$RESULTS/hold" ]; do
    touch "$AIPROBE_PROGRESS"  # waiting is progress: the host's own tests are bounded on their own
    sleep 2
done
rc=0
# pytest-timeout fails a test that outlives TEST_SECONDS with its threads' stacks, and the round goes on;
# a minute later the watchdog ends a round that even that could not stop (a hang in C, in collection).
for round in $(seq "$ROUNDS"); do
    AIPROBE_FAILURE_LOG="$RESULTS/failures-$round.log" \
        bounded $((TEST_SECONDS + 60)) "pytest round $round" .venv/bin/pytest -p no:cacheprovider -ra \
        --durations=25 --timeout="$TEST_SECONDS" --junitxml="$RESULTS/junit-$round.xml" "$@" \
        > "$RESULTS/pytest-$round.log" 2>&1 || rc=$?
done
echo $rc > "$RESULTS/rc"
