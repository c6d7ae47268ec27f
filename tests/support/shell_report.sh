# The report of the shell test suites (tests/slurm, tests/cluster), sourced by each: one line per
# check (`  ok`, `  FAIL`, `  skip`), phases with their times, and the closing count line
# `N passed, N failed, N skipped` that the Makefile and CI read.
PASSED=0 FAILED=0 SKIPPED=0
FAILURES=()
pass() { PASSED=$((PASSED + 1)); echo "  ok   $1${2:+  ($2)}"; }
fail() { FAILED=$((FAILED + 1)); FAILURES+=("$1"); echo "  FAIL $1${2:+  ($2)}"; }
skip() { SKIPPED=$((SKIPPED + 1)); echo "  skip $1${2:+  ($2)}"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T_ALL=$(now)
PHASE_T=
phase() { # phase NAME: ends the previous phase (prints its time), starts the next; `phase end` ends the last
  [ -z "$PHASE_T" ] || echo "   ($PHASE_NAME: $(since "$PHASE_T") s)"
  PHASE_NAME=$1; PHASE_T=$(now)
  [ "$1" = end ] || echo "== $1"
}
summary() { # ends the last phase; the total time, the failures by name, the count line
  phase end
  echo "== $(since "$T_ALL") s in all"
  for f in ${FAILURES[@]+"${FAILURES[@]}"}; do echo "FAILED: $f"; done
  echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
}
