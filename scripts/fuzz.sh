#!/usr/bin/env bash
# Bounded libFuzzer run of every fuzz target (tests/fuzz/*_fuzzer.c),
# starting from its corpus (copied: the checked-in corpus is not changed).
# Needs clang. Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
if ! command -v clang >/dev/null; then
  echo "fuzz.sh: clang not found; skipping the fuzz run" >&2
  exit 0
fi
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCKPT_FUZZ=ON \
  -DBUILD_TESTING=ON >/dev/null
targets=$(ls tests/fuzz/*_fuzzer.c | xargs -n1 basename | sed 's/\.c$//')
cmake --build build-fuzz -j"$(nproc)" --target $targets >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in $targets; do
  mkdir -p "$work/$t"
  cp tests/fuzz/corpus/"$t"/* "$work/$t"/
  build-fuzz/bin/"$t" -max_total_time="$secs" -print_final_stats=1 \
    "$work/$t" >"$work/$t.log" 2>&1 || {
    tail -50 "$work/$t.log"
    echo "fuzz.sh: $t found a crash (log above)" >&2
    exit 1
  }
  echo "$t: $(grep -E '^Done' "$work/$t.log")"
done
