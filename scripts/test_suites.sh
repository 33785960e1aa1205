#!/usr/bin/env bash
# `make test`'s runs, in the order that keeps the whole under CI's 20 minutes on two cores:
#
# 1. the unit tests, on two xdist workers (in process, CPU-bound, a few with real timeouts);
# 2. three lanes at once:
#    - the tests that start real processes and bound a failover or a timeout, one at a
#      time as those bounds assume;
#    - beside them at `nice -n 10`, the real-process tests that bound neither (BESIDE:
#      Spark, the fuzzers, the distributions, the command line, the README's commands,
#      authentication and limits, start-up checks): each takes the CPU
#      the first lane leaves while it waits on elections, and yields it when that lane
#      wants it (CFS gives nice 0 about nine tenths against nice 10);
#    - the simulators' seeds on two xdist workers at `nice -n 19`, on virtual time
#      (tests/sim/virtual_loop.py): they can only be slowed by the others, never made to
#      fail.
#
# The run is CPU-bound: the first lane uses about one core, the simulators take the rest.
# Measured on CI's VM: the real-process tests in one lane took 15.5-17.5 minutes
# (2026-11-30/12-01: 982-1,048 s; the whole run 1,143-1,222 s), the simulators beside
# them 13-16 minutes; with BESIDE in its own lane and 600 whole-node seeds instead of 800
# (tests/sim/conftest.py), see the comment at BESIDE. Each lane's output is printed after
# the first lane's own.
# Any run's failure (including pytest's 5, nothing collected) fails the whole.
#
# Usage: scripts/test_suites.sh VENV_BIN
set -uo pipefail

bin=${1:?usage: scripts/test_suites.sh VENV_BIN}
common=(-q -p no:cacheprovider)

"$bin/pytest" "${common[@]}" -n 2 --dist loadfile --durations=10 tests/unit || exit $?

# Real-process test files that bound no failover and no timeout (nothing in them is
# judged by how soon it happens), for the lane beside the failover tests. A file not
# listed runs in the failover lane; a listed file that is gone fails the run (pytest's 4).
BESIDE=(
    tests/spark
    tests/fuzz
    tests/integration/test_distributions.py
    tests/integration/test_cli_smoke.py
    tests/integration/test_readme_commands.py
    tests/integration/test_auth.py
    tests/integration/test_client_limits.py
    tests/integration/test_security_startup.py
    tests/integration/test_deploy_commands.py
)
ignore_beside=()
for path in "${BESIDE[@]}"; do
    ignore_beside+=("--ignore=$path")
done

sim_log=$(mktemp "${TMPDIR:-/tmp}/squall-sim.XXXXXX")
beside_log=$(mktemp "${TMPDIR:-/tmp}/squall-beside.XXXXXX")
# setsid: each lane its own process group (it is not a group leader, so it does not fork
# and $! is the group's id), so an interrupted run stops its workers and services too, by
# that id.
setsid nice -n 19 "$bin/pytest" "${common[@]}" -n 2 --dist loadfile --durations=10 tests/sim \
    >"$sim_log" 2>&1 &
sims=$!
setsid nice -n 10 "$bin/pytest" "${common[@]}" --durations=10 "${BESIDE[@]}" \
    >"$beside_log" 2>&1 &
beside=$!
stop_lanes() {
    # SIGINT, as Ctrl-C: pytest then runs its fixtures' finalizers, which stop the
    # services a lane started (by PID; they run in sessions of their own).
    # Bounded: whatever is left after 60 s is killed.
    kill -INT -- "-$sims" "-$beside" 2>/dev/null
    for _ in $(seq 60); do
        kill -0 -- "-$sims" 2>/dev/null || kill -0 -- "-$beside" 2>/dev/null || break
        sleep 1
    done
    kill -KILL -- "-$sims" "-$beside" 2>/dev/null
    rm -f "$sim_log" "$beside_log"
}
trap stop_lanes EXIT
trap 'exit 130' INT TERM

"$bin/pytest" "${common[@]}" --durations=25 --ignore=tests/unit --ignore=tests/sim \
    "${ignore_beside[@]}"
real=$?

echo "-- the real-process tests beside them (at nice 10: ${BESIDE[*]}):"
wait "$beside"
besides=$?
cat "$beside_log"
echo "-- the simulators (tests/sim, at nice 19 beside the real-process tests):"
wait "$sims"
sim=$?
cat "$sim_log"
trap - EXIT
rm -f "$sim_log" "$beside_log"

echo "-- unit: passed; real processes: exit $real, beside them: exit $besides; simulators: exit $sim"
[ "$real" -eq 0 ] && [ "$besides" -eq 0 ] && [ "$sim" -eq 0 ]
