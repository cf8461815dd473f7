#!/usr/bin/env bash
# Build ckptfs and run the whole test suite: unit and integration tests in
# a normal build, then the same tests but the package's (label package)
# under AddressSanitizer and UndefinedBehaviorSanitizer, then the unit
# tests and the concurrency stress test (label tsan) under ThreadSanitizer.
# Needs root (FUSE mounts, mpirun as root).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)

cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j"$jobs"
(cd build && ctest --output-on-failure -j1)

cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCKPT_SANITIZE=ON
cmake --build build-asan -j"$jobs"
# the installed package (label package) is tested in the normal build only
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j1 -LE package)

cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPT_TSAN=ON
cmake --build build-tsan -j"$jobs"
(cd build-tsan && ctest --output-on-failure -j1 -L 'unit|tsan')
scripts/fuzz.sh 20  # a bounded libFuzzer run of every parser
echo "all tests passed"
