#!/usr/bin/env bash
# Install the Debian packages ckptfs needs to build, run and test.
# Run as root (or with sudo) on Debian 12 (bookworm) or later.
set -euo pipefail
pkgs=(
  build-essential cmake pkg-config        # toolchain
  libfuse3-dev fuse3                      # FUSE library and fusermount3
  libopenmpi-dev openmpi-bin              # MPI (mpirun, mpicc)
  libsqlite3-dev sqlite3                  # metadata, and the sqlite3 CLI
  libxxhash-dev                           # XXH3-64 checksums
  libcmocka-dev                           # unit tests
  python3 attr                            # integration tests, getfattr
  iproute2                                # multi-node tests: ip, ss (netns)
  clang libclang-rt-dev                    # libFuzzer and sanitizer runtimes
  python3-torch python3-numpy             # Python client and PyTorch example tests
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
