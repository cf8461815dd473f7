#!/usr/bin/env bash
# Build ckptfs and run the whole test suite (docs/testing.md says what runs
# where and why):
#   1. normal build (RelWithDebInfo): every test but the long runs (label
#      long), cores+2 at a time (CKPT_TEST_JOBS; most tests wait rather than
#      compute; the few that time themselves run alone);
#   2. AddressSanitizer + UndefinedBehaviorSanitizer build: the tests that
#      exercise memory (label sanitize: unit tests, fuzz corpora, the
#      daemon's stress, concurrency and hostile-input tests, and one world
#      of each kind);
#   3. ThreadSanitizer build: unit tests and the concurrency tests (label
#      tsan);
#   4. libFuzzer: every parser for 10 s (scripts/fuzz.sh N runs longer).
# Each stage prints its time, and the total at the end; past the budget
# (30 minutes: CI allows 90 and must keep room to grow) a warning names the
# slowest tests. CKPT_LONG=1 adds the long runs (label long) to stage 1
# and runs every test but the installed package's under ASan+UBSan in
# stage 2 (what the suite ran before it had a budget; about an hour).
# Needs root (FUSE mounts, mpirun as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)
# tests mostly wait (mounts, commits, timeouts): two more than the cores
# in the normal build, one more under the sanitizers (each test computes
# more there); a HEAVY test (tests/CMakeLists.txt) takes two of these slots
njobs=${CKPT_TEST_JOBS:-$((jobs + 2))}
tjobs=${CKPT_TEST_JOBS:-$((jobs + 1))}
budget=${CKPT_TEST_BUDGET:-1800}   # seconds
long=${CKPT_LONG:-0}
logs=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-test.XXXXXX")
t_start=$SECONDS
stages=()

stage() {   # NAME COMMAND...: run it, print and keep its time
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== stage: $name"
  "$@" || rc=$?
  local dt=$((SECONDS - t0))
  stages+=("$(printf '%-34s %5d s (%d:%02d)' "$name" "$dt" $((dt / 60)) $((dt % 60)))")
  echo "== stage: $name: $dt s$([ $rc = 0 ] || echo ", FAILED (exit $rc)")"
  return $rc
}

summary() {
  local total=$((SECONDS - t_start))
  echo "== test.sh timing (budget $((budget / 60)) min):"
  printf '   %s\n' "${stages[@]}"
  printf '   %-34s %5d s (%d:%02d)\n' total "$total" $((total / 60)) $((total % 60))
  if ((total > budget)); then
    echo "WARNING: the suite took $((total / 60)) min, over its budget of $((budget / 60)) min." \
         "The slowest tests (seconds, build):"
    cat "$logs"/*.times 2>/dev/null | sort -rn | head -15 | sed 's/^/   /'
  fi
}
trap 'summary; rm -rf "$logs"' EXIT

run_ctest() {   # BUILD_DIR TAG CTEST_ARGS...: ctest, its per-test times kept
  local dir=$1 tag=$2 rc=0
  shift 2
  (cd "$dir" && ctest --output-on-failure "$@") 2>&1 | tee "$logs/$tag.log" || rc=$?
  sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9.]+) sec$/\2 \1/p' \
    "$logs/$tag.log" | awk -v t="$tag" '{printf "%8.1f  %s (%s)\n", $1, $2, t}' \
    >"$logs/$tag.times"
  return $rc
}

build() {   # BUILD_DIR CMAKE_ARGS...
  local dir=$1
  shift
  cmake -S . -B "$dir" "$@" >/dev/null
  cmake --build "$dir" -j"$jobs"
}

if [ "$long" = 1 ]; then
  normal_sel=() asan_sel=(-LE package -E '^integration_hostile_many_small_files$')
else
  normal_sel=(-LE long) asan_sel=(-L 'unit|fuzz|sanitize' -LE long)
fi

stage "build (RelWithDebInfo)" build build -DCMAKE_BUILD_TYPE=RelWithDebInfo
stage "ctest (normal, -j$njobs)" run_ctest build normal -j"$njobs" "${normal_sel[@]}"

stage "build (ASan+UBSan)" build build-asan -DCMAKE_BUILD_TYPE=Debug -DCKPT_SANITIZE=ON
asan_ctest() { ASAN_OPTIONS=detect_leaks=1 run_ctest build-asan asan "$@"; }
stage "ctest (ASan+UBSan, -j$tjobs)" asan_ctest -j"$tjobs" "${asan_sel[@]}"

stage "build (TSan)" build build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_TSAN=ON
stage "ctest (TSan, -j$tjobs)" run_ctest build-tsan tsan -j"$tjobs" -L 'unit|tsan' -LE long

stage "fuzz (10 s per parser)" scripts/fuzz.sh 10
echo "all tests passed"
