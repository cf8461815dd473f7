#!/usr/bin/env bash
# Bounded libFuzzer run of every fuzz target (tests/fuzz/*_fuzzer.c),
# starting from its corpus (copied: the checked-in corpus is not changed).
# Needs clang and its runtimes (Debian: clang libclang-rt-dev, installed by
# scripts/install-deps.sh). Without them it fails, unless CKPT_ALLOW_NO_FUZZ=1
# is set: then it says why and skips the run.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Can clang build and link a libFuzzer binary with ASan and UBSan here?
why=""
if ! command -v clang >/dev/null; then
  why="clang not found"
else
  printf '%s\n' '#include <stddef.h>' '#include <stdint.h>' \
    'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }' \
    >"$work/probe.c"
  if ! clang -fsanitize=fuzzer,address,undefined "$work/probe.c" \
       -o "$work/probe" 2>"$work/probe.log"; then
    why="clang cannot link -fsanitize=fuzzer,address,undefined: $(grep -m1 -E 'error|cannot find' "$work/probe.log" || head -1 "$work/probe.log")"
  fi
fi
if [ -n "$why" ]; then
  msg="fuzz.sh: $why (Debian: apt-get install --no-install-recommends clang libclang-rt-dev, or scripts/install-deps.sh)"
  if [ "${CKPT_ALLOW_NO_FUZZ:-0}" = 1 ]; then
    echo "$msg; skipping the fuzz run (CKPT_ALLOW_NO_FUZZ=1)" >&2
    exit 0
  fi
  echo "$msg; set CKPT_ALLOW_NO_FUZZ=1 to skip instead" >&2
  exit 1
fi

cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCKPT_FUZZ=ON \
  -DBUILD_TESTING=ON >/dev/null
targets=$(ls tests/fuzz/*_fuzzer.c | xargs -n1 basename | sed 's/\.c$//')
cmake --build build-fuzz -j"$(nproc)" --target $targets >/dev/null
# One target per core at a time: each gets its SECONDS of one core.
run_one() {   # TARGET: fuzz it; its log in $work/TARGET.log
  local t=$1
  mkdir -p "$work/$t"
  cp tests/fuzz/corpus/"$t"/* "$work/$t"/
  build-fuzz/bin/"$t" -max_total_time="$secs" -print_final_stats=1 \
    "$work/$t" >"$work/$t.log" 2>&1
}
pids=() names=() failed=0
for t in $targets; do
  run_one "$t" &
  pids+=($!) names+=("$t")
  if ((${#pids[@]} >= $(nproc))); then
    wait "${pids[0]}" || failed=1
    [ $failed = 0 ] || { t=${names[0]}; break; }
    echo "${names[0]}: $(grep -E '^Done' "$work/${names[0]}.log")"
    pids=("${pids[@]:1}") names=("${names[@]:1}")
  fi
done
while [ $failed = 0 ] && ((${#pids[@]})); do
  wait "${pids[0]}" || { failed=1; t=${names[0]}; break; }
  echo "${names[0]}: $(grep -E '^Done' "$work/${names[0]}.log")"
  pids=("${pids[@]:1}") names=("${names[@]:1}")
done
if [ $failed = 1 ]; then
  wait || true
  tail -50 "$work/$t.log"
  echo "fuzz.sh: $t found a crash (log above)" >&2
  exit 1
fi
